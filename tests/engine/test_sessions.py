"""Streaming-input sessions (`LLMEngine.add_request(resumable=True)`): a request fed in turns.

Each later turn must generate what a fresh request over the whole history generates (fp32,
a tiny random model, a reference engine without prefix caching), while computing only its new
prompt tokens and the last token of the turn before (sampled, its KV never written). The
scheduler's side (eviction first under KV pressure, the idle timeout, a history that differs
from what the session computed) is checked on a fake KV config. Every test ends with the KV
pool fully free.
"""

from __future__ import annotations

import time

import pytest

from engine import LLMEngine, SamplingParams
from engine.request import Request, RequestStatus
from tests.engine.test_scheduler import EOS, fake_runner, make_request, make_scheduler
from tests.engine.tiny_models import make_tiny_model

ENGINE_KWARGS = dict(dtype="float32", max_model_len=512, block_size=16, num_kv_blocks=64)
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama"))


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine.from_kwargs(model=model_dir, **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def reference(model_dir):
    """A fresh request over a whole history, on an engine that shares nothing with it."""
    fresh = LLMEngine.from_kwargs(model=model_dir, enable_prefix_caching=False, **ENGINE_KWARGS)

    def generate(prompt_token_ids: list[int], params: SamplingParams) -> tuple[list[int], str]:
        fresh.add_request("ref", prompt_token_ids, params)
        token_ids, text = run_turn(fresh, "ref")[:2]
        return token_ids, text

    return generate


def run_turn(engine: LLMEngine, request_id: str) -> tuple[list[int], str, list]:
    """Step until the request's turn ends: its tokens, its text and its outputs."""
    outputs = []
    while not (outputs and outputs[-1].outputs[0].finish_reason is not None):
        outputs += [o for o in engine.step() if o.request_id == request_id]
    completions = [o.outputs[0] for o in outputs]
    return (
        [t for c in completions for t in c.token_ids],
        "".join(c.text for c in completions),
        outputs,
    )


def assert_pool_free(engine: LLMEngine) -> None:
    kv = engine.engine_core.scheduler.kv_cache_manager
    assert kv.get_num_blocks_in_use() == 0
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def num_prefill_tokens(engine: LLMEngine) -> int:
    return engine.get_stats().num_prefill_tokens


def test_later_turns_generate_what_a_fresh_request_over_the_history_does(engine, reference):
    """Three turns, each with its own params (greedy, then seeded sampling, then a stop
    token), each against a fresh request over prompt + outputs so far + its prompt; turns 2
    and 3 compute only their new tokens and the last sampled one."""
    tokenizer = engine.tokenizer
    chunks = [
        tokenizer.encode("The quick brown fox jumps over the lazy dog, and then"),
        tokenizer.encode(" Question: what did the fox do next?"),
        tokenizer.encode(" And the dog?"),
    ]
    turns = [
        SamplingParams(max_tokens=12, **GREEDY),
        SamplingParams(max_tokens=9, temperature=0.8, seed=7),
        None,  # greedy up to a stop token, found below
    ]
    history: list[int] = []
    for turn, (chunk, params) in enumerate(zip(chunks, turns, strict=True)):
        context = history + chunk
        if params is None:
            fresh, _ = reference(context, SamplingParams(max_tokens=10, **GREEDY))
            params = SamplingParams(max_tokens=10, stop_token_ids=[fresh[4]], **GREEDY)
        last = turn == len(chunks) - 1
        before = num_prefill_tokens(engine)
        engine.add_request("s", chunk, params, resumable=not last)
        token_ids, text, outputs = run_turn(engine, "s")
        assert (token_ids, text) == reference(context, params)
        assert not any(o.finished for o in outputs[:-1]) and outputs[-1].finished == last
        assert outputs[-1].prompt_token_ids == context
        if turn:
            assert num_prefill_tokens(engine) - before == len(chunk) + 1
            assert outputs[-1].num_cached_tokens == len(history) - 1
        history = context + token_ids
    assert outputs[-1].outputs[0].stop_reason == token_ids[-1]  # the stop token ended it
    assert engine.get_session_token_ids("s") is None and not engine.has_unfinished_requests()
    assert_pool_free(engine)


def test_a_waiting_session_needs_no_step_and_closes_when_aborted(engine):
    params = SamplingParams(max_tokens=4, **GREEDY)
    engine.add_request("w", list(range(300, 340)), params, resumable=True)
    token_ids = run_turn(engine, "w")[0]
    assert not engine.has_unfinished_requests()  # `LLM.generate` does not wait for it
    assert engine.get_session_token_ids("w") == list(range(300, 340)) + token_ids
    assert engine.get_unfinished_request("w") is None
    assert engine.engine_core.scheduler.kv_cache_manager.get_num_blocks_in_use() == 3
    engine.abort_request("w")
    assert engine.get_session_token_ids("w") is None
    assert_pool_free(engine)


def test_a_turn_asking_for_prompt_logprobs_recomputes_its_whole_context(engine):
    """Every position of its context needs logits: the session's KV is not taken over."""
    params = SamplingParams(max_tokens=4, **GREEDY)
    engine.add_request("p", list(range(700, 740)), params, resumable=True)
    context = list(range(700, 740)) + run_turn(engine, "p")[0] + [800, 801]
    before = num_prefill_tokens(engine)
    engine.add_request("p", [800, 801], SamplingParams(max_tokens=2, prompt_logprobs=0, **GREEDY))
    [output] = [o for o in run_turn(engine, "p")[2] if o.prompt_logprobs is not None]
    assert num_prefill_tokens(engine) - before == len(context)
    assert len(output.prompt_logprobs) == len(context)
    assert [next(iter(entry)) for entry in output.prompt_logprobs[1:]] == context[1:]
    assert_pool_free(engine)


def test_an_idle_session_is_closed_after_the_timeout(model_dir, reference):
    """Its blocks are freed and its closing reported; the id then starts a new request."""
    engine = LLMEngine.from_kwargs(model=model_dir, session_timeout_s=0.05, **ENGINE_KWARGS)
    params = SamplingParams(max_tokens=4, **GREEDY)
    engine.add_request("idle", list(range(400, 440)), params, resumable=True)
    history = list(range(400, 440)) + run_turn(engine, "idle")[0]
    assert engine.engine_core.scheduler.kv_cache_manager.get_num_blocks_in_use() > 0
    assert engine.step() == []  # not idle long enough yet
    time.sleep(0.1)
    [closed] = engine.step()
    assert (closed.request_id, closed.finished, closed.outputs) == ("idle", True, [])
    assert closed.prompt_token_ids == history
    assert_pool_free(engine)
    engine.add_request("idle", [500, 501, 502], params)
    assert run_turn(engine, "idle")[:2] == reference([500, 501, 502], params)
    assert_pool_free(engine)


def test_bad_session_input_is_refused_clearly(engine, model_dir):
    params = SamplingParams(max_tokens=4, **GREEDY)
    with pytest.raises(ValueError, match="resumable takes n=1"):
        engine.add_request("b", [5, 6, 7], SamplingParams(n=2, max_tokens=4), resumable=True)
    with pytest.raises(ValueError, match="resumable must be a boolean"):
        engine.add_request("b", [5, 6, 7], params, resumable="yes")
    engine.add_request("b", [5, 6, 7], params, resumable=True)
    with pytest.raises(ValueError, match="already running"):  # its turn has not ended
        engine.add_request("b", [8, 9], params, resumable=True)
    run_turn(engine, "b")
    with pytest.raises(ValueError, match="resume is for a request"):
        engine.add_request("b", [8, 9], params, resume=[[1, 2]])
    with pytest.raises(ValueError, match="more than max_model_len"):
        engine.add_request("b", list(range(600, 1106)), params)  # 506 + the 7 so far
    assert engine.get_session_token_ids("b") is not None  # still waiting: nothing was taken
    engine.abort_all()
    assert_pool_free(engine)
    for bad in (0, -1.0, float("nan"), float("inf"), "10", True):
        with pytest.raises(ValueError, match="session_timeout_s"):
            LLMEngine.from_kwargs(model=model_dir, session_timeout_s=bad, **ENGINE_KWARGS)


# ---- the scheduler on a fake KV config ----------------------------------------------------


def step(sched, token_id=7):
    out = sched.schedule()
    return out, sched.update_from_output(out, fake_runner(sched, out, token_id))


def end_turn(sched, request: Request) -> None:
    sched.add_request(request)
    while request.request_id in sched.requests:
        step(sched)
    assert sched.kept[request.request_id] is request
    assert request.status == RequestStatus.WAITING_FOR_INPUT


def next_turn(session: Request, new_token_ids: list[int], max_tokens: int = 4) -> Request:
    """The next turn over the session's whole history, as `LLMEngine` makes it."""
    prompt = session.all_token_ids + new_token_ids
    params = SamplingParams(max_tokens=max_tokens)
    return Request(session.request_id, prompt, params, eos_token_id=EOS, resumable=True)


def assert_scheduler_pool_free(sched) -> None:
    assert sched.kv_cache_manager.get_num_blocks_in_use() == 0
    assert all(b.ref_cnt == 0 for b in sched.kv_cache_manager.block_pool.blocks)


def session(req_id: str, num_prompt: int, base: int) -> Request:
    request = make_request(req_id, num_prompt, base=base)
    request.resumable = True
    return request


def test_waiting_sessions_are_evicted_first_the_longest_idle_first():
    """A running request short of blocks takes those of the sessions, oldest first, before
    anyone is preempted; the evicted session's next turn recomputes its history."""
    sched = make_scheduler(num_blocks=16, block_size=4, budget=64)
    first, second = session("first", 20, base=10), session("second", 20, base=100)
    end_turn(sched, first)
    end_turn(sched, second)
    assert sched.kv_cache_manager.get_num_blocks_in_use() == 12  # 24 tokens, 23 computed
    sched.add_request(make_request("big", 30, max_tokens=4, base=200))
    step(sched)
    assert first.num_computed_tokens == 0 and not sched.kv_cache_manager.get_block_ids("first")
    assert second.num_computed_tokens == 23
    assert sched.num_preemptions == 0
    while sched.requests:
        step(sched)
    turn = next_turn(first, [60, 61])
    sched.add_request(turn)
    assert turn.num_computed_tokens == 0  # its KV is gone: recomputed (prefix cache aside)
    before = sched.num_prefill_tokens
    while sched.requests:
        step(sched)
    assert sched.num_prefill_tokens - before == turn.num_prompt_tokens - turn.num_cached_tokens
    sched.finish_requests(list(sched.kept), RequestStatus.FINISHED_ABORTED)
    assert_scheduler_pool_free(sched)


def test_a_turn_computes_only_its_new_tokens_and_the_last_sampled_one():
    sched = make_scheduler(block_size=4)
    first = session("s", 10, base=10)
    end_turn(sched, first)
    assert first.num_computed_tokens == first.num_tokens - 1 == 13
    turn = next_turn(first, [60, 61, 62])
    sched.add_request(turn)
    assert turn.num_computed_tokens == 13
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"s": 4}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 13  # a new request to the runner
    assert out.finished_req_ids == {"s"}  # the runner forgets the turn before
    sched.finish_requests(["s"], RequestStatus.FINISHED_ABORTED)
    assert_scheduler_pool_free(sched)


