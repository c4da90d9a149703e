"""The v1 scheduler on a fake KV config: no model, a fake runner that samples token 7."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, SchedulerConfig
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.request import Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler

EOS = 2


def make_scheduler(
    num_blocks=64,
    block_size=4,
    budget=32,
    max_num_seqs=8,
    prefix_caching=True,
    threshold=0,
    policy="fcfs",
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=min(256, num_blocks * block_size),
            long_prefill_token_threshold=threshold,
            policy=policy,
        ),
        CacheConfig(
            block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching
        ),
    )


def make_request(
    req_id: str, num_prompt: int, max_tokens: int = 4, base: int = 10, priority: int = 0
) -> Request:
    prompt = [base + (i % 50) for i in range(num_prompt)]
    return Request(
        req_id, prompt, SamplingParams(max_tokens=max_tokens), eos_token_id=EOS, priority=priority
    )


def fake_runner(sched: Scheduler, out: SchedulerOutput, token_id: int = 7) -> ModelRunnerOutput:
    """Samples `token_id` for every request whose computed tokens reach its known tokens."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = sched.requests[req_id]
        sampled.append([token_id] if request.num_computed_tokens == request.num_tokens else [])
    return ModelRunnerOutput(req_ids, sampled, [[] for _ in req_ids])


def preempted(sched: Scheduler) -> set[str]:
    """Requests preempted and not yet scheduled again."""
    return {r.request_id for r in sched.waiting if r.status == RequestStatus.PREEMPTED}


def step(sched: Scheduler) -> tuple[SchedulerOutput, list]:
    out = sched.schedule()
    check_invariants(sched, out)
    return out, sched.update_from_output(out, fake_runner(sched, out))


def check_invariants(sched: Scheduler, out: SchedulerOutput) -> None:
    assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    assert len(sched.running) <= sched.config.max_num_seqs
    kv = sched.kv_cache_manager
    bs = kv.block_size
    refs = {}
    for request in sched.running:
        block_ids = kv.get_block_ids(request.request_id)
        # On-demand allocation: only the last block may hold unused slots.
        assert len(block_ids) == -(-request.num_computed_tokens // bs)
        for block_id in block_ids:
            refs[block_id] = refs.get(block_id, 0) + 1
    for request in sched.waiting:
        assert kv.get_block_ids(request.request_id) == []
    for block in kv.block_pool.blocks:
        assert block.ref_cnt == refs.get(block.block_id, 0) >= 0
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks - len(refs)


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        step(sched)
    assert not sched.has_unfinished_requests()
    assert (
        sched.kv_cache_manager.block_pool.get_num_free_blocks()
        == sched.kv_cache_manager.block_pool.num_blocks
    )


def test_continuous_batching_and_chunked_prefill():
    sched = make_scheduler(budget=16)
    sched.add_request(make_request("a", 40))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 16}
    assert len(out.scheduled_new_reqs) == 1
    sched.add_request(make_request("b", 5, base=70))
    out, _ = step(sched)  # a's second chunk takes the whole budget: running first
    assert out.num_scheduled_tokens == {"a": 16}
    out, outputs = step(sched)  # a's last 8 prompt tokens, then b's prompt shares the budget
    assert out.num_scheduled_tokens == {"a": 8, "b": 5}
    assert {o.request_id for o in outputs} == {"a", "b"}
    out, _ = step(sched)  # both decode one token each
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert out.scheduled_cached_reqs.req_ids == ["a", "b"]
    run_to_completion(sched)


def test_long_prefill_threshold_lets_decodes_through():
    sched = make_scheduler(budget=32, threshold=8)
    sched.add_request(make_request("a", 3))
    step(sched)
    sched.add_request(make_request("b", 40))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 8}
    run_to_completion(sched)


def test_max_num_seqs_bounds_the_batch():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 3))
    out, _ = step(sched)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    run_to_completion(sched)


def test_preempts_most_recently_admitted_and_recomputes():
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, max_num_seqs=8)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 8, max_tokens=12, base=10 + 60 * i))
    out, _ = step(sched)  # 3 x 2 blocks = all 6 blocks
    assert len(out.num_scheduled_tokens) == 3
    out, _ = step(sched)  # each needs a 3rd block: r2 (last admitted) is preempted for r0
    assert preempted(sched) == {"r2"} or preempted(sched) == {"r2", "r1"}
    assert "r2" in preempted(sched) and "r0" in out.num_scheduled_tokens
    assert sched.waiting[0].request_id == "r2"
    assert sched.waiting[0].status == RequestStatus.PREEMPTED
    assert sched.waiting[0].num_computed_tokens == 0
    assert sched.num_preemptions >= 1
    run_to_completion(sched)


