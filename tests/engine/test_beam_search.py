"""Beam search: the sequences of HF transformers' `generate(num_beams=k)`, the copy on write of
the block beams share, KV accounting under pressure, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, BeamSearchParams, SamplingParams
from engine.kv_cache import KVCacheManager, hash_block_tokens
from engine.request import Request
from tests.engine.test_kv_cache import assert_all_free
from tests.engine.test_llm import PROMPTS, assert_pool_free
from tests.engine.test_scheduler import EOS, fake_runner, make_scheduler, run_to_completion, step
from tests.engine.tiny_models import make_tiny_model, smollm2_dir

NUM_NEW_TOKENS = 12
# The tiny model's EOS logit row is scaled up so that EOS comes within 12 tokens for some
# beams and not for others (measured: of the searches below, some end every sequence at
# max_tokens, others have finished hypotheses of 2 to 12 tokens).
EOS_LOGIT_SCALE = 3.0
TINY_PROMPTS = [PROMPTS[0], PROMPTS[4], PROMPTS[9], PROMPTS[1], PROMPTS[6]]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_dir())


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory, tokenizer):
    path = make_tiny_model(tmp_path_factory.mktemp("eos"), "llama", tie_word_embeddings=False)
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"][tokenizer.eos_token_id] *= EOS_LOGIT_SCALE
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def hf_beam_search():
    """HF's sequences (generated tokens, the EOS that ended one included) and scores, best
    first, by `generate` with the flags that are kvrail's rule (see engine/beam_search.py);
    per model, prompt and params, computed once."""
    models, results = {}, {}

    def search(model_dir, prompt_ids: list[int], params: BeamSearchParams, eos: int):
        key = (str(model_dir), tuple(prompt_ids), params)
        if key not in results:
            if model_dir not in models:
                models[model_dir] = AutoModelForCausalLM.from_pretrained(
                    model_dir, dtype=torch.float32
                ).eval()
            results[key] = _hf_beam_search(models[model_dir], prompt_ids, params, eos)
        return results[key]

    return search


def _hf_beam_search(model, prompt_ids: list[int], params: BeamSearchParams, eos: int):
    out = model.generate(
        torch.tensor([prompt_ids]),
        do_sample=False,
        num_beams=params.beam_width,
        num_return_sequences=params.beam_width,
        length_penalty=params.length_penalty,
        early_stopping=False,
        max_new_tokens=params.max_tokens,
        eos_token_id=None if params.ignore_eos else eos,
        pad_token_id=eos,
        output_scores=True,
        return_dict_in_generate=True,
    )
    sequences = []
    for row in out.sequences.tolist():
        generated = row[len(prompt_ids) :]
        if not params.ignore_eos and eos in generated:  # HF pads the shorter ones
            generated = generated[: generated.index(eos) + 1]
        sequences.append(generated)
    if params.beam_width > 1:
        return sequences, out.sequences_scores.tolist()
    # Width 1 is HF's greedy search, which scores nothing: its logits give the logprobs.
    logprobs = [
        torch.log_softmax(step[0], -1)[t] for step, t in zip(out.scores, sequences[0], strict=True)
    ]
    return sequences, [float(sum(logprobs)) / len(sequences[0]) ** params.length_penalty]


def assert_matches_hf(llm: LLM, hf_beam_search, model_dir, prompts, params) -> list[str]:
    """Every prompt's sequences are HF's, in HF's order, scored alike; returns the finish
    reasons seen."""
    eos = llm.get_tokenizer().eos_token_id
    reasons = []
    for prompt, output in zip(prompts, llm.beam_search(prompts, params), strict=True):
        ids = llm.llm_engine.tokenize_prompt(prompt)[1]
        expected, scores = hf_beam_search(model_dir, ids, params, eos)
        generated = [s.tokens[len(ids) :] for s in output.sequences]
        assert generated == expected, (prompt, params)
        for sequence, tokens, score in zip(output.sequences, generated, scores, strict=True):
            assert sequence.tokens[: len(ids)] == ids
            ours = sequence.cum_logprob / len(tokens) ** params.length_penalty
            assert ours == pytest.approx(score, rel=1e-4, abs=1e-4)
            ended_by_eos = tokens[-1] == eos and not params.ignore_eos
            assert sequence.finish_reason == ("stop" if ended_by_eos else "length")
            reasons.append(sequence.finish_reason)
    return reasons


# (beam_width, length_penalty, ignore_eos): widths 1 (HF's greedy search) to 4, HF's default
# length penalty and others (negative: shorter hypotheses favoured), EOS reached or ignored
SEARCHES = [(1, 1.0, False), (2, 1.0, False), (4, 1.0, False), (4, -0.5, False), (3, 2.0, True)]


@pytest.mark.parametrize(
    "kwargs,searches",
    [
        (dict(), SEARCHES),
        (dict(block_size=8, max_num_batched_tokens=16, enable_prefix_caching=False), SEARCHES[2:]),
    ],
    ids=["default", "bs8-chunked-no-prefix-cache"],
)
def test_tiny_model_matches_hf(eos_model, hf_beam_search, kwargs, searches):
    """The second run forks beams at every offset of 8-token blocks, after prompts prefilled
    over several steps, with blocks shared by reference only (no prefix cache)."""
    llm = LLM(str(eos_model), dtype="float32", **kwargs)
    reasons = []
    for beam_width, length_penalty, ignore_eos in searches:
        params = BeamSearchParams(beam_width, NUM_NEW_TOKENS, ignore_eos, length_penalty)
        reasons += assert_matches_hf(llm, hf_beam_search, eos_model, TINY_PROMPTS, params)
    assert "stop" in reasons and "length" in reasons
    assert_pool_free(llm)


@pytest.mark.slow
def test_smollm2_matches_hf(tokenizer, hf_beam_search):
    """The default model, chat prompts: one answer ends (EOS) within 16 tokens, one does not."""
    questions = ["What is the capital of France?", "Write a long story about a dragon."]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]
    llm = LLM(dtype="float32")
    reasons = []
    for beam_width in (2, 4):
        params = BeamSearchParams(beam_width, 16)
        reasons += assert_matches_hf(llm, hf_beam_search, smollm2_dir(), prompts, params)
    assert "stop" in reasons and "length" in reasons
    (output,) = llm.beam_search(prompts[0], BeamSearchParams(2, 16))
    assert "Paris" in output.sequences[0].text
    assert output.sequences[0].text.startswith(tokenizer.decode(tokenizer.encode(prompts[0])))
    assert_pool_free(llm)


def test_copy_on_write_copies_exactly_the_shared_partial_block():
    """KV-manager level: two forks of a 10-token request (blocks of 4: two full, one holding
    2 tokens) share its three blocks; the first to write gets a copy of the partial block,
    the full ones stay shared with their hashes, the second writes in place."""
    bs = 4
    manager = KVCacheManager(num_blocks=8, block_size=bs)
    parent = Request("p", list(range(10)), SamplingParams(max_tokens=1), None, keep_blocks=True)
    manager.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    b0, b1, b2 = manager.req_to_blocks["p"]
    children = [Request(f"c{t}", [*range(10), t], SamplingParams(), None) for t in (100, 101)]
    for child in children:
        assert manager.fork(parent, child) == 10
        child.num_computed_tokens = 10
        assert manager.req_to_blocks[child.request_id] == [b0, b1, b2]
    manager.free(parent)
    assert [b.ref_cnt for b in (b0, b1, b2)] == [2, 2, 2]

    first, second = children
    assert manager.allocate_slots(first, 1) == []
    (copy,) = [b for b in manager.req_to_blocks["c100"] if b not in (b0, b1, b2)]
    assert manager.blocks_to_copy == [(b2.block_id, copy.block_id)]
    assert manager.req_to_blocks["c100"] == [b0, b1, copy]
    assert copy.ref_cnt == 1 and copy.block_hash is None and b2.ref_cnt == 1
    assert b1.block_hash == hash_block_tokens(hash_block_tokens(None, range(4)), range(4, 8))
    assert manager.allocate_slots(second, 1) == []  # the last sharer writes in place
    assert manager.req_to_blocks["c101"] == [b0, b1, b2]
    assert len(manager.blocks_to_copy) == 1

    # A fork at a block boundary shares full blocks only: its next token takes a new block.
    first.num_computed_tokens = 11
    first.append_output_token_ids([5])
    assert manager.allocate_slots(first, 1) == []  # the copy's last slot
    first.num_computed_tokens = 12
    edge = Request("edge", [*first.all_token_ids, 7], SamplingParams(), None)
    assert manager.fork(first, edge) == 12
    edge.num_computed_tokens = 12
    assert len(manager.allocate_slots(edge, 1)) == 1 and len(manager.blocks_to_copy) == 1
    for request in (first, second, edge):
        manager.free(request)
    assert_all_free(manager)


@pytest.mark.parametrize(
    "backend,kv_cache_dtype", [("torch", "auto"), ("cpu", "auto"), ("cpu", "fp8")]
)
def test_model_runner_copies_the_block_before_writing(eos_model, backend, kv_cache_dtype):
    """Through the engine: a finished request that kept its blocks, forked twice; the step
    copies its partial block once (every layer's K and V, fp8 bytes included), each fork then
    writes its own token, and both see the same logprobs as a fresh request of their tokens.
    (The triton backend keeps the same cache layout; under the CPU's interpreter its fp8
    calibration alone takes minutes.)"""
    kwargs = dict(dtype="float32", block_size=8, attention_backend=backend)
    llm = LLM(str(eos_model), kv_cache_dtype=kv_cache_dtype, **kwargs)
    core = llm.llm_engine.engine_core
    scheduler, runner = core.scheduler, core.model_runner
    prompt = llm.llm_engine.tokenize_prompt(PROMPTS[2])[1][:13]  # 5 tokens in block 1
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=4)
    core.add_request(Request("p", prompt, params, None, keep_blocks=True))
    while "p" not in scheduler.kept:
        core.step()
    src = scheduler.kv_cache_manager.get_block_ids("p")[-1]
    forks = [Request(f"c{t}", [*prompt, t], params, None) for t in (100, 200)]
    for fork in forks:
        core.fork_request("p", fork)
    core.release_blocks(["p"])

    output = scheduler.schedule()
    (copy,) = output.blocks_to_copy
    assert copy[0] == src
    dst = copy[1]
    outputs = scheduler.update_from_output(output, runner.execute_model(output))
    for k_cache, v_cache in runner.kv_caches:
        for cache in (k_cache, v_cache):
            assert torch.equal(cache[dst, :5].view(torch.uint8), cache[src, :5].view(torch.uint8))
            assert not torch.equal(cache[dst, 5].view(torch.uint8), cache[src, 5].view(torch.uint8))
    fresh = llm.generate([fork.prompt_token_ids for fork in forks], params)
    for out, expected in zip(sorted(outputs, key=lambda o: o.request_id), fresh, strict=True):
        assert out.new_token_ids == expected.outputs[0].token_ids
        ours = dict(zip(out.new_logprobs[0].token_ids, out.new_logprobs[0].logprobs, strict=True))
        theirs = {t: lp.logprob for t, lp in expected.outputs[0].logprobs[0].items()}
        assert ours == pytest.approx(theirs, abs=1e-4)
    core.step()
    assert_pool_free(llm)


def test_beams_share_their_prefix_blocks(eos_model):
    """During a width-4 search each beam holds only its tail past the prompt's full blocks,
    at every step's forward: 4 independent sequences would hold 4 prompts."""
    llm = LLM(str(eos_model), dtype="float32")
    scheduler = llm.llm_engine.engine_core.scheduler
    kv = scheduler.kv_cache_manager
    peak = 0
    schedule = scheduler.schedule

    def measured_schedule(*args, **kwargs):
        nonlocal peak
        output = schedule(*args, **kwargs)
        peak = max(peak, kv.get_num_blocks_in_use())
        return output

    scheduler.schedule = measured_schedule
    prompt = PROMPTS[8]
    num_prompt_tokens = len(llm.llm_engine.tokenize_prompt(prompt)[1])
    llm.beam_search(prompt, BeamSearchParams(4, NUM_NEW_TOKENS, ignore_eos=True))
    bs = kv.block_size
    tail = num_prompt_tokens % bs + NUM_NEW_TOKENS
    assert peak <= num_prompt_tokens // bs + 4 * math.ceil(tail / bs)
    assert peak < 2 * math.ceil((num_prompt_tokens + NUM_NEW_TOKENS) / bs)
    assert_pool_free(llm)


def held_parent(sched, num_tokens: int = 10) -> Request:
    """A finished request of `num_tokens` prompt tokens that kept its blocks."""
    tokens = list(range(10, 10 + num_tokens))
    parent = Request("p", tokens, SamplingParams(max_tokens=1), EOS, keep_blocks=True)
    sched.add_request(parent)
    step(sched)
    assert sched.kept == {"p": parent}
    return parent


def test_pressure_frees_the_blocks_kept_for_forks_first():
    sched = make_scheduler(num_blocks=4, block_size=4)
    parent = held_parent(sched)  # 3 blocks of 4
    sched.add_request(Request("q", list(range(50, 62)), SamplingParams(max_tokens=1), EOS))
    out = sched.schedule()  # q needs 3 blocks, 1 is free
    assert out.num_scheduled_tokens == {"q": 12} and parent.num_computed_tokens == 0
    sched.update_from_output(out, fake_runner(sched, out))
    fork = Request("c", [*parent.prompt_token_ids, 30], SamplingParams(max_tokens=1), EOS)
    sched.fork_request("p", fork)  # the parent's blocks went: the fork computes its tokens
    sched.release_blocks(["p"])
    assert fork.num_computed_tokens == 0
    run_to_completion(sched)
    assert fork.output_token_ids == [7]


def test_waiting_forks_give_their_blocks_up_when_nothing_runs():
    """Two forks of a request filling the pool: the first needs a copy of the shared block
    and no block is free, nothing runs to free one, so the forks give theirs up and are
    computed again (from the prefix cache's full blocks), one after the other."""
    sched = make_scheduler(num_blocks=3, block_size=4)
    parent = held_parent(sched)
    forks = [
        Request(f"c{t}", [*parent.prompt_token_ids, t], SamplingParams(max_tokens=1), EOS)
        for t in (30, 31)
    ]
    for fork in forks:
        sched.fork_request("p", fork)
    sched.release_blocks(["p"])
    assert sched.kv_cache_manager.get_num_blocks_in_use() == 3
    out = sched.schedule()
    assert not out.num_scheduled_tokens and not out.blocks_to_copy
    assert sched.kv_cache_manager.get_num_blocks_in_use() == 0
    assert [f.num_computed_tokens for f in forks] == [0, 0]
    sched.update_from_output(out, fake_runner(sched, out))
    run_to_completion(sched)
    assert [f.output_token_ids for f in forks] == [[7], [7]]
    assert all(f.num_cached_tokens == 8 for f in forks)


@pytest.mark.parametrize(
    "limits",
    [dict(num_kv_blocks=12, max_model_len=96), dict(max_num_seqs=3)],
    ids=["tiny-pool", "fewer-seats-than-beams"],
)
def test_constrained_engines_give_the_same_beams(eos_model, limits):
    """KV pressure (the blocks kept for forks freed first, waiting forks giving theirs up when
    nothing runs), or fewer seats than beams (a step's beams run over several steps): the
    searches end with the beams of an unconstrained engine."""
    prompts = [PROMPTS[6], PROMPTS[2]]
    params = BeamSearchParams(4, 24, ignore_eos=True)
    kwargs = dict(dtype="float32", block_size=8)
    expected = LLM(str(eos_model), **kwargs).beam_search(prompts, params)
    llm = LLM(str(eos_model), **limits, **kwargs)
    outputs = llm.beam_search(prompts, params)
    assert [[s.tokens for s in o.sequences] for o in outputs] == [
        [s.tokens for s in o.sequences] for o in expected
    ]
    assert_pool_free(llm)


def test_beam_searches_batch_with_other_requests(eos_model):
    """Through `LLMEngine`: beam searches beside sampled requests, each beam search answered
    once, whole, with the beams it has alone; an abort mid-search frees everything."""
    llm = LLM(str(eos_model), dtype="float32", block_size=8)
    engine = llm.llm_engine
    params = BeamSearchParams(3, NUM_NEW_TOKENS, length_penalty=0.5)
    alone = llm.beam_search(TINY_PROMPTS[:2], params)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True)
    engine.add_request("beam-a", TINY_PROMPTS[0], params)
    engine.add_request("sampled", PROMPTS[7], sampled)
    engine.add_request("beam-b", TINY_PROMPTS[1], params, priority=0)
    assert engine.get_unfinished_request("beam-a").open_indices == [0, 1, 2]
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id.startswith("beam"):
                assert output.finished and output.request_id not in finals
                finals[output.request_id] = output
    for request_id, expected in zip(("beam-a", "beam-b"), alone, strict=True):
        output = finals[request_id]
        assert [c.index for c in output.outputs] == [0, 1, 2]
        assert [output.prompt_token_ids + c.token_ids for c in output.outputs] == [
            s.tokens for s in expected.sequences
        ]
        assert [c.cumulative_logprob for c in output.outputs] == pytest.approx(
            [s.cum_logprob for s in expected.sequences], abs=1e-4
        )
        assert all(c.text for c in output.outputs)
    assert_pool_free(llm)

    engine.add_request("aborted", TINY_PROMPTS[2], params)
    for _ in range(4):
        engine.step()
    assert engine.get_stats().num_blocks_in_use > 0
    engine.abort_request("aborted")
    assert not engine.has_unfinished_requests() and engine.get_unfinished_request("aborted") is None
    engine.step()
    assert_pool_free(llm)