@pytest.mark.parametrize("caching", [True, False])
def test_a_history_that_differs_keeps_only_the_blocks_of_the_common_prefix(caching):
    """A history cut short of what the session computed (a stop string inside accepted
    drafts) keeps the KV of the tokens both share: a block shared through the prefix cache is
    never written into, the session's own partly kept block is."""
    sched = make_scheduler(block_size=4, prefix_caching=caching)
    first = session("s", 10, base=10)
    end_turn(sched, first)  # 14 tokens, 13 computed, blocks 0-2 full
    cut = Request("s", [*first.all_token_ids[:10], 60, 61], SamplingParams(max_tokens=4), EOS)
    sched.add_request(cut)
    # Block 2 (tokens 8-11) is full and cached: dropped with caching, kept without.
    assert cut.num_computed_tokens == (8 if caching else 10)
    assert len(sched.kv_cache_manager.get_block_ids("s")) == (2 if caching else 3)
    while sched.requests:
        step(sched)
    assert_scheduler_pool_free(sched)


def test_idle_sessions_time_out_in_the_order_they_began_waiting():
    sched = make_scheduler(block_size=4)
    old, new = session("old", 8, base=10), session("new", 8, base=100)
    end_turn(sched, old)
    end_turn(sched, new)
    assert sched.close_idle_sessions() == []  # the timeout is 300 s
    old.waiting_since -= 400
    assert sched.close_idle_sessions() == ["old"]
    new.waiting_since -= 400
    assert sched.close_idle_sessions() == ["new"]
    assert_scheduler_pool_free(sched)


