"""End-to-end: `LLM.generate` against HF transformers, seeded sampling, stops, KV accounting."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, SamplingParams
from engine.llm_engine import merge_delta
from tests.engine.tiny_models import make_tiny_model, smollm2_dir

NUM_NEW_TOKENS = 32
TOP_LOGPROBS = 5

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is",
    "In 1969, Apollo 11 landed on the Moon. The astronauts",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time",
    "Water boils at 100 degrees Celsius at sea level because",
    "The mitochondria is the powerhouse of the cell. It produces energy in the form of ATP "
    "through a process called oxidative phosphorylation, which takes place across the inner "
    "membrane and depends on a gradient of protons built by the electron transport chain.",
    "List three primary colors:",
    "Machine learning models are trained on data. Overfitting happens when a model learns the "
    "noise in its training set instead of the signal, so it performs well on the data it saw "
    "and poorly on new data. Regularization, dropout and early stopping are common remedies, "
    "and cross-validation helps to detect the problem early.",
    "Hello",
    "The French Revolution began in 1789 and",
    "To make a cup of tea, first",
    "SELECT name, age FROM users WHERE",
    "Photosynthesis converts light energy into chemical energy. Plants absorb carbon dioxide "
    "and water, and with sunlight they make glucose and oxygen. Chlorophyll, the green pigment "
    "in leaves, captures the light. The process has two stages: the light-dependent reactions "
    "and the Calvin cycle, which fixes carbon into sugars that feed the plant.",
    "The capital of Japan is",
    "A haiku about autumn:",
]
# Half the prompts share a long system-like prefix, so prefix caching has something to hit.
PREFIX = (
    "You are a helpful assistant. You answer briefly and precisely, you never invent facts, "
    "and when you do not know something you say so. Keep every answer short, plain and "
    "friendly. Question: "
)
PROMPTS = [PREFIX + t if i % 2 else t for i, t in enumerate(TEXTS)]


@dataclass
class Reference:
    token_ids: list[list[int]]
    top_ids: list[list[set[int]]]  # per prompt, per position: HF's top-5 token ids


def hf_greedy(model_dir, prompt_token_ids: list[list[int]]) -> Reference:
    """HF `generate`, fp32, greedy, each prompt alone, EOS ignored."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    token_ids, top_ids = [], []
    for ids in prompt_token_ids:
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=NUM_NEW_TOKENS,
            min_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        token_ids.append(out.sequences[0, len(ids) :].tolist())
        top_ids.append([set(step[0].topk(TOP_LOGPROBS).indices.tolist()) for step in out.logits])
    return Reference(token_ids, top_ids)


def assert_close_to_reference(outputs, ref: Reference) -> None:
    """vLLM's check_logprobs_close: identical, or at the first divergence each side's token is
    in the other's top-5; and at least 90% of sequences identical."""
    num_identical = 0
    for i, output in enumerate(outputs):
        ours = output.outputs[0].token_ids
        assert len(ours) == NUM_NEW_TOKENS
        if ours == ref.token_ids[i]:
            num_identical += 1
            continue
        pos = next(j for j, (a, b) in enumerate(zip(ours, ref.token_ids[i], strict=True)) if a != b)

        our_top = set(output.outputs[0].logprobs[pos])
        assert ref.token_ids[i][pos] in our_top, f"prompt {i} pos {pos}: HF token not in our top-5"
        assert ours[pos] in ref.top_ids[i][pos], f"prompt {i} pos {pos}: our token not in HF top-5"
    assert num_identical >= 0.9 * len(outputs), f"only {num_identical}/{len(outputs)} identical"


def assert_pool_free(llm: LLM) -> None:
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    assert kv.get_num_blocks_in_use() == 0
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


GREEDY = SamplingParams(
    temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=TOP_LOGPROBS
)

