"""Speculative decoding: greedy outputs equal to plain decoding, exact rejection sampling,
drafts within the scheduler's budget, and KV blocks that stay clean (pool free, no draft in
the prefix cache)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from engine.kv_cache import hash_block_tokens
from engine.outputs import ModelRunnerOutput
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.spec_decode.ngram_proposer import NgramProposer
from engine.spec_decode.rejection_sampler import rejection_sample
from tests.engine.test_llm import assert_pool_free
from tests.engine.tiny_models import make_chain_model, make_tiny_model

K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1}
PROMPTS = [
    "Hello hello world, one two three",
    "The quick brown fox jumps over the lazy dog. " * 6,  # longer than the chunked budget
    "Shared prefix, then a question: what is the capital of France?",
    "Shared prefix, then a question: what is the capital of Spain?",
]
# Engine options each run of `test_greedy_outputs_equal_plain_decoding` adds.
CONFIGS = {
    "default": {},
    "chunked-prefill": {"max_num_batched_tokens": 24},
    "preempt-tiny-pool": {"num_kv_blocks": 24, "max_model_len": 192},
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """Greedy text that repeats with period 5, until context overrides it now and then:
    drafts are both accepted and rejected."""
    return make_chain_model(tmp_path_factory.mktemp("target"), "llama", layer_scale=0.02,
                            cycle_length=5)  # fmt: skip


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """The target's chain with less context: a draft that is often, not always, right."""
    return make_chain_model(tmp_path_factory.mktemp("draft"), "llama", layer_scale=0.01,
                            cycle_length=5)  # fmt: skip


def spec_config(method: str, draft) -> dict:
    if method == "ngram":
        return NGRAM
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}