def test_sessions_and_beam_parents_share_one_kept_set():
    """A beam's parent (`keep_blocks`) and a session both keep their blocks in `kept`: under
    KV pressure the one kept longest goes first, whichever kind; the idle timeout closes
    sessions only; a session's id is not a beam parent to fork from, nor the reverse."""
    sched = make_scheduler(num_blocks=16, block_size=4, budget=64)
    parent = make_request("parent", 20, base=10)
    parent.keep_blocks = True
    sched.add_request(parent)
    while "parent" in sched.requests:
        step(sched)
    first = session("first", 20, base=100)
    end_turn(sched, first)
    assert list(sched.kept) == ["parent", "first"]
    parent.waiting_since = first.waiting_since = time.monotonic() - 400
    assert sched.close_idle_sessions() == ["first"]  # the parent is no session
    end_turn(sched, session("second", 20, base=300))
    with pytest.raises(ValueError, match="not a finished request keeping its blocks"):
        sched.fork_request("second", make_request("child", 25, base=300))
    sched.add_request(make_request("big", 30, max_tokens=4, base=200))
    step(sched)
    assert parent.num_computed_tokens == 0 and not sched.kv_cache_manager.get_block_ids("parent")
    assert sched.kept["second"].num_computed_tokens == 23  # kept later: not needed
    while sched.requests:
        step(sched)
    sched.release_blocks(["parent"])
    sched.finish_requests(["second"], RequestStatus.FINISHED_ABORTED)
    assert sched.kept == {}
    assert_scheduler_pool_free(sched)
