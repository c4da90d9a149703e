"""`SamplingParams(prompt_logprobs=k)`: values against HF transformers' fp32 log_softmax, and
the paths that must not change them: chunked prefill, prefix caching, n > 1, preemption,
resume."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.llm_engine import merge_delta
from tests.engine.test_llm import PROMPTS, assert_pool_free
from tests.engine.tiny_models import make_tiny_model

# fp32 on CPU, engine vs HF or chunked vs whole: measured up to 1.1e-4 on AMD EPYCs and
# 3.4e-4 on an AMX Xeon, on these chaotic tiny models with the C kernels (their fast-math
# reductions sum in another order than torch's, which itself picks kernels per CPU). A wrong
# kernel or position is off by 1e-2 or more.
LOGPROB_TOL = 1e-3
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", block_size=BLOCK_SIZE)


@pytest.fixture(scope="module")
def prompts(llm):
    """Token prompts: one token (nothing to score), one block, several blocks, 300 tokens."""
    tokenizer = llm.get_tokenizer()
    long_ids = [t for p in PROMPTS for t in tokenizer.encode(p)]
    return [
        tokenizer.encode(PROMPTS[4])[:1],
        tokenizer.encode(PROMPTS[8]),
        tokenizer.encode(PROMPTS[13]) + tokenizer.encode(PROMPTS[8]),
        long_ids[:300],
    ]


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[P, V]: row i is HF's fp32 log_softmax after prompt[: i + 1]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_matches_hf(prompt_logprobs, token_ids, ref: torch.Tensor, k: int, tokenizer) -> None:
    """Every position: the prompt token with HF's logprob and rank (up to near-ties within
    the tolerance), plus HF's top-k with their values, as vLLM returns them."""
    assert len(prompt_logprobs) == len(token_ids)
    assert prompt_logprobs[0] is None
    for i in range(1, len(token_ids)):
        entry, row, token_id = prompt_logprobs[i], ref[i - 1], token_ids[i]
        assert token_id in entry, f"position {i}: prompt token missing"
        ours = entry[token_id]
        assert abs(ours.logprob - row[token_id].item()) < LOGPROB_TOL, f"position {i}"
        # A rank compares two logprobs, each within LOGPROB_TOL of HF's: ties within twice it.
        lowest_rank = int((row > row[token_id] + 2 * LOGPROB_TOL).sum()) + 1
        highest_rank = int((row >= row[token_id] - 2 * LOGPROB_TOL).sum())
        assert lowest_rank <= ours.rank <= highest_rank, f"position {i}: rank {ours.rank}"
        assert ours.decoded_token == tokenizer.convert_ids_to_tokens(token_id)
        top = {t: lp for t, lp in entry.items() if lp.rank <= k}
        assert len(top) == k and sorted(lp.rank for lp in top.values()) == list(range(1, k + 1))
        assert len(entry) == k + (token_id not in top)
        if k:
            kth_value = row.topk(k).values[-1].item()
            for t, lp in top.items():
                assert abs(lp.logprob - row[t].item()) < LOGPROB_TOL
                assert row[t].item() >= kth_value - LOGPROB_TOL, f"position {i}: {t} not in top-{k}"


def assert_same(a, b, k: int) -> None:
    """Two runs' prompt logprobs: the same tokens, top-k ranks equal, values equal up to fp32
    noise. A chunked prefill sums attention in another order: measured up to 2.7e-5 apart
    (logits of this peaky model reach +-50, where an fp32 ulp is 4e-6), which can move the
    rank of a prompt token 44k deep by one; those ranks are checked against HF instead."""
    assert len(a) == len(b)
    for x, y in zip(a[1:], b[1:], strict=True):
        assert x.keys() == y.keys()
        top_x = {t: lp.rank for t, lp in x.items() if lp.rank <= k}
        assert top_x == {t: y[t].rank for t in top_x}
        for t in x:
            assert abs(x[t].logprob - y[t].logprob) < LOGPROB_TOL


def params(k: int | None, **kwargs) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=k, **kwargs
    )


@pytest.fixture(scope="module")
def reference_outputs(llm, prompts):
    """One engine step holds every prompt whole; k differs per request."""
    return llm.generate(prompts, [params(k) for k in (2, 0, 5, 20)])


