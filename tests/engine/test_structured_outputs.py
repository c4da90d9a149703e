"""Structured outputs: every constraint's text follows it, on the default model and tiny
random ones (SmolLM2's tokenizer), across chunked prefill, preemption, `n > 1`, speculative
decoding and resumes; bad constraints are refused naming `structured_outputs`; a request
waiting for its grammar holds back nobody, a failed one fails alone; requests without
constraints are untouched and cost nothing. Every engine test ends with the KV pool free."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch
import xgrammar as xgr

from engine import LLM, SamplingParams, StructuredOutputsParams, apply_chat_template
from engine.request import RequestStatus
from engine.sampler import Sampler, SamplingMetadata
from engine.structured_outputs import StructuredOutputGrammar, grammar_bitmask
from queueing.schema import GenerateRequest, SchemaError
from tests.engine.test_llm import assert_pool_free, run_engine
from tests.engine.tiny_models import make_tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "languages"],
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["Paris", "London", "Berlin", "Madrid"]
# Sums of small numbers, e.g. "12+7+30"
SUMS = 'root ::= number ("+" number)*\nnumber ::= [1-9] [0-9]?'


def chat(llm: LLM, text: str) -> list[int]:
    return apply_chat_template(llm.get_tokenizer(), [{"role": "user", "content": text}])[1]


def greedy(so: StructuredOutputsParams | None, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 80, **kwargs}, structured_outputs=so)


def assert_person(text: str) -> None:
    person = json.loads(text)
    assert set(person) == {"name", "age", "languages"}
    assert isinstance(person["name"], str) and isinstance(person["age"], int)
    assert all(isinstance(x, str) for x in person["languages"])


@pytest.fixture(scope="module")
def smollm2():
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def smollm2_ngram():
    return LLM(dtype="float32", speculative_config=NGRAM)


def test_each_constraint_is_followed_beside_an_unconstrained_request(smollm2):
    """One batch: a JSON schema, a regex, a choice, an EBNF grammar, json_object and a plain
    request, whose text is the one it has alone (rows without a grammar are untouched)."""
    prompts = [
        chat(smollm2, "Describe Ada, a 36-year-old engineer who speaks English and French."),
        chat(smollm2, "What is the phone number of the town hall?"),
        chat(smollm2, "What is the capital of France?"),
        chat(smollm2, "Write a sum of three numbers."),
        chat(smollm2, 'Reply with a JSON object whose key "capital" names the capital of Peru.'),
        chat(smollm2, "Tell me about the Moon."),
    ]
    params = [
        greedy(StructuredOutputsParams(json=PERSON), max_tokens=120),
        greedy(StructuredOutputsParams(regex=PHONE)),
        greedy(StructuredOutputsParams(choice=CHOICES)),
        greedy(StructuredOutputsParams(grammar=SUMS), max_tokens=24),
        greedy(StructuredOutputsParams(json_object=True, disable_any_whitespace=True)),
        greedy(None, max_tokens=24),
    ]
    (alone,) = smollm2.generate(prompts[-1], params[-1])
    outputs = [o.outputs[0] for o in smollm2.generate(prompts, params)]
    assert_person(outputs[0].text)
    assert re.fullmatch(PHONE, outputs[1].text)
    assert outputs[2].text in CHOICES
    assert re.fullmatch(r"[1-9][0-9]?(\+[1-9][0-9]?)*", outputs[3].text)
    peru = json.loads(outputs[4].text)
    assert isinstance(peru, dict) and peru
    assert "\n" not in outputs[4].text  # disable_any_whitespace
    assert [o.finish_reason for o in outputs[:3]] == ["stop"] * 3
    assert outputs[-1].token_ids == alone.outputs[0].token_ids
    assert_pool_free(smollm2)


def test_the_schema_is_followed_where_the_model_would_not(smollm2):
    """Unconstrained, the model answers in prose; constrained, the same prompt gives JSON."""
    prompt = chat(smollm2, "Who was Ada Lovelace?")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "born": {"type": "integer"}},
        "required": ["name", "born"],
    }
    (plain,) = smollm2.generate(prompt, greedy(None, max_tokens=24))
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    (constrained,) = smollm2.generate(prompt, greedy(so))
    with pytest.raises(ValueError):
        json.loads(plain.outputs[0].text)
    ada = json.loads(constrained.outputs[0].text)
    assert set(ada) == {"name", "born"} and isinstance(ada["born"], int)
    assert constrained.outputs[0].finish_reason == "stop"
    assert_pool_free(smollm2)


def test_logprobs_are_those_of_the_allowed_tokens(smollm2):
    """As vLLM reports them: the model's distribution over what the grammar allows, the other
    tokens at -inf (the bitmask is applied before raw logprobs are taken)."""
    choices = ["yes", "no"]
    so = StructuredOutputsParams(choice=choices)
    (out,) = smollm2.generate(chat(smollm2, "Is the sky blue?"), greedy(so, logprobs=20))
    tokenizer = smollm2.get_tokenizer()
    first = out.outputs[0].logprobs[0]
    finite = {t: lp.logprob for t, lp in first.items() if lp.logprob > float("-inf")}
    assert finite and len(finite) < len(first)  # a few tokens start "yes" or "no"
    for token_id in finite:
        assert any(c.startswith(tokenizer.decode([token_id])) for c in choices)
    # Renormalised over the allowed tokens: they hold all the mass.
    assert sum(torch.tensor(list(finite.values())).exp().tolist()) == pytest.approx(1.0, abs=1e-4)
    assert_pool_free(smollm2)


def test_greedy_with_speculation_equals_without(smollm2, smollm2_ngram):
    """ngram drafts of a JSON copied from the prompt: verified against the grammar's bitmask
    at every draft position, accepted, and the text is the plain one."""
    doc = '{"name": "Ada", "age": 36, "languages": ["English", "French"]}'
    prompt = chat(smollm2, f"Repeat this JSON exactly:\n{doc}")
    params = greedy(StructuredOutputsParams(json=PERSON), logprobs=2)
    (plain,) = smollm2.generate(prompt, params)
    llm = smollm2_ngram
    before = llm.llm_engine.get_stats()
    (spec,) = llm.generate(prompt, params)
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
    assert json.loads(spec.outputs[0].text) == json.loads(doc)
    for got, want in zip(spec.outputs[0].logprobs, plain.outputs[0].logprobs, strict=True):
        assert [x.logprob for x in got.values()] == pytest.approx(
            [x.logprob for x in want.values()], abs=1e-4
        )
    stats = llm.llm_engine.get_stats()
    num_drafts = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    num_accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert num_accepted > num_drafts / 2 > 0
    assert_pool_free(llm)


def test_drafts_the_grammar_refuses_are_not_verified(smollm2, smollm2_ngram, monkeypatch):
    """Drafts are cut to what the grammar allows before they are scheduled: a proposer that
    only proposes letters, under a phone-number regex, has nothing verified."""
    prompt = chat(smollm2, "What is the phone number of the town hall?")
    params = greedy(StructuredOutputsParams(regex=PHONE))
    (plain,) = smollm2.generate(prompt, params)
    llm = smollm2_ngram
    letter = llm.get_tokenizer().convert_tokens_to_ids("x")
    proposer = llm.llm_engine.engine_core.model_runner.proposer
    monkeypatch.setattr(proposer, "propose", lambda token_ids: [letter] * 4)
    before = llm.llm_engine.get_stats().spec_decode_num_draft_tokens
    (spec,) = llm.generate(prompt, params)
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
    assert re.fullmatch(PHONE, spec.outputs[0].text)
    assert llm.llm_engine.get_stats().spec_decode_num_draft_tokens == before
    # The same drafts without a grammar are verified (and rejected).
    llm.generate(prompt, greedy(None, max_tokens=4))
    assert llm.llm_engine.get_stats().spec_decode_num_draft_tokens > before
    assert_pool_free(llm)


def test_a_resumed_request_rebuilds_its_matcher(smollm2):
    """A worker died after emitting some tokens: the new request's matcher accepts them
    first, so the rest follows the grammar from there (a fresh matcher would start the JSON
    over); tokens the grammar refuses are refused."""
    prompt = chat(smollm2, "Describe Ada, a 36-year-old engineer who speaks English and French.")
    params = greedy(StructuredOutputsParams(json=PERSON), max_tokens=120)
    (full,) = smollm2.generate(prompt, params)
    expected = full.outputs[0].token_ids
    engine = smollm2.llm_engine
    engine.add_request("resumed", prompt, params, resume=[expected[:7]])
    rest = run_engine(engine)["resumed"].outputs[0]
    assert expected[:7] + rest.token_ids == expected
    assert rest.finish_reason == "stop"
    not_json = smollm2.get_tokenizer().encode("hello")
    refused = "structured_outputs refuses the tokens the resumed request emitted"
    # Its grammar compiled already: refused at once.
    with pytest.raises(ValueError, match=refused):
        engine.add_request("bad", prompt, params, resume=[not_json])
    assert not engine.has_unfinished_requests()
    # A grammar still to compile: refused once compiled, as that request's error.
    digits = greedy(StructuredOutputsParams(regex="[0-9]+"), max_tokens=8)
    engine.add_request("bad", prompt, digits, resume=[not_json])
    assert run_engine(engine)["bad"].error == refused
    assert_pool_free(smollm2)


def test_the_end_of_the_grammar_stops_the_text(smollm2):
    """With ignore_eos the grammar's EOS still ends it; with min_tokens beyond the grammar's
    end, the grammar wins (its last row allows EOS alone)."""
    prompt = chat(smollm2, "What is the capital of France?")
    so = StructuredOutputsParams(choice=CHOICES)
    outputs = smollm2.generate(
        [prompt, prompt], [greedy(so, ignore_eos=True), greedy(so, min_tokens=10)]
    )
    eos = smollm2.get_tokenizer().eos_token_id
    for out in outputs:
        assert out.outputs[0].text in CHOICES
        assert (out.outputs[0].finish_reason, out.outputs[0].token_ids[-1]) == ("stop", eos)
        assert out.error is None
    assert_pool_free(smollm2)


@pytest.mark.parametrize(
    "fields,message",
    [
        ({}, "exactly one of json, regex, choice, grammar, json_object, got none"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
        ({"regex": "(ab"}, "regex is invalid: .*parenthesis"),
        ({"json": {"type": "nonsense"}}, "json is invalid"),
        ({"json": "{not json"}, "json is not valid JSON"),
        ({"json": {"type": "number", "maximum": float("nan")}}, "json is not a JSON value"),
        ({"grammar": "root ::= undefined_rule"}, "grammar is invalid"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"choice": ["a", 3]}, "choice must be a non-empty list"),
        ({"regex": 5}, "regex must be a string"),
        ({"json_object": "yes"}, "json_object must be a boolean"),
        ({"regex": "a", "disable_any_whitespace": True}, "only with json or json_object"),
    ],
)
def test_bad_constraints_name_structured_outputs(fields, message):
    with pytest.raises(ValueError, match=f"^structured_outputs .*{message}"):
        StructuredOutputsParams(**fields)
    with pytest.raises(ValueError, match=f"^structured_outputs .*{message}"):
        SamplingParams(structured_outputs=fields)  # the wire's form


def test_the_wire_carries_the_map_of_the_fields_set():
    sampling = {"max_tokens": 8, "structured_outputs": {"json": PERSON}}
    decoded = GenerateRequest.decode(GenerateRequest("r", prompt="x", sampling=sampling).encode())
    params = SamplingParams(**decoded.sampling)
    assert params.structured_outputs == StructuredOutputsParams(json=PERSON)
    with pytest.raises(ValueError, match=r"^structured_outputs has unknown field"):
        SamplingParams(structured_outputs={"guided_json": PERSON})
    bad = GenerateRequest("r", prompt="x", sampling={"structured_outputs": "json"}).encode()
    with pytest.raises(SchemaError, match="structured_outputs"):
        GenerateRequest.decode(bad)
    with pytest.raises(ValueError, match=r"^structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs=["json"])


def test_bitmask_rows_advance_over_drafts_and_roll_back(smollm2):
    """Row j allows what follows the first j drafts; a refused draft leaves the rows after
    it full; the matcher ends where it began."""
    tokenizer = smollm2.get_tokenizer()
    vocab_size = smollm2.llm_engine.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_grammar('root ::= "ab" "cd"')
    grammar = StructuredOutputGrammar(compiled, vocab_size)
    a, b, c = (tokenizer.convert_tokens_to_ids(t) for t in "abc")
    bitmask = grammar_bitmask([(grammar, [a, c, b]), (grammar, [])])

    def bit(row: int, token: int) -> bool:
        return bool((bitmask[row, token // 32] >> (token % 32)) & 1)

    assert bitmask.shape == (5, -(-vocab_size // 32))
    assert bit(0, a) and not bit(0, b) and not bit(0, c)
    assert bit(1, b) and not bit(1, c)  # after "a": "c" is refused (it was draft 2)
    assert all(bit(row, t) for row in (2, 3) for t in (a, b, c))  # past the refused draft
    assert torch.equal(bitmask[4], bitmask[0])  # the second request: from the start again
    assert grammar.validate_tokens([a, b, c, a]) == [a, b, c]
    assert grammar.validate_tokens([b]) == []  # still at the start


def test_sampler_masks_only_grammar_rows_and_keeps_its_input():
    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    allowed = torch.zeros(1, vocab, dtype=torch.bool)
    allowed[0, 5] = True  # row 0: token 5 only
    params = [SamplingParams(temperature=1.0, logprobs=2), SamplingParams(temperature=0.0)] * 2
    metadata = SamplingMetadata.build(
        params[:3], [[]] * 3, [[]] * 3, {}, vocab, [2] * 3, "cpu",
        grammar_mask=(torch.tensor([0]), allowed),
    )  # fmt: skip
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids[0] == 5
    assert out.sampled_token_ids[1] == logits[1].argmax()
    # All the mass on the one allowed token; the rows without a grammar: their own logprobs.
    assert float(out.logprobs.logprobs[0, 0]) == pytest.approx(0.0)
    assert out.logprobs.logprob_token_ids[0, 1] == 5
    assert out.logprobs.logprobs[0, 2] == float("-inf")  # the second best: forbidden
    raw = logits.log_softmax(dim=-1)
    assert float(out.logprobs.logprobs[2, 0]) == pytest.approx(
        float(raw[2, out.sampled_token_ids[2]])
    )
    assert torch.equal(logits, before)


# ---- tiny random models: scheduling paths ------------------------------------------------

# Bounded constraints a random model completes within max_tokens.
TINY_CONSTRAINTS = [
    StructuredOutputsParams(
        json={
            "type": "object",
            "properties": {
                "size": {"enum": ["small", "medium", "large"]},
                "count": {"type": "integer", "minimum": 0, "maximum": 999},
                "ok": {"type": "boolean"},
            },
            "required": ["size", "count", "ok"],
        },
        disable_any_whitespace=True,
    ),
    StructuredOutputsParams(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    StructuredOutputsParams(choice=["alpha", "beta gamma", "delta"]),
    StructuredOutputsParams(grammar=SUMS),
]
TINY_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 5,  # longer than a chunked budget
    "Hello",
    "Shared prefix, then a question: what is the capital of France?",
    "Shared prefix, then a question: what is the capital of Spain?",
]
TINY_CONFIGS = {
    "default": {},
    "chunked-prefill": {"max_num_batched_tokens": 16},
    "preempt-tiny-pool": {"num_kv_blocks": 12, "max_model_len": 96, "max_num_batched_tokens": 96},
    "ngram": {"speculative_config": NGRAM},
}


def tiny_params() -> list[SamplingParams]:
    """Each constraint greedy, n = 2 greedy, plus an unconstrained request."""
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so)
              for so in TINY_CONSTRAINTS]  # fmt: skip
    params.append(SamplingParams(temperature=0.0, max_tokens=40, n=2,
                                 structured_outputs=TINY_CONSTRAINTS[1]))  # fmt: skip
    params.append(SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    return params


def assert_follows(so: StructuredOutputsParams, text: str) -> None:
    if so.json is not None:
        value = json.loads(text)
        assert value["size"] in ("small", "medium", "large") and 0 <= value["count"] <= 999
        assert isinstance(value["ok"], bool)
    elif so.regex is not None:
        assert re.fullmatch(so.regex, text)
    elif so.choice is not None:
        assert text in so.choice
    else:
        assert re.fullmatch(r"[1-9][0-9]?(\+[1-9][0-9]?)*", text)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"))


@pytest.fixture(scope="module")
def tiny_reference(tiny_model):
    llm = LLM(tiny_model, dtype="float32", block_size=8)
    return [o.outputs for o in llm.generate(*all_requests())]


def all_requests() -> tuple[list[str], list[SamplingParams]]:
    params = tiny_params()
    return [p for p in TINY_PROMPTS for _ in params], params * len(TINY_PROMPTS)


@pytest.mark.parametrize("config", list(TINY_CONFIGS))
def test_greedy_constrained_text_is_the_same_on_every_scheduling_path(
    tiny_model, tiny_reference, config
):
    """Chunked prefill, recompute preemption (matchers keep their state: recomputed tokens
    are not accepted again) and speculation give the default path's tokens; every text
    follows its constraint, every child of n = 2 too (each has its own matcher)."""
    llm = LLM(tiny_model, dtype="float32", block_size=8, **TINY_CONFIGS[config])
    prompts, params = all_requests()
    outputs = llm.generate(prompts, params)
    for out, p, reference in zip(outputs, params, tiny_reference, strict=True):
        assert out.error is None
        for got, want in zip(out.outputs, reference, strict=True):
            assert got.token_ids == want.token_ids
            if p.structured_outputs is not None:
                assert_follows(p.structured_outputs, got.text)
                assert got.finish_reason == "stop"
    stats = llm.llm_engine.get_stats()
    if config == "preempt-tiny-pool":
        assert stats.num_preemptions > 0
    assert_pool_free(llm)


def test_sampled_children_each_follow_the_grammar(tiny_model):
    """n = 4 sampled: the children's texts differ and each is valid (a shared matcher would
    refuse a sibling's tokens)."""
    llm = LLM(tiny_model, dtype="float32", block_size=8)
    so = TINY_CONSTRAINTS[3]
    (out,) = llm.generate("Hello", SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=30,
                                                  structured_outputs=so))  # fmt: skip
    assert out.error is None
    assert len({c.text for c in out.outputs}) > 1
    for completion in out.outputs:
        assert_follows(so, completion.text)
    assert_pool_free(llm)