def test_beam_search_with_a_draft_model(eos_model):
    """Speculative decoding on: beams take no drafts (one token each), and the blocks copied
    on write are copied in the draft model's cache too; the beams are unchanged."""
    params = BeamSearchParams(2, NUM_NEW_TOKENS)
    kwargs = dict(dtype="float32", block_size=8)
    expected = LLM(str(eos_model), **kwargs).beam_search(TINY_PROMPTS[:2], params)
    spec = {"method": "draft_model", "model": str(eos_model), "num_speculative_tokens": 2}
    llm = LLM(str(eos_model), speculative_config=spec, **kwargs)
    outputs = llm.beam_search(TINY_PROMPTS[:2], params)
    assert [[s.tokens for s in o.sequences] for o in outputs] == [
        [s.tokens for s in o.sequences] for o in expected
    ]
    assert_pool_free(llm)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(beam_width=0, max_tokens=8), "beam_width"),
        (dict(beam_width=11, max_tokens=8), "beam_width"),
        (dict(beam_width=True, max_tokens=8), "beam_width"),
        (dict(beam_width=2.0, max_tokens=8), "beam_width"),
        (dict(beam_width=2, max_tokens=0), "max_tokens"),
        (dict(beam_width=2, max_tokens=1.5), "max_tokens"),
        (dict(beam_width=2, max_tokens=8, ignore_eos=1), "ignore_eos"),
        (dict(beam_width=2, max_tokens=8, length_penalty=math.nan), "length_penalty"),
        (dict(beam_width=2, max_tokens=8, length_penalty=math.inf), "length_penalty"),
        (dict(beam_width=2, max_tokens=8, length_penalty=1e308), "length_penalty"),
        (dict(beam_width=2, max_tokens=8, length_penalty=-10.5), "length_penalty"),
        (dict(beam_width=2, max_tokens=8, length_penalty="1"), "length_penalty"),
    ],
)
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        BeamSearchParams(**kwargs)


def test_bad_requests_are_refused(eos_model):
    llm = LLM(str(eos_model), dtype="float32")
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search(PROMPTS[0], SamplingParams())
    params = BeamSearchParams(2, 4)
    with pytest.raises(ValueError, match="resume"):
        engine.add_request("r", PROMPTS[0], params, resume=[[5], []])
    with pytest.raises(ValueError, match="priority"):
        engine.add_request("r", PROMPTS[0], params, priority=1)
    engine.add_request("r", PROMPTS[0], params, resume=[[], []])  # a restart
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("r", PROMPTS[1], SamplingParams())
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("r", PROMPTS[1], params)
    engine.abort_request("r")
    assert_pool_free(llm)