def test_prompt_logprobs_match_hf(llm, hf_model, prompts, reference_outputs):
    tokenizer = llm.get_tokenizer()
    for output, ids, k in zip(reference_outputs, prompts, (2, 0, 5, 20), strict=True):
        assert_matches_hf(output.prompt_logprobs, ids, hf_logprobs(hf_model, ids), k, tokenizer)
        assert output.num_cached_tokens == 0
    (plain,) = llm.generate(prompts[1], params(None))
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == reference_outputs[1].outputs[0].token_ids
    assert_pool_free(llm)


@pytest.mark.parametrize(
    "kwargs",
    [dict(max_num_batched_tokens=16), dict(long_prefill_token_threshold=24)],
    ids=["budget-16", "threshold-24"],
)
def test_chunked_prefill_gives_the_same_result(
    model_dir, hf_model, prompts, reference_outputs, kwargs
):
    llm = LLM(str(model_dir), dtype="float32", block_size=BLOCK_SIZE, **kwargs)
    outputs = llm.generate(prompts, [params(k) for k in (2, 0, 5, 20)])
    tokenizer = llm.get_tokenizer()
    for output, ref, ids, k in zip(outputs, reference_outputs, prompts, (2, 0, 5, 20), strict=True):
        assert_same(output.prompt_logprobs, ref.prompt_logprobs, k)
        assert_matches_hf(output.prompt_logprobs, ids, hf_logprobs(hf_model, ids), k, tokenizer)
    assert_pool_free(llm)