def test_a_compiling_grammar_holds_back_nobody(tiny_model, monkeypatch):
    """The grammar compiles on its own thread; its request waits (WAITING_FOR_FSM) while a
    request added after it runs, then goes on once the compile is done."""
    llm = LLM(tiny_model, dtype="float32", block_size=8)
    engine = llm.llm_engine
    manager = engine.engine_core.structured_output_manager
    release, threads = threading.Event(), []
    real_compile = manager._compile

    def compile_held(key):
        threads.append(threading.current_thread().name)
        release.wait(10)
        return real_compile(key)

    monkeypatch.setattr(manager, "_compile", compile_held)
    so = StructuredOutputsParams(regex="[a-z]{3}")
    engine.add_request("constrained", "Hello", SamplingParams(max_tokens=8, structured_outputs=so))
    engine.add_request("plain", "Hello", SamplingParams(max_tokens=4, ignore_eos=True))
    results = {}
    while "plain" not in results or not results["plain"].finished:
        for out in engine.step():
            results[out.request_id] = out
    assert "constrained" not in results
    request = engine.engine_core.scheduler.requests["constrained"]
    assert request.status == RequestStatus.WAITING_FOR_FSM
    assert threads == ["kvrail-grammar_0"]
    release.set()
    text = run_engine(engine)["constrained"].outputs[0].text
    assert re.fullmatch("[a-z]{3}", text)
    assert_pool_free(llm)