def params_for(plain: LLM) -> list[SamplingParams]:
    """Greedy requests whose stops land inside accepted runs: a stop token id and a stop
    string taken from the middle of the plain output, max_tokens off the k + 1 grid, n = 2,
    penalties, logit_bias, min_tokens and logprobs at every position."""
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    (out,) = plain.generate(PROMPTS[0], base)
    token_ids, text = out.outputs[0].token_ids, out.outputs[0].text
    greedy = dict(temperature=0, ignore_eos=True)
    return [
        SamplingParams(max_tokens=40, logprobs=2, **greedy),
        SamplingParams(max_tokens=40, stop_token_ids=[token_ids[13]], **greedy),
        SamplingParams(max_tokens=40, stop=[text[len(text) // 2 : len(text) // 2 + 4]], **greedy),
        SamplingParams(max_tokens=13, n=2, **greedy),
        SamplingParams(max_tokens=30, repetition_penalty=1.3, frequency_penalty=0.4, **greedy),
        SamplingParams(max_tokens=30, logit_bias={token_ids[5]: -50.0}, logprobs=1, **greedy),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=20, stop_token_ids=[token_ids[3]]),
    ]


def generate_all(llm: LLM, params: list[SamplingParams]) -> list:
    prompts = [p for p in PROMPTS for _ in params]
    return llm.generate(prompts, params * len(PROMPTS))


def assert_no_draft_cached(llm: LLM, outputs) -> None:
    """Every block in the prefix cache holds a prefix of some request's final tokens."""
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    real_hashes = set()
    for out in outputs:
        for completion in out.outputs:
            tokens = out.prompt_token_ids + completion.token_ids
            parent = None
            for i in range(len(tokens) // kv.block_size):
                parent = hash_block_tokens(
                    parent, tokens[i * kv.block_size : (i + 1) * kv.block_size]
                )
                real_hashes.add(parent)
    cached = set(kv.block_pool.cached_block_hash_to_block)
    assert cached and cached <= real_hashes


@pytest.fixture(scope="module")
def plain_outputs(target):
    llm = LLM(str(target), dtype="float32", block_size=8)
    params = params_for(llm)
    return params, generate_all(llm, params)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_outputs_equal_plain_decoding(target, draft, plain_outputs, method, config):
    params, expected = plain_outputs
    llm = LLM(str(target), dtype="float32", block_size=8,
              speculative_config=spec_config(method, draft), **CONFIGS[config])  # fmt: skip
    outputs = generate_all(llm, params)
    for out, ref in zip(outputs, expected, strict=True):
        for got, want in zip(out.outputs, ref.outputs, strict=True):
            assert got.token_ids == want.token_ids
            assert got.text == want.text
            assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
            if want.logprobs is not None:
                assert len(got.logprobs) == len(want.logprobs)
                for g, w in zip(got.logprobs, want.logprobs, strict=True):
                    assert g.keys() == w.keys()
                    assert [x.logprob for x in g.values()] == pytest.approx(
                        [x.logprob for x in w.values()], abs=1e-4
                    )
    stats = llm.llm_engine.get_stats()
    # Drafts were verified, some accepted and some not, at every position.
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_accepted_tokens == sum(
        stats.spec_decode_num_accepted_tokens_per_pos
    )
    assert all(n > 0 for n in stats.spec_decode_num_accepted_tokens_per_pos)
    if config == "preempt-tiny-pool":
        assert stats.num_preemptions > 0
    if config == "default":
        assert stats.prefix_cache_hits > 0
        assert_no_draft_cached(llm, outputs)
    assert_pool_free(llm)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_attention_backend_verifies_drafts(draft, backend):
    """Verify steps are prefill-shaped (k + 1 queries over cached context) on every backend;
    the `cpu` one runs them in the tests above (its decode kernel, as graphs when one request
    verifies). (The draft fixture is the model here: its text repeats soon, so drafts come
    early.)"""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kwargs = dict(dtype="float32", block_size=8, attention_backend=backend)
    plain = LLM(str(draft), **kwargs).generate(PROMPTS[0], params)
    llm = LLM(str(draft), speculative_config=NGRAM, **kwargs)
    spec = llm.generate(PROMPTS[0], params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.llm_engine.get_stats().spec_decode_num_accepted_tokens > 0
    assert_pool_free(llm)


def test_seeded_sampling_with_drafts_is_independent_of_the_batch(target):
    llm = LLM(str(target), dtype="float32", speculative_config=NGRAM)
    seeded = SamplingParams(temperature=0.7, seed=7, max_tokens=30, ignore_eos=True)
    (alone,) = llm.generate(PROMPTS[0], seeded)
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(PROMPTS, [seeded, others, others, others])
    assert batch[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert llm.llm_engine.get_stats().spec_decode_num_accepted_tokens > 0
    assert_pool_free(llm)


def test_a_resumed_request_goes_on_with_drafts(target):
    """A worker crash resumes a request from its emitted tokens: the rest is unchanged."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    (plain,) = LLM(str(target), dtype="float32").generate(PROMPTS[0], params)
    expected = plain.outputs[0].token_ids
    llm = LLM(str(target), dtype="float32", speculative_config=NGRAM)
    engine = llm.llm_engine
    engine.add_request("r", PROMPTS[0], params, resume=[expected[:17]])
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
    assert expected[:17] + tokens == expected
    assert engine.get_stats().spec_decode_num_accepted_tokens > 0
    assert_pool_free(llm)


@pytest.mark.parametrize("short_max_tokens", [30, 8])
def test_steps_of_disable_by_batch_size_requests_propose_nothing(target, short_max_tokens):
    """Three requests against a threshold of 3: no drafts while all three run; once the short
    one (8 tokens) is done, the other two verify drafts again. Outputs are the plain ones."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (30, 30, short_max_tokens)]  # fmt: skip
    plain = LLM(str(target), dtype="float32").generate(PROMPTS[:3], params)
    config = {**NGRAM, "disable_by_batch_size": 3}
    llm = LLM(str(target), dtype="float32", speculative_config=config)
    assert llm.llm_engine.engine_core.model_runner.disable_by_batch_size == 3
    outputs = llm.generate(PROMPTS[:3], params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    num_drafts = llm.llm_engine.get_stats().spec_decode_num_drafts
    assert (num_drafts > 0) == (short_max_tokens < 30)
    assert_pool_free(llm)


def test_verify_graphs_stop_where_speculation_does():
    """Decode graphs hold verify buckets only up to the batch size that still speculates: with
    a threshold of 8, steps of at most 7 requests verify drafts, so the size-8 bucket is the
    largest (without the cap, every size: in bf16 on the Zen 4 EPYC a 304 MB graph pool for
    the 128 x 6 rows of the largest)."""
    from engine.decode_graphs import CpuDecodeGraphs, capture_sizes

    sizes = capture_sizes(128)
    for max_verify_reqs, verify_sizes in ((7, [1, 2, 4, 8]), (8, [1, 2, 4, 8]), (None, sizes)):
        graphs = CpuDecodeGraphs(
            None, None, sizes, 4, 16, torch.device("cpu"), (1, 6), max_verify_reqs=max_verify_reqs
        )
        assert [size for q, size in graphs.buckets if q == 1] == sizes
        assert [size for q, size in graphs.buckets if q == 6] == verify_sizes


def test_auto_disable_by_batch_size_applies_where_it_was_measured(monkeypatch):
    """`"auto"` turns speculation off from 8 requests in bf16 on the vector unit of an
    AVX512-BF16 CPU without AMX and from 16 on AMX's tile unit (the crossovers measured
    there), and never elsewhere."""
    from engine.kernels import cpu_build
    from engine.spec_decode import auto_disable_by_batch_size

    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(cpu_build, "has_amx_bf16", lambda: False)
    assert auto_disable_by_batch_size(cpu, bf16, None) == 8
    assert auto_disable_by_batch_size(cpu, torch.float32, None) is None
    assert auto_disable_by_batch_size(cpu, bf16, "int8") is None
    assert auto_disable_by_batch_size(torch.device("cuda"), bf16, None) is None
    monkeypatch.setattr(cpu_build, "has_amx_bf16", lambda: True)
    assert auto_disable_by_batch_size(cpu, bf16, None) == 16
    assert auto_disable_by_batch_size(cpu, bf16, "int8") is None
    monkeypatch.setattr(cpu_build, "has_amx_bf16", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert auto_disable_by_batch_size(cpu, bf16, None) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [K, 5])
def test_the_default_model_is_lossless(dtype, k):
    """SmolLM2 copying a passage, one request: drafts are mostly accepted, and text and
    logprobs are the plain ones bit for bit, in bf16 too. On the `cpu` backend a verify step
    of up to 5 drafts computes each position exactly as its decode step would (the decode
    kernel takes its queries, the float linear and the small ops its rows, each exactly as
    alone); in bf16 a rounding apart is enough to change SmolLM2's greedy text."""
    passage = (
        "The river rises in the northern hills, runs south through three market towns, and "
        "meets the sea at a wide estuary where the old harbour still stands."
    )
    messages = [{"role": "user", "content": f"Repeat this sentence exactly:\n{passage}"}]
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=2)
    plain = LLM(dtype=dtype).chat(messages, params)[0].outputs[0]
    llm = LLM(dtype=dtype, speculative_config={**NGRAM, "num_speculative_tokens": k})
    spec = llm.chat(messages, params)[0].outputs[0]
    assert spec.token_ids == plain.token_ids
    assert [{t: lp.logprob for t, lp in d.items()} for d in spec.logprobs] == [
        {t: lp.logprob for t, lp in d.items()} for d in plain.logprobs
    ]
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > stats.spec_decode_num_draft_tokens / 2
    assert_pool_free(llm)


def chi_square(samples: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=len(p)).double()
    expected = p.double() * len(samples)
    return float(((counts - expected) ** 2 / expected).sum())


# The 0.999 quantile of chi-square with 5 degrees of freedom: a correct sampler fails the
# test with probability 0.001 (and the draws are seeded, so it either always passes or not).
CHI2_5DF_999 = 20.515


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampling_emits_the_target_distribution(one_hot):
    """Drafts from q, verified against p: the first emitted token is distributed as p."""
    torch.manual_seed(0)
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    q = torch.tensor([0.40, 0.05, 0.25, 0.05, 0.15, 0.10])
    num_draws = 20000
    if one_hot:  # the proposers' case: a certain draft, always token 2
        drafts = torch.full((num_draws, 1), 2)
        draft_probs = None
    else:
        drafts = torch.multinomial(q, num_draws, replacement=True)[:, None]
        draft_probs = q.expand(num_draws, -1)
    outputs = rejection_sample(
        drafts.tolist(),
        target_argmax=[0] * (2 * num_draws),
        target_probs=p.expand(2 * num_draws, -1),
        is_greedy=[False] * num_draws,
        generators={},
        draft_probs=draft_probs,
    )
    first = torch.tensor([o[0] for o in outputs])
    assert chi_square(first, p) < CHI2_5DF_999
    # A control: the drafts themselves are not distributed as p.
    if not one_hot:
        assert chi_square(drafts[:, 0], p) > CHI2_5DF_999
    # An accepted draft is followed by the bonus token; a rejected one ends the output.
    for out, d in zip(outputs, drafts[:, 0].tolist(), strict=True):
        assert len(out) == (2 if out[0] == d else 1)


def test_greedy_verification_accepts_the_argmax_prefix():
    outputs = rejection_sample(
        [[4, 5, 6], [], [8]],
        target_argmax=[4, 5, 9, 1, 3, 8, 2],
        target_probs=None,
        is_greedy=[True, True, True],
        generators={},
    )
    assert outputs == [[4, 5, 9], [3], [8, 2]]


def test_ngram_proposes_the_continuation_of_the_latest_longest_match():
    proposer = NgramProposer(num_speculative_tokens=3, lookup_min=1, lookup_max=3)
    tokens = torch.tensor([1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 7, 2, 3]).numpy()
    assert proposer.propose(tokens) == [4, 5, 6]  # [2, 3] last seen before [4, 5, 6]
    assert proposer.propose(torch.tensor([5, 6, 7]).numpy()) == []
    assert NgramProposer(2, 2, 2).propose(torch.tensor([1, 2, 8, 2]).numpy()) == []


@settings(max_examples=300, deadline=None)
@given(
    token_ids=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    k=st.integers(1, 5),
    lookup=st.tuples(st.integers(1, 5), st.integers(0, 3)),
)
def test_ngram_matches_the_search_of_every_window(token_ids, k, lookup):
    """The proposer's candidate filtering against the definition: for n from lookup_max down
    to lookup_min, the latest earlier window equal to the last n tokens, and what follows it."""
    lookup_min, lookup_max = lookup[0], lookup[0] + lookup[1]
    expected: list[int] = []
    for n in range(min(lookup_max, len(token_ids) - 1), lookup_min - 1, -1):
        starts = [j for j in range(len(token_ids) - n) if token_ids[j : j + n] == token_ids[-n:]]
        if starts:
            expected = token_ids[starts[-1] + n : starts[-1] + n + k]
            break
    proposer = NgramProposer(k, lookup_min, lookup_max)
    assert proposer.propose(np.array(token_ids, dtype=np.int64)) == expected


def make_scheduler(budget: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=budget,
            max_model_len=64,
            num_speculative_tokens=3,
        ),
        CacheConfig(block_size=4, num_blocks=32),
    )


def test_scheduler_verifies_drafts_and_takes_back_the_rejected():
    sched = make_scheduler()
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    request = Request("a", [10, 11, 12, 13, 14], params, eos_token_id=2)
    sched.add_request(request)
    out = sched.schedule()
    sched.update_from_output(
        out, ModelRunnerOutput(["a"], [[20]], [[]], spec_token_ids=[[21, 22, 23]])
    )
    assert request.spec_token_ids == [21, 22, 23]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_decode_tokens == {"a": [21, 22, 23]}
    # Draft 1 accepted, draft 2 rejected: the target's token 30 replaces it.
    (core,) = sched.update_from_output(
        out, ModelRunnerOutput(["a"], [[21, 30]], [[]], spec_token_ids=[[31]])
    )
    assert core.new_token_ids == [21, 30]
    assert request.num_computed_tokens == request.num_tokens - 1 == 7
    stats = sched.make_stats()
    assert stats.spec_decode_num_accepted_tokens_per_pos == [1, 0, 0]
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens) == (1, 3)
    # The budget cuts drafts first: 2 tokens for a request with 1 + 1 draft... and 3 drafts.
    request.spec_token_ids = [40, 41, 42]
    sched.config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2, max_model_len=64,
                                   num_speculative_tokens=3)  # fmt: skip
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [40]}
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[50]], [[]], spec_token_ids=[[]]))
    assert request.num_computed_tokens == request.num_tokens - 1
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.get_num_blocks_in_use() == 0


