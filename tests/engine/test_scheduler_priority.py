"""The "priority" scheduling policy on a fake KV config: admission by (priority, arrival),
first come first served among equals, preemption of the lowest priority then the latest
(for KV room, and for a seat when a request outranks everyone holding one)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from tests.engine.test_scheduler import (
    make_request,
    make_scheduler,
    preempted,
    run_to_completion,
    step,
)


def admission_order(sched) -> list[str]:
    """Run to the end, returning the request ids in the order they were first scheduled."""
    order = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        order += [r.req_id for r in out.scheduled_new_reqs]
    run_to_completion(sched)  # and the pool is whole again
    return order


def test_the_lowest_priority_value_is_admitted_first():
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    for req_id, priority in [("p2", 2), ("p0", 0), ("p1", 1), ("n1", -1)]:
        sched.add_request(make_request(req_id, 5, priority=priority))
    assert admission_order(sched) == ["n1", "p0", "p1", "p2"]


def test_equal_priorities_are_served_first_come_first_served():
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    sched.add_request(make_request("a", 5, priority=1))
    sched.add_request(make_request("b", 5, priority=1))
    out, _ = step(sched)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a"]
    # Later arrivals of the same priority queue behind the earlier ones, a higher one ahead.
    sched.add_request(make_request("c", 5, priority=1))
    sched.add_request(make_request("urgent", 5, priority=0))
    assert [r.request_id for r in sched.waiting] == ["urgent", "b", "c"]
    assert admission_order(sched) == ["urgent", "b", "c"]


def test_fcfs_ignores_priority_values():
    sched = make_scheduler(max_num_seqs=1)
    for req_id, priority in [("p2", 2), ("p0", 0), ("p1", 1)]:
        sched.add_request(make_request(req_id, 5, priority=priority))
    assert admission_order(sched) == ["p2", "p0", "p1"]


def fill_the_pool(policy: str):
    """Six blocks of 4 tokens, three requests of 7-token prompts (2 blocks each): r0 and r1
    (priority 1) run first, then r2 (priority 0) arrives and fills the pool. At the next
    decode r0 needs a third block, so someone is preempted."""
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, policy=policy)
    sched.add_request(make_request("r0", 7, max_tokens=8, priority=1))
    sched.add_request(make_request("r1", 7, max_tokens=8, base=70, priority=1))
    step(sched)
    sched.add_request(make_request("r2", 7, max_tokens=8, base=130, priority=0))
    out, _ = step(sched)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["r2"]
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    return sched


def test_preemption_takes_the_lowest_priority_then_the_latest():
    sched = fill_the_pool("priority")
    assert [r.request_id for r in sched.running] == ["r2", "r0", "r1"]
    out, _ = step(sched)
    # r0 and r1 share the lowest priority; r1 arrived later.
    assert preempted(sched) == {"r1"} and set(out.num_scheduled_tokens) == {"r2", "r0"}
    # It keeps its arrival: a later request of its priority waits behind it, a higher ahead.
    sched.add_request(make_request("r3", 3, priority=1))
    sched.add_request(make_request("r4", 3, priority=0))
    assert [r.request_id for r in sched.waiting] == ["r4", "r1", "r3"]
    run_to_completion(sched)


def test_fcfs_preempts_the_last_admitted_as_before():
    sched = fill_the_pool("fcfs")
    step(sched)
    assert preempted(sched) == {"r2"}
    run_to_completion(sched)


def test_a_lone_lowest_priority_request_preempts_itself():
    """Priority 1 alone among 0s: the one short of a block is the one to go."""
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, policy="priority")
    sched.add_request(make_request("low", 7, max_tokens=8, priority=1))
    step(sched)
    sched.add_request(make_request("a", 7, max_tokens=8, base=70))
    sched.add_request(make_request("b", 7, max_tokens=8, base=130))
    step(sched)
    out, _ = step(sched)
    assert preempted(sched) == {"low"} and set(out.num_scheduled_tokens) == {"a", "b"}
    run_to_completion(sched)


def test_a_higher_priority_takes_the_seat_of_the_lowest_then_latest():
    sched = make_scheduler(max_num_seqs=3, budget=64, policy="priority")
    for req_id, priority in [("low-a", 2), ("low-b", 2), ("mid", 1)]:
        sched.add_request(make_request(req_id, 5, max_tokens=6, priority=priority))
    step(sched)  # mid's prompt, alone
    step(sched)  # then the low ones' (mid decodes)
    assert [r.request_id for r in sched.running] == ["mid", "low-a", "low-b"]
    sched.add_request(make_request("urgent", 5, max_tokens=2, base=70, priority=0))
    out, _ = step(sched)
    # low-a and low-b share the lowest priority; low-b arrived later. It gave its seat and
    # its blocks: nothing of it is scheduled in the step that admits the urgent one.
    assert preempted(sched) == {"low-b"}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["urgent"]
    assert set(out.num_scheduled_tokens) == {"urgent", "mid", "low-a"}
    assert sched.kv_cache_manager.get_block_ids("low-b") == []
    # Once the urgent one is done, low-b takes its seat back and finishes.
    finished = set()
    while sched.has_unfinished_requests():
        _, outputs = step(sched)
        finished |= {o.request_id for o in outputs if o.finish_reason is not None}
    assert finished == {"urgent", "mid", "low-a", "low-b"}
    run_to_completion(sched)


@pytest.mark.parametrize("newcomer_priority", [1, 2])
def test_equal_or_lower_priorities_wait_for_a_seat(newcomer_priority):
    sched = make_scheduler(max_num_seqs=2, budget=64, policy="priority")
    for req_id in ("a", "b"):
        sched.add_request(make_request(req_id, 5, max_tokens=6, priority=1))
    step(sched)
    sched.add_request(make_request("c", 5, base=70, priority=newcomer_priority))
    out, _ = step(sched)
    assert preempted(sched) == set() and set(out.num_scheduled_tokens) == {"a", "b"}
    assert [r.request_id for r in sched.waiting] == ["c"]
    run_to_completion(sched)


def test_each_outranking_arrival_takes_one_seat():
    """Three urgent arrivals, one free seat: two of the three low ones go, the latest first."""
    sched = make_scheduler(max_num_seqs=4, budget=64, policy="priority")
    for i in range(3):
        sched.add_request(make_request(f"low-{i}", 5, max_tokens=8, base=10 + i, priority=1))
    step(sched)
    for i in range(3):
        sched.add_request(make_request(f"urgent-{i}", 5, max_tokens=2, base=70 + i, priority=0))
    out, _ = step(sched)
    assert preempted(sched) == {"low-1", "low-2"}
    assert {r.req_id for r in out.scheduled_new_reqs} == {"urgent-0", "urgent-1", "urgent-2"}
    run_to_completion(sched)


def test_a_higher_prefill_step_carries_only_the_decodes_of_lower_priorities():
    """low-a decodes and low-b is partway through its prompt (chunked by the budget) when
    an urgent request arrives with a seat free: the urgent prompt's step runs low-a's decode
    but none of low-b's prompt, which resumes once the urgent one decodes. Equal priorities
    compute their prompts in one step."""
    sched = make_scheduler(max_num_seqs=4, budget=12, policy="priority")
    sched.add_request(make_request("low-a", 5, max_tokens=8, priority=1))
    sched.add_request(make_request("low-b", 20, max_tokens=4, base=30, priority=1))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"low-a": 5, "low-b": 7}
    sched.add_request(make_request("urgent", 6, max_tokens=3, base=70, priority=0))
    sched.add_request(make_request("urgent-2", 4, max_tokens=3, base=90, priority=0))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"urgent": 6, "urgent-2": 4, "low-a": 1}
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"urgent": 1, "urgent-2": 1, "low-a": 1, "low-b": 9}
    assert preempted(sched) == set()
    run_to_completion(sched)


def test_a_higher_prompt_that_cannot_get_its_blocks_holds_nothing_back():
    """Four blocks of 4 tokens: low's prompt (14 tokens, budget 12) holds three after its
    first chunk. An urgent prompt whose first chunk needs three more cannot be admitted, so
    low's prompt goes on (it would otherwise wait for the urgent one, which waits for low's
    blocks: no step would schedule anything); the urgent one runs once low is done."""
    sched = make_scheduler(num_blocks=4, block_size=4, budget=12, policy="priority")
    sched.add_request(make_request("low", 14, max_tokens=2, priority=1))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"low": 12}
    sched.add_request(make_request("urgent", 14, max_tokens=2, base=70, priority=0))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"low": 2}
    assert admission_order(sched) == ["urgent"]


def test_fcfs_never_preempts_for_a_seat():
    sched = make_scheduler(max_num_seqs=1, budget=64)
    sched.add_request(make_request("a", 5, max_tokens=6, priority=5))
    step(sched)
    sched.add_request(make_request("b", 5, base=70, priority=-5))
    out, _ = step(sched)
    assert preempted(sched) == set() and set(out.num_scheduled_tokens) == {"a"}
    run_to_completion(sched)


@pytest.mark.parametrize("policy", ["lifo", "FCFS", None])
def test_an_unknown_policy_is_refused_naming_the_supported_ones(policy):
    with pytest.raises(
        ValueError, match=r"scheduling_policy must be one of \('fcfs', 'priority'\)"
    ):
        EngineConfig(scheduling_policy=policy)