def test_a_failed_compile_fails_only_its_request(tiny_model, monkeypatch):
    llm = LLM(tiny_model, dtype="float32", block_size=8)
    manager = llm.llm_engine.engine_core.structured_output_manager

    def compile_fails(key):
        raise RuntimeError("[12:00:00] /project/cpp/compiler.cc:1: out of rules")

    monkeypatch.setattr(manager, "_compile", compile_fails)
    so = StructuredOutputsParams(regex="[a-z]+")
    bad, plain = llm.generate(
        ["Hello", "Hello"],
        [SamplingParams(n=2, structured_outputs=so), SamplingParams(max_tokens=6, ignore_eos=True)],
    )
    assert bad.error == "structured_outputs could not be compiled: out of rules"
    assert plain.error is None and len(plain.outputs[0].token_ids) == 6
    assert not manager.is_compiling
    assert_pool_free(llm)


def test_a_token_the_grammar_refuses_ends_only_its_request(tiny_model, monkeypatch):
    """The runner's contract: sampled tokens follow the bitmask. One that does not (here
    injected) aborts that request with an error; its batch goes on."""
    llm = LLM(tiny_model, dtype="float32", block_size=8)
    runner = llm.llm_engine.engine_core.model_runner
    real_execute = runner.execute_model
    digit = llm.get_tokenizer().convert_tokens_to_ids("7")

    def execute_model(scheduler_output):
        output = real_execute(scheduler_output)
        for i, req_id in enumerate(output.req_ids):
            if req_id == "0" and output.sampled_token_ids[i]:
                output.sampled_token_ids[i] = [digit]
        return output

    monkeypatch.setattr(runner, "execute_model", execute_model)
    so = StructuredOutputsParams(choice=["alpha"])
    bad, plain = llm.generate(
        ["Hello", "Hello"],
        [SamplingParams(structured_outputs=so), SamplingParams(max_tokens=6, ignore_eos=True)],
    )
    assert bad.error == f"structured_outputs: the grammar refused sampled token {digit}"
    assert len(plain.outputs[0].token_ids) == 6
    assert_pool_free(llm)


def test_unconstrained_batches_do_no_grammar_work(tiny_model, monkeypatch):
    """No bitmask, no grammar rows in the sampler, no compile thread."""
    llm = LLM(tiny_model, dtype="float32", block_size=8)
    core = llm.llm_engine.engine_core
    seen = []
    real_build = SamplingMetadata.build

    def build(*args, **kwargs):
        metadata = real_build(*args, **kwargs)
        seen.append(metadata.grammar_mask)
        return metadata

    real_schedule = core.scheduler.schedule

    def schedule(*args):
        output = real_schedule(*args)
        seen.append(output.grammar_bitmask)
        return output

    monkeypatch.setattr(SamplingMetadata, "build", build)
    monkeypatch.setattr(core.scheduler, "schedule", schedule)
    llm.generate(TINY_PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    assert seen and all(x is None for x in seen)
    assert not core.structured_output_manager._executor._threads
    assert_pool_free(llm)