def test_a_stop_inside_an_accepted_run_drops_the_tokens_after_it():
    sched = make_scheduler()
    params = SamplingParams(max_tokens=5)
    request = Request("a", [10, 11, 12], params, eos_token_id=2)
    sched.add_request(request)
    out = sched.schedule()
    sched.update_from_output(
        out, ModelRunnerOutput(["a"], [[20]], [[]], spec_token_ids=[[2, 22, 23]])
    )
    assert request.spec_token_ids == [2, 22, 23]  # max_tokens leaves room for 3 more + 1
    out = sched.schedule()
    (core,) = sched.update_from_output(
        out, ModelRunnerOutput(["a"], [[2, 22, 23, 24]], [[]], spec_token_ids=[[]])
    )
    assert core.new_token_ids == [2]
    assert core.finish_reason == "stop"
    assert sched.kv_cache_manager.get_num_blocks_in_use() == 0
    # max_tokens mid-run: drafts are cut to what max_tokens leaves.
    request = Request("b", [10, 11, 12], params, eos_token_id=2)
    sched.add_request(request)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["b"], [[20]], [[]], spec_token_ids=[[21]]))
    out = sched.schedule()
    sched.update_from_output(
        out, ModelRunnerOutput(["b"], [[21, 22]], [[]], spec_token_ids=[[23, 24, 25]])
    )
    assert request.spec_token_ids == [23]  # 3 tokens made, 2 left: 1 draft + 1
    assert sched.kv_cache_manager.get_num_blocks_in_use() > 0
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.get_num_blocks_in_use() == 0


@pytest.mark.parametrize(
    "options,field",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 9}, "num_speculative_tokens"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5},
         "prompt_lookup_max"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
         "disable_by_batch_size"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": "never"},
         "disable_by_batch_size"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
        ({"num_speculative_tokens": 2}, "method"),
    ],
)  # fmt: skip
def test_bad_speculative_config_names_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(options)


def test_a_draft_model_with_another_vocabulary_is_refused(target, tmp_path):
    other = make_tiny_model(tmp_path / "other", "llama", vocab_size=1000)
    config = {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocab"):
        LLM(str(target), dtype="float32", speculative_config=config)