def test_resumed_request_is_sent_with_its_whole_block_table():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64, prefix_caching=False)
    sched.add_request(make_request("a", 4, max_tokens=8))
    sched.add_request(make_request("b", 4, max_tokens=8, base=70))
    step(sched)
    step(sched)  # each needs a 2nd block: 4 blocks, fine
    for _ in range(4):
        out, _ = step(sched)
        if preempted(sched):
            break
    assert preempted(sched) == {"b"}
    while True:
        out, _ = step(sched)
        cached = out.scheduled_cached_reqs
        if "b" in cached.req_ids:
            i = cached.req_ids.index("b")
            assert cached.resumed_from_preemption[i]
            assert cached.new_block_ids[i] == sched.kv_cache_manager.get_block_ids("b")
            # Recompute covers the prompt and every token sampled before preemption.
            b = sched.requests["b"]
            assert out.num_scheduled_tokens["b"] == b.num_computed_tokens == b.num_tokens - 1
            break
    run_to_completion(sched)


def test_prefix_hit_is_skipped_by_the_scheduler():
    sched = make_scheduler(budget=64)
    sched.add_request(make_request("a", 20))
    step(sched)
    sched.add_request(make_request("b", 20))
    out, _ = step(sched)
    assert out.num_scheduled_tokens["b"] == 4  # 16 of 20 from the cache (4 full blocks)
    (new_b,) = out.scheduled_new_reqs
    assert new_b.num_computed_tokens == 16
    assert new_b.block_ids[:4] == sched.kv_cache_manager.get_block_ids("a")[:4]
    stats = sched.make_stats()
    assert stats.prefix_cache_hits == 16 and stats.prefix_cache_queries == 40
    run_to_completion(sched)


def test_stops_eos_stop_token_max_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("len", 3, max_tokens=2))
    req = Request("stop_id", [5, 6], SamplingParams(max_tokens=9, stop_token_ids=[7]), EOS)
    sched.add_request(req)
    _, outputs = step(sched)
    by_id = {o.request_id: o for o in outputs}
    assert by_id["stop_id"].finish_reason == "stop" and by_id["stop_id"].stop_reason == 7
    assert by_id["len"].finish_reason is None
    _, outputs = step(sched)
    assert outputs[0].finish_reason == "length"
    eos_req = Request("eos", [5, 6], SamplingParams(max_tokens=9, min_tokens=2), EOS)
    sched.add_request(eos_req)
    outs = [step_with_token(sched, EOS) for _ in range(2)]
    assert outs[0][0].finish_reason is None  # min_tokens keeps EOS from stopping
    assert outs[1][0].finish_reason == "stop"
    assert not sched.has_unfinished_requests()


def step_with_token(sched: Scheduler, token_id: int):
    out = sched.schedule()
    return sched.update_from_output(out, fake_runner(sched, out, token_id))


def test_abort_frees():
    sched = make_scheduler()
    sched.add_request(make_request("a", 10))
    step(sched)
    sched.add_request(make_request("b", 10))
    assert sched.finish_requests(["a", "b", "nope"], RequestStatus.FINISHED_ABORTED) == ["a", "b"]
    out = sched.schedule()
    assert out.finished_req_ids == {"a", "b"}
    assert sched.kv_cache_manager.get_num_blocks_in_use() == 0


def test_duplicate_live_request_id_is_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("a", 3))
    try:
        sched.add_request(make_request("a", 3))
    except ValueError as e:
        assert "already running" in str(e)
    else:
        raise AssertionError("duplicate accepted")
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    ops=ops,
    num_blocks=st.integers(12, 40),
    budget=st.integers(1, 48),
    max_num_seqs=st.integers(1, 6),
    prefix_caching=st.booleans(),
    threshold=st.integers(0, 10),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_random_operations_keep_invariants(
    ops, num_blocks, budget, max_num_seqs, prefix_caching, threshold, policy
):
    """`step` checks the KV invariants; under priority both queues stay in (priority,
    arrival) order; every request ends."""
    sched = make_scheduler(
        num_blocks, 4, budget, max_num_seqs, prefix_caching, threshold, policy=policy
    )
    added = []
    for op in ops:
        if op[0] == "add":
            # Few distinct bases so prompts share prefixes and hit the cache.
            priority = op[3] - 1 if policy == "priority" else 0
            req = make_request(
                f"r{len(added)}", op[1], op[2], base=10 + 100 * op[3], priority=priority
            )
            sched.add_request(req)
            added.append(req.request_id)
        elif op[0] == "abort" and added:
            sched.finish_requests([added[op[1] % len(added)]], RequestStatus.FINISHED_ABORTED)
        elif op[0] == "step":
            for _ in range(op[1]):
                step(sched)
                if policy == "priority":
                    for queue in (sched.running, sched.waiting):
                        keys = [(r.priority, r.arrival_order) for r in queue]
                        assert keys == sorted(keys)
    run_to_completion(sched)