# (name, engine kwargs, expect preemptions)
CONFIGS = [
    ("default", dict(), False),
    (
        "no-prefix-cache-chunked",
        dict(enable_prefix_caching=False, max_num_batched_tokens=64),
        False,
    ),
    (
        "prefix-cache-chunked-preempt",
        dict(max_num_batched_tokens=64, num_kv_blocks=24, max_model_len=256),
        True,
    ),
    (
        "no-prefix-cache-preempt",
        dict(enable_prefix_caching=False, num_kv_blocks=20, max_model_len=256),
        True,
    ),
]

TINY_MODELS = {
    "llama-tied": ("llama", dict()),
    "llama3-rope-untied": (
        "llama",
        dict(
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "qwen2-untied": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen3": ("qwen3", dict()),
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_dir())


@pytest.fixture(scope="module")
def prompt_token_ids(tokenizer):
    ids = [tokenizer.encode(p) for p in PROMPTS]
    assert sum(len(x) > 48 for x in ids) >= 3  # some prompts span more than 3 blocks
    return ids


@pytest.fixture(scope="module", params=list(TINY_MODELS))
def tiny_model(request, tmp_path_factory, prompt_token_ids):
    arch, overrides = TINY_MODELS[request.param]
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), arch, **overrides)
    return path, hf_greedy(path, prompt_token_ids)


@pytest.mark.parametrize("name,kwargs,expect_preemption", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_tiny_models_match_hf(tiny_model, prompt_token_ids, name, kwargs, expect_preemption):
    path, ref = tiny_model
    llm = LLM(str(path), dtype="float32", **kwargs)
    outputs = llm.generate(prompt_token_ids, GREEDY)
    assert_close_to_reference(outputs, ref)
    stats = llm.llm_engine.get_stats()
    assert (stats.num_preemptions > 0) == expect_preemption
    assert_pool_free(llm)


@pytest.fixture(scope="module")
def smollm2_reference(prompt_token_ids):
    return hf_greedy(smollm2_dir(), prompt_token_ids)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,kwargs,expect_preemption", CONFIGS[1:3], ids=[c[0] for c in CONFIGS[1:3]]
)
def test_smollm2_matches_hf(smollm2_reference, prompt_token_ids, name, kwargs, expect_preemption):
    llm = LLM(None, dtype="float32", **kwargs)
    outputs = llm.generate(prompt_token_ids, GREEDY)
    assert_close_to_reference(outputs, smollm2_reference)
    assert (llm.llm_engine.get_stats().num_preemptions > 0) == expect_preemption
    assert_pool_free(llm)


@pytest.fixture(scope="module")
def smollm2():
    return LLM(dtype="float32")


def test_france_question(smollm2):
    (output,) = smollm2.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=16),
    )
    assert "Paris" in output.outputs[0].text
    assert output.outputs[0].finish_reason in ("stop", "length")
    assert_pool_free(smollm2)


def test_prefix_cache_hit_is_reported(smollm2):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    long_prompt = PROMPTS[13]
    (first,) = smollm2.generate(long_prompt, params)
    (second,) = smollm2.generate(long_prompt, params)
    assert second.num_cached_tokens >= 16 * (len(second.prompt_token_ids) // 16 - 1)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert_pool_free(smollm2)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=96)


def test_seeded_sampling_is_independent_of_the_batch(tiny_llm):
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    (alone,) = tiny_llm.generate(PROMPTS[2], seeded)
    others = [
        SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=99, top_k=20, max_tokens=16, ignore_eos=True),
    ] * 3
    batch_prompts = [*PROMPTS[3:7], PROMPTS[2], *PROMPTS[7:11]]
    batch_params = [*others[:4], seeded, *others[4:8]]
    outputs = tiny_llm.generate(batch_prompts, batch_params)
    assert outputs[4].outputs[0].token_ids == alone.outputs[0].token_ids
    # And a different seed gives something else (the seed is really used).
    other_seed = SamplingParams(
        temperature=0.8, top_p=0.95, seed=4321, max_tokens=24, ignore_eos=True
    )
    (different,) = tiny_llm.generate(PROMPTS[2], other_seed)
    assert different.outputs[0].token_ids != alone.outputs[0].token_ids
    assert_pool_free(tiny_llm)