def test_prefix_cache_is_bypassed_not_disabled(llm, prompts, reference_outputs):
    ids = prompts[2]
    full_blocks = BLOCK_SIZE * ((len(ids) - 1) // BLOCK_SIZE)
    llm.generate(ids, params(None))  # its blocks are cached now
    (second,) = llm.generate(ids, params(None))
    assert second.num_cached_tokens == full_blocks
    # Asking for prompt logprobs with the whole prompt cached: every position is computed.
    first, sharer = llm.generate([ids, ids[:-3]], [params(5), params(None)])
    assert first.num_cached_tokens == 0
    assert_same(first.prompt_logprobs, reference_outputs[2].prompt_logprobs, 5)
    assert sharer.num_cached_tokens > 0  # others keep their hits in the same step
    assert_pool_free(llm)


def test_own_blocks_are_cached_for_others(model_dir, prompts, reference_outputs):
    llm = LLM(str(model_dir), dtype="float32", block_size=BLOCK_SIZE)
    ids = prompts[2]
    (first,) = llm.generate(ids, params(5))
    assert_same(first.prompt_logprobs, reference_outputs[2].prompt_logprobs, 5)
    (plain,) = llm.generate(ids, params(None))
    assert plain.num_cached_tokens == BLOCK_SIZE * ((len(ids) - 1) // BLOCK_SIZE)
    assert_pool_free(llm)


def test_parallel_sampling_computes_them_once(llm, prompts, reference_outputs, monkeypatch):
    engine = llm.llm_engine
    rows = count_logit_rows(llm, monkeypatch)
    ids = prompts[2]
    engine.add_request(
        "n3",
        ids,
        SamplingParams(
            n=3, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True, prompt_logprobs=5
        ),
    )
    result, num_carrying = None, 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            num_carrying += delta.prompt_logprobs is not None
            result = merge_delta(result, delta)
    assert num_carrying == 1
    assert_same(result.prompt_logprobs, reference_outputs[2].prompt_logprobs, 5)
    assert [len(c.token_ids) for c in result.outputs] == [5, 5, 5]
    assert result.num_cached_tokens > 0  # choices 1 and 2 share choice 0's prompt blocks
    # Logits: the prompt's rows once, plus one row per sampled token.
    assert sum(rows) == (len(ids) - 1) + 3 * 5
    assert_pool_free(llm)


def count_logit_rows(llm, monkeypatch) -> list[int]:
    """Record the number of rows of every `compute_logits` call, for the rest of the test."""
    model = llm.llm_engine.engine_core.model_runner.model
    compute_logits = model.compute_logits
    rows: list[int] = []

    def counting(hidden_states):
        rows.append(hidden_states.shape[0])
        return compute_logits(hidden_states)

    monkeypatch.setattr(model, "compute_logits", counting)
    return rows


def test_logits_only_for_those_who_ask(model_dir, prompts, monkeypatch):
    llm = LLM(str(model_dir), dtype="float32", block_size=BLOCK_SIZE)
    rows = count_logit_rows(llm, monkeypatch)
    llm.generate(prompts, params(None))
    # Without prompt logprobs: one row per sampled token, nothing else.
    assert sum(rows) == 4 * len(prompts)
    rows.clear()
    (output,) = llm.generate(prompts[3], params(3))
    assert len(output.prompt_logprobs) == 300
    # The 299 prompt rows go in slices of at most 256 rows (bounded logits memory).
    assert max(rows) <= 256 and sum(rows) == 299 + 4
    assert_pool_free(llm)


def run_counting_preemptions(llm, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Step until done. Returns the merged outputs, the number of deltas per request that
    carried prompt logprobs, and per preemption (request id, its computed tokens before)."""
    engine = llm.llm_engine
    scheduler = engine.engine_core.scheduler
    for request_id, (ids, sampling) in requests.items():
        engine.add_request(request_id, ids, sampling)
    results, carrying, preemptions = {}, dict.fromkeys(requests, 0), []
    while engine.has_unfinished_requests():
        before = {
            r: (q.num_computed_tokens, q.num_preemptions) for r, q in scheduler.requests.items()
        }
        for delta in engine.step():
            carrying[delta.request_id] += delta.prompt_logprobs is not None
            results[delta.request_id] = merge_delta(results.get(delta.request_id), delta)
        for request_id, (num_computed, num_preemptions) in before.items():
            request = scheduler.requests.get(request_id)
            if request is not None and request.num_preemptions > num_preemptions:
                preemptions.append((request_id, num_computed))
    return results, carrying, preemptions


@pytest.mark.parametrize("phase", ["during-prompt", "after-prompt"])
def test_preemption_keeps_them_and_sends_them_once(model_dir, prompts, hf_model, phase):
    # A pool of 8 blocks: "a" decodes long while "b" (the last admitted, so the victim)
    # needs blocks: "b" is preempted while its prompt is half done, or once it decodes.
    llm = LLM(
        str(model_dir),
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_kv_blocks=8,
        max_model_len=128,
        max_num_batched_tokens=16,
    )
    if phase == "during-prompt":
        a_ids, a_max_tokens, b_ids, b_max_tokens = prompts[2][:14], 40, prompts[3][:115], 8
    else:
        a_ids, a_max_tokens, b_ids, b_max_tokens = prompts[2][:60], 100, prompts[1], 40
    b_params = SamplingParams(
        temperature=0.0, max_tokens=b_max_tokens, ignore_eos=True, prompt_logprobs=3
    )
    results, carrying, preemptions = run_counting_preemptions(
        llm,
        {
            "a": (a_ids, SamplingParams(temperature=0.0, max_tokens=a_max_tokens, ignore_eos=True)),
            "b": (b_ids, b_params),
        },
    )
    first_preempted_at = next(n for r, n in preemptions if r == "b")
    if phase == "during-prompt":
        assert first_preempted_at < len(b_ids)
    else:
        assert first_preempted_at >= len(b_ids)
    assert carrying == {"a": 0, "b": 1}
    assert_matches_hf(
        results["b"].prompt_logprobs, b_ids, hf_logprobs(hf_model, b_ids), 3, llm.get_tokenizer()
    )
    assert len(results["b"].outputs[0].token_ids) == b_max_tokens
    assert_pool_free(llm)


def test_resume_computes_them_only_if_never_sent(llm, prompts, reference_outputs):
    engine = llm.llm_engine
    ids = prompts[2]
    sampling = SamplingParams(
        n=2, temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=5
    )
    token = reference_outputs[2].outputs[0].token_ids[0]
    # Choice 0 had emitted a token: its prompt logprobs went with it. Choice 0 had emitted
    # nothing (choice 1 had): they were never sent.
    for name, resume, expect_sent in [
        ("sent", [[token], []], False),
        ("unsent", [[], [token]], True),
    ]:
        engine.add_request(name, ids, sampling, resume=resume)
        result = None
        while engine.has_unfinished_requests():
            for delta in engine.step():
                result = merge_delta(result, delta)
        assert (result.prompt_logprobs is not None) == expect_sent
        if expect_sent:
            assert_same(result.prompt_logprobs, reference_outputs[2].prompt_logprobs, 5)
    assert_pool_free(llm)


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "3"])
def test_bad_values_name_the_field(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