def test_parallel_sampling_shares_the_prompt(tiny_llm):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    (output,) = tiny_llm.generate(PROMPTS[8], params)
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    # Children after the first reuse the prompt's full blocks.
    assert output.num_cached_tokens >= 16 * ((len(output.prompt_token_ids) - 1) // 16)
    assert_pool_free(tiny_llm)


def test_stop_strings_are_cut_exactly(smollm2):
    base = SamplingParams(temperature=0.0, max_tokens=24)
    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    (full,) = smollm2.chat(prompt, base)
    text = full.outputs[0].text
    assert "Paris" in text
    # A stop string that spans token boundaries: the tail of one word and the head of the next.
    start = text.index("Paris") - 3
    stop = text[start : start + 6]
    for include in (False, True):
        params = SamplingParams(
            temperature=0.0, max_tokens=24, stop=[stop], include_stop_str_in_output=include
        )
        engine = smollm2.llm_engine
        engine.add_request(
            "stop-test",
            engine.tokenize_prompt(
                smollm2.get_tokenizer().apply_chat_template(
                    prompt, tokenize=False, add_generation_prompt=True
                )
            )[1],
            params,
        )
        streamed = ""
        final = None
        while engine.has_unfinished_requests():
            for delta in engine.step():
                streamed += delta.outputs[0].text
                final = delta
        expected = text[: start + 6] if include else text[:start]
        assert streamed == expected
        assert final.outputs[0].finish_reason == "stop"
        assert final.outputs[0].stop_reason == stop
    assert_pool_free(smollm2)


def test_kv_accounting_every_step(tiny_llm):
    engine = tiny_llm.llm_engine
    bs = engine.config.block_size
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:8]):
        engine.add_request(f"kv-{i}", prompt, params)
    num_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1
        scheduler = engine.engine_core.scheduler
        stats = engine.get_stats()
        for request in scheduler.running:
            slots = len(scheduler.kv_cache_manager.get_block_ids(request.request_id)) * bs
            assert 0 <= slots - request.num_computed_tokens < bs
        assert stats.num_tokens_stored == sum(r.num_computed_tokens for r in scheduler.running)
        # Engine-wide: slots allocated minus tokens stored stays under a block per request.
        waste = stats.num_blocks_in_use * bs - stats.num_tokens_stored
        assert waste < bs * stats.num_running_reqs or stats.num_blocks_in_use == 0
    assert num_steps >= 20
    assert_pool_free(tiny_llm)


def test_abort_frees_blocks(tiny_llm):
    engine = tiny_llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request("abort-me", PROMPTS[6], params)
    engine.step()
    assert engine.get_stats().num_blocks_in_use > 0
    engine.abort_request("abort-me")
    assert engine.get_stats().num_blocks_in_use == 0
    assert not engine.has_unfinished_requests()
    engine.step()  # the runner drops the aborted request's state
    assert not engine.engine_core.model_runner.requests
    assert_pool_free(tiny_llm)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(n=0), "n"),
        (dict(max_tokens=0), "max_tokens"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected(tiny_llm):
    engine = tiny_llm.llm_engine
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", [5] * (engine.max_model_len + 1), SamplingParams())
    engine.add_request("dup", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("dup", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("vocab", [10**9], SamplingParams())
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_free(tiny_llm)


def test_seeds_at_the_ends_of_their_range_serve_every_choice(tiny_llm):
    """Choice i samples with seed + i: at the top of the 64-bit range that wraps instead of
    failing the step (issue 12: one such request failed its whole batch), and a seed outside
    the range is refused at admission, naming the field."""
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for seed in (2**64 - 1, -(2**63)):
        params = SamplingParams(temperature=0.8, seed=seed, n=3, max_tokens=4, ignore_eos=True)
        seeded, plain = tiny_llm.generate([PROMPTS[0], PROMPTS[1]], [params, greedy])
        assert [len(c.token_ids) for c in seeded.outputs] == [4, 4, 4]
        assert len(plain.outputs[0].token_ids) == 4
    # Choice 1 of seed 2^64 - 1 uses seed 0: the same tokens as a lone request seeded with 0.
    top = SamplingParams(temperature=0.8, seed=2**64 - 1, n=2, max_tokens=8, ignore_eos=True)
    zero = SamplingParams(temperature=0.8, seed=0, max_tokens=8, ignore_eos=True)
    (pair,) = tiny_llm.generate(PROMPTS[2], top)
    (alone,) = tiny_llm.generate(PROMPTS[2], zero)
    assert pair.outputs[1].token_ids == alone.outputs[0].token_ids
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed)
    assert_pool_free(tiny_llm)


def test_a_prompt_too_long_in_characters_is_refused_untokenized(tiny_llm, monkeypatch):
    """Issue 12: 1M-character prompts were tokenized on the engine thread before the length
    check. No token covers more characters than the longest token string, so a longer
    prompt cannot fit in max_model_len tokens and is refused before tokenizing."""
    engine = tiny_llm.llm_engine
    limit = engine.max_prompt_chars
    assert limit >= engine.max_model_len
    params = SamplingParams(max_tokens=1)
    real_encode = engine.tokenizer.encode
    monkeypatch.setattr(
        engine.tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized a hopeless prompt")
    )
    with pytest.raises(ValueError, match=rf"max_model_len \d+ tokens can hold \({limit}\)"):
        engine.add_request("long", "a" * (limit + 1), params)
    monkeypatch.setattr(engine.tokenizer, "encode", real_encode)
    with pytest.raises(ValueError, match="tokens, more than max_model_len"):  # tokenized
        engine.add_request("long", "a " * (limit // 2), params)
    assert not engine.has_unfinished_requests()
    assert_pool_free(tiny_llm)


def failing_steps(engine, monkeypatch) -> list[int]:
    """Counts the model runs that raise (one list item, updated in place)."""
    runner, count = engine.engine_core.model_runner, [0]
    real_execute = runner.execute_model

    def execute_model(scheduler_output):
        try:
            return real_execute(scheduler_output)
        except Exception:
            count[0] += 1
            raise

    monkeypatch.setattr(runner, "execute_model", execute_model)
    return count


def run_engine(engine) -> dict[str, object]:
    results = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            results[delta.request_id] = merge_delta(results.get(delta.request_id), delta)
    return results


@pytest.mark.parametrize("fault", ["seed", "forward", "sampler"])
def test_a_fault_tied_to_one_request_fails_only_it(tiny_llm, tiny_llama, monkeypatch, fault):
    """Issue 12: a choice seeded 2^64 made torch's generator raise inside the step (`seed`:
    in the runner's setup of the request, before the forward wrote the KV of the blocks the
    step had cached), and every request of that step failed. Faults in the forward and in
    the sampler (after the prompt logprobs of request 0, whose prompt the step completes)
    too. The step is now undone and its requests stepped in halves until the culprit raises
    alone: only it fails, the others give exactly what they give without it. On a fresh
    engine: a prefix cache already holding the prompts would hide blocks the step cached."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with_prompt_logprobs = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=3
    )
    # 103 prompt tokens: request 0 completes its prompt in the second step (budget 96), the
    # one where the poison samples first.
    prompts, params = [PROMPTS[13], *PROMPTS[1:6]], [with_prompt_logprobs] + [greedy] * 5
    reference = tiny_llm.generate(prompts, params)
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=96)
    engine, runner = llm.llm_engine, llm.llm_engine.engine_core.model_runner
    marker = engine.vocab_size - 1  # the poison's first prompt token, in no other sequence
    assert all(marker not in o.prompt_token_ids + o.outputs[0].token_ids for o in reference)
    poison, poison_params = [marker, *engine.tokenize_prompt(PROMPTS[4])[1]], greedy
    if fault == "seed":
        poison_params = SamplingParams(temperature=0.8, seed=1, max_tokens=12)
    elif fault == "forward":
        real_forward = runner.model.forward

        def forward(input_ids, positions):
            hidden_states = real_forward(input_ids, positions)
            if bool((input_ids == marker).any()):
                raise RuntimeError("injected fault")
            return hidden_states

        monkeypatch.setattr(runner.model, "forward", forward)
    else:
        poison_params = SamplingParams(temperature=0.0, max_tokens=12, logit_bias={marker: 1})
        real_sampler = runner.sampler

        def sampler(logits, metadata):
            if metadata.logit_bias is not None:  # only the poison has one
                raise RuntimeError("injected fault")
            return real_sampler(logits, metadata)

        monkeypatch.setattr(runner, "sampler", sampler)
    num_failed = failing_steps(engine, monkeypatch)
    for i, (prompt, request_params) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, request_params)
        if i == 2:
            engine.add_request("poison", poison, poison_params)
    if fault == "seed":  # as `SamplingParams` no longer admits it (issue 12, first half)
        engine.engine_core.scheduler.requests["poison"].sampling_params.seed = 2**64
    results = run_engine(engine)
    failed = results.pop("poison")
    assert failed.finished and not failed.outputs
    expected = "Overflow when unpacking" if fault == "seed" else "RuntimeError: injected fault"
    assert expected in failed.error
    assert [results[str(i)].outputs[0].token_ids for i in range(6)] == [
        o.outputs[0].token_ids for o in reference
    ]
    assert all(r.error is None and r.outputs[0].finish_reason == "length" for r in results.values())
    ours, theirs = results["0"].prompt_logprobs, reference[0].prompt_logprobs
    assert ours[0] is None and len(ours) == len(theirs) == 103
    for position, entry in enumerate(ours[1:], 1):
        logprobs = {t: lp.logprob for t, lp in entry.items()}
        assert logprobs == pytest.approx({t: lp.logprob for t, lp in theirs[position].items()})
    # The failed step, then one failing half per halving of its (at most 7) requests.
    assert 2 <= num_failed[0] <= 1 + math.ceil(math.log2(7))
    engine.step()  # the runner drops finished requests' state: no row was lost
    assert not runner.requests and sorted(runner.free_rows) == list(range(runner.max_num_reqs))
    assert_pool_free(llm)
    assert_pool_free(tiny_llm)


def test_a_fault_in_every_step_fails_every_request_and_the_engine_serves_on(tiny_llm, monkeypatch):
    """A shared fault (here the sampler, broken for every batch) fails each request, by
    itself, after the isolation has split its step down to it; the engine is consistent and
    serves the next requests."""
    engine = tiny_llm.llm_engine

    def sampler(logits, metadata):
        raise RuntimeError("broken sampler")

    monkeypatch.setattr(engine.engine_core.model_runner, "sampler", sampler)
    num_failed = failing_steps(engine, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), prompt, params)
    results = run_engine(engine)
    assert {r: o.error for r, o in results.items()} == dict.fromkeys(
        "0123", "RuntimeError: broken sampler"
    )
    assert num_failed[0] <= 2 * 4 - 1
    assert_pool_free(tiny_llm)
    monkeypatch.undo()
    (output,) = tiny_llm.generate(PROMPTS[0], params)
    assert output.error is None and len(output.outputs[0].token_ids) == 4


def test_a_prompt_tokenized_elsewhere_keeps_its_text_and_is_checked(tiny_llm):
    """A server tokenizes off the engine thread (issue 12) and adds {"prompt", "prompt_token_ids"}:
    the engine generates from those ids, reports the text, and still checks the ids, the
    length first (a refused prompt costs no more than max_model_len checks)."""
    engine = tiny_llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    text, ids = engine.tokenize_prompt(PROMPTS[0])
    (pre,) = tiny_llm.generate({"prompt": text, "prompt_token_ids": ids}, params)
    (plain,) = tiny_llm.generate(PROMPTS[0], params)
    assert pre.prompt == PROMPTS[0] and pre.prompt_token_ids == ids == plain.prompt_token_ids
    assert pre.outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("vocab", {"prompt": "x", "prompt_token_ids": [10**9]}, params)
    too_long = [5] * engine.max_model_len + [10**9]
    with pytest.raises(ValueError, match="tokens, more than max_model_len"):
        engine.add_request("long", {"prompt": "x", "prompt_token_ids": too_long}, params)
    assert not engine.has_unfinished_requests()
    assert_pool_free(tiny_llm)


def test_priority_policy_runs_a_request_submitted_last_first(tiny_llama, tiny_llm):
    """One seat (max_num_seqs=1): the priority-0 request added after three priority-1 ones
    produces every token before them, and they follow in arrival order; the text does not
    depend on the policy."""
    llm = LLM(str(tiny_llama), dtype="float32", max_num_seqs=1, scheduling_policy="priority")
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"low-{i}", PROMPTS[i], params, priority=1)
    engine.add_request("high", PROMPTS[3], params, priority=0)
    stepped = []  # the request of each step's tokens
    while engine.has_unfinished_requests():
        stepped += [out.request_id for out in engine.step() if out.outputs[0].token_ids]
    assert stepped == [r for r in ("high", "low-0", "low-1", "low-2") for _ in range(6)]
    by_priority = llm.generate(PROMPTS[:4], params, priority=[1, 1, 1, 0])
    fcfs = tiny_llm.generate(PROMPTS[:4], params)
    assert [o.outputs[0].token_ids for o in by_priority] == [o.outputs[0].token_ids for o in fcfs]
    assert_pool_free(llm)


def test_priority_seat_preemption_keeps_every_request_whole(tiny_llama, tiny_llm):
    """Two seats held by seeded low-priority requests; two urgent ones arrive and take both
    (each preempts one low). The preempted keep their sampled tokens and generators, and
    give their places in the runner's batch arrays to the urgent ones until they resume:
    nobody fails, and every request's tokens are those of the same request run alone."""
    llm = LLM(str(tiny_llama), dtype="float32", max_num_seqs=2, scheduling_policy="priority")
    engine = llm.llm_engine
    low = [SamplingParams(temperature=1.0, seed=i, max_tokens=8, ignore_eos=True) for i in (3, 4)]
    high = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"low-{i}", PROMPTS[i], low[i], priority=1)
    tokens: dict[str, list[int]] = {}
    errors = []
    for _ in range(3):  # both lows past their prompts
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    for i in range(2):
        engine.add_request(f"high-{i}", PROMPTS[2 + i], high, priority=0)
    while engine.has_unfinished_requests():
        for out in engine.step():
            errors += [out.error] if out.error else []
            if out.outputs:
                tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert errors == [] and engine.get_stats().num_preemptions == 2
    alone = tiny_llm.generate(PROMPTS[:4], [*low, high, high])
    req_ids = ["low-0", "low-1", "high-0", "high-1"]
    assert [tokens[r] for r in req_ids] == [o.outputs[0].token_ids for o in alone]
    assert_pool_free(llm)


def test_bad_priorities_are_refused(tiny_llm):
    """The fcfs policy takes priority 0 only (vLLM too); a priority is an integer; `generate`
    needs one per prompt. Nothing is left queued."""
    engine = tiny_llm.llm_engine
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        engine.add_request("p", PROMPTS[0], params, priority=1)
    for priority in (1.5, True, "0"):
        with pytest.raises(ValueError, match="priority must be an integer"):
            engine.add_request("p", PROMPTS[0], params, priority=priority)
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        tiny_llm.generate(PROMPTS[:2], params, priority=[0])
    with pytest.raises(ValueError, match="not enabled"):
        tiny_llm.generate(PROMPTS[:2], params, priority=[0, -1])
    assert not engine.has_unfinished_requests()
    (output,) = tiny_llm.generate(PROMPTS[0], params, priority=[0])
    assert len(output.outputs[0].token_ids) == 2
    assert_pool_free(tiny_llm)
