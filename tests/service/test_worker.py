"""`service.worker.Worker` against a real Redis and a tiny random-weight model.

Producers here are raw Redis commands (XADD of schema messages), so the worker is tested on the
wire contract alone. Every test ends with the engine's KV pool fully free.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time

import msgpack
import pytest

from engine import LLM, LLMEngine, SamplingParams
from queueing import streams
from queueing.schema import Abort, GenerateRequest, TokenChunk, WorkerInfo, keys
from service import metrics
from service.engine_thread import load_engine
from service.worker import Worker
from tests.service.conftest import ENGINE_KWARGS

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

PROMPT = "The quick brown fox jumps over the lazy dog."
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(model_dir):
    """Offline generation with the same model: what the worker must reproduce."""
    llm = LLM(model=model_dir, **ENGINE_KWARGS)

    def generate(prompt, max_tokens):
        [out] = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))
        return out.outputs[0].token_ids, out.outputs[0].text

    generate.llm = llm
    return generate


@contextlib.asynccontextmanager
async def serving(engine, redis_url, name="w1", grace_s=5.0, **kwargs):
    """Run a Worker for the duration of the block, from its first heartbeat on (before it
    the API answers "no worker": a race that failed a test on a slow machine); on exit stop
    it and check the KV pool."""
    worker = Worker(engine, redis_url, name, read_block_ms=200, **kwargs)
    task = asyncio.create_task(worker.run())
    try:
        r = streams.connect(redis_url)
        deadline = time.monotonic() + 10
        while not (task.done() or await r.exists(keys.worker(name))):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        await r.aclose()
        yield worker
    finally:
        worker.stop(grace_s)
        await asyncio.wait_for(task, 15)
    assert worker.engine_thread.stats.num_blocks_in_use == 0
    assert not engine.has_unfinished_requests()


def hold_steps(engine, monkeypatch, request_ids, free_steps=0, release=None):
    """After `free_steps` steps with one of `request_ids` (None: any request) in the engine,
    steps make no progress while one is there (until `release` is set): only a deadline or an
    abort ends them, however fast or loaded the machine (timing generation with sleeps failed
    on a fast machine: issue 12)."""
    real_step, held = engine.engine_core.step, [0]

    def holding() -> bool:
        if request_ids is None:
            return engine.has_unfinished_requests()
        return any(engine.get_unfinished_request(r) for r in request_ids)

    def step():
        if holding() and not (release is not None and release.is_set()):
            held[0] += 1
            if held[0] > free_steps:
                time.sleep(0.005)
                return []
        return real_step()

    monkeypatch.setattr(engine.engine_core, "step", step)


def step_together(engine, monkeypatch, request_ids):
    """Steps make no progress until every one of `request_ids` is in the engine, so they share
    their first step whatever the order and pace of their arrival."""
    real_step, together = engine.engine_core.step, threading.Event()

    def step():
        if not together.is_set():
            if not all(engine.get_unfinished_request(r) for r in request_ids):
                time.sleep(0.005)
                return []
            together.set()
        return real_step()

    monkeypatch.setattr(engine.engine_core, "step", step)


async def submit(r, request: GenerateRequest) -> str:
    return (await r.xadd(keys.requests, {"data": request.encode()})).decode()


async def read_chunks(r, request_id: str, timeout: float = 20.0, until_last=True) -> list:
    """Chunks of a response stream, waiting until the final one (or the first one)."""
    key, last_id, chunks = keys.response(request_id), "0-0", []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for _, entries in await r.xread({key: last_id}, block=100) or []:
            for entry_id, fields in entries:
                last_id = entry_id
                chunks.append(TokenChunk.decode(fields[b"data"]))
        if chunks and (chunks[-1].is_last or not until_last):
            return chunks
    raise AssertionError(f"no final chunk for {request_id} in {timeout} s: {chunks}")


def joined(chunks: list[TokenChunk], index: int = 0) -> tuple[list[int], str]:
    mine = [c for c in chunks if c.index == index]
    return [t for c in mine for t in c.token_ids], "".join(c.text for c in mine)


async def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def num_pending(r) -> int:
    return (await r.xpending(keys.requests, keys.group))["pending"]


def sample(name: str, model_name: str, **labels: str) -> float:
    """An engine metric's value for the model served as `model_name` (0 until it is set)."""
    return metrics.REGISTRY.get_sample_value(name, {"model_name": model_name, **labels}) or 0.0


async def test_generates_like_offline(engine, reference, redis, redis_url):
    tokens, text = reference(PROMPT, 24)
    async with serving(engine, redis_url) as worker:
        generated = sample("kvrail:generation_tokens_total", worker.model_name)
        await submit(
            redis, GenerateRequest("r1", prompt=PROMPT, sampling=dict(max_tokens=24, **GREEDY))
        )
        sampling = dict(max_tokens=8, n=2, logprobs=2, **GREEDY)
        await submit(redis, GenerateRequest("r2", prompt=PROMPT, sampling=sampling))
        chunks = await read_chunks(redis, "r1")
        chunks2 = await read_chunks(redis, "r2")
        info = WorkerInfo.decode(await redis.get(keys.worker(worker.name)))
        assert info.max_model_len == 512
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert joined(chunks) == (tokens, text)
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage["completion_tokens"] == 24
    assert [c.seq for c in chunks2] == list(range(len(chunks2)))
    for index in (0, 1):
        assert joined(chunks2, index)[0] == tokens[:8]
        logprobs = [lp for c in chunks2 if c.index == index for lp in c.logprobs]
        assert len(logprobs) == 8 and all(
            entry[0][0] == t for entry, t in zip(logprobs, tokens[:8], strict=True)
        )
    assert chunks2[-1].usage["completion_tokens"] == 16
    assert await num_pending(redis) == 0
    # Answered entries leave the request stream (issue 12: every prompt was kept forever).
    assert await redis.xlen(keys.requests) == 0
    assert await redis.hget(keys.request_state("r1"), "state") == b"done"
    assert sample("kvrail:generation_tokens_total", worker.model_name) == generated + 40


async def test_engine_metrics_are_labelled_with_the_served_model(engine, redis, redis_url):
    """As vLLM's: every engine metric carries `model_name`, the name the model is served
    under; the HTTP metrics carry none."""
    request = GenerateRequest(
        "m1", prompt_token_ids=list(range(2000, 2010)), sampling=dict(max_tokens=4, **GREEDY)
    )
    async with serving(engine, redis_url, model_name="served-name") as worker:
        await submit(redis, request)
        await read_chunks(redis, "m1")
        await asyncio.sleep(worker.tick_s * 2)  # the heartbeat tick moves counters to metrics
        model = "served-name"
        assert sample("kvrail:prompt_tokens_total", model) == 10
        assert sample("kvrail:generation_tokens_total", model) == 4
        assert sample("kvrail:request_success_total", model, finished_reason="length") == 1
        assert sample("kvrail:request_queue_time_seconds_count", model) == 1
        assert sample("kvrail:time_to_first_token_seconds_count", model) == 1
        assert sample("kvrail:inter_token_latency_seconds_count", model) == 3
        assert sample("kvrail:e2e_request_latency_seconds_count", model) == 1
        assert sample("kvrail:prefix_cache_queries_total", model) >= 10
        for name in (  # set, if to 0
            "num_requests_running",
            "num_requests_waiting",
            "kv_cache_usage_perc",
            "num_preemptions_total",
            "prefix_cache_hits_total",
            "spec_decode_num_drafts_total",
        ):
            labels = {"model_name": model}
            assert metrics.REGISTRY.get_sample_value(f"kvrail:{name}", labels) is not None, name
        for family in metrics.REGISTRY.collect():
            engine_side = not family.name.startswith("kvrail:http_")
            for s in family.samples:
                assert ("model_name" in s.labels) == engine_side, s


async def test_usage_counts_the_prompt_tokens_found_in_the_prefix_cache(engine, redis, redis_url):
    """For OpenAI's `prompt_tokens_details.cached_tokens`: the last chunk's usage counts the
    prompt tokens served from the prefix cache, the full 16-token blocks of a prompt seen
    before."""
    prompt = dict(prompt_token_ids=list(range(1000, 1040)))  # 2 blocks + 8, in no other test
    sampling = dict(max_tokens=2, **GREEDY)
    usage = []
    async with serving(engine, redis_url):
        for request_id in ("cached-1", "cached-2"):
            await submit(redis, GenerateRequest(request_id, **prompt, sampling=sampling))
            usage.append((await read_chunks(redis, request_id))[-1].usage)
    assert [u["prompt_tokens"] for u in usage] == [40, 40]
    assert [u["cached_tokens"] for u in usage] == [0, 32]


async def test_duplicate_request_id_is_generated_once(engine, redis, redis_url):
    request = GenerateRequest("dup", prompt=PROMPT, sampling=dict(max_tokens=16, **GREEDY))
    await submit(redis, request)
    await submit(redis, request)
    async with serving(engine, redis_url) as worker:
        chunks = await read_chunks(redis, "dup")
        await asyncio.sleep(0.3)  # give a second generation the chance to show up
        assert worker.engine_thread.num_added == 1  # the engine saw one request
    stored = await streams.read_response(redis, keys.response("dup"))
    assert [c.seq for c in stored] == list(range(len(chunks))) and stored[-1].is_last
    assert await num_pending(redis) == 0 and await redis.xlen(keys.requests) == 0


async def test_resumes_the_entry_of_a_dead_worker(engine, reference, redis, redis_url):
    tokens, text = reference(PROMPT, 30)
    request = GenerateRequest("res", prompt=PROMPT, sampling=dict(max_tokens=30, **GREEDY))
    entry_id = await submit(redis, request)
    # A worker that read the entry, published a few steps' deltas, then died.
    await streams.ensure_group(redis)
    dead = streams.RequestConsumer(redis, redis, "dead")
    assert [e.entry_id for e in await dead.read()] == [entry_id]
    assert await streams.own_request(redis, "res", entry_id, 60) == (entry_id, False)
    offline = reference.llm.llm_engine
    offline.add_request("res", PROMPT, SamplingParams(max_tokens=30, **GREEDY))
    partial = []
    while len(partial) < 5:
        for out in offline.step():
            c = out.outputs[0]
            partial.append(TokenChunk("res", len(partial), token_ids=c.token_ids, text=c.text))
    offline.abort_request("res")
    await streams.ResponsePublisher(redis, 60).publish((keys.response("res"), c) for c in partial)
    async with serving(engine, redis_url, claim_idle_ms=500):
        chunks = await read_chunks(redis, "res")
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert joined(chunks) == (tokens, text)
    assert chunks[-1].usage["completion_tokens"] == 30
    assert await num_pending(redis) == 0


async def test_resumes_a_structured_request_of_a_dead_worker(engine, reference, redis, redis_url):
    """The structured_outputs map travels on the wire; the worker that takes the entry over
    rebuilds the grammar's matcher from the tokens already emitted: the text is the one a
    single run gives and matches the regex (a fresh matcher would start the date over)."""
    date = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    sampling = dict(max_tokens=30, structured_outputs={"regex": date}, temperature=0.0)
    [full] = reference.llm.generate(PROMPT, SamplingParams(**sampling))
    tokens, text = full.outputs[0].token_ids, full.outputs[0].text
    assert re.fullmatch(date, text)
    entry_id = await submit(redis, GenerateRequest("so", prompt=PROMPT, sampling=sampling))
    await streams.ensure_group(redis)
    dead = streams.RequestConsumer(redis, redis, "dead")
    assert [e.entry_id for e in await dead.read()] == [entry_id]
    assert await streams.own_request(redis, "so", entry_id, 60) == (entry_id, False)
    emitted = [TokenChunk("so", i, token_ids=[t], text=reference.llm.get_tokenizer().decode([t]))
               for i, t in enumerate(tokens[:5])]  # fmt: skip
    await streams.ResponsePublisher(redis, 60).publish((keys.response("so"), c) for c in emitted)
    async with serving(engine, redis_url, claim_idle_ms=500):
        chunks = await read_chunks(redis, "so")
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert joined(chunks) == (tokens, text)
    assert chunks[-1].finish_reason == "stop"
    assert await num_pending(redis) == 0


async def test_stop_leaves_unfinished_entries_pending_for_another_worker(
    engine, reference, redis, redis_url
):
    tokens, text = reference(PROMPT, 200)
    request = GenerateRequest("long", prompt=PROMPT, sampling=dict(max_tokens=200, **GREEDY))
    await submit(redis, request)
    async with serving(engine, redis_url, name="a", grace_s=0.0):
        await read_chunks(redis, "long", until_last=False)
    assert await redis.get(keys.worker("a")) is None
    pending = await redis.xpending_range(keys.requests, keys.group, "-", "+", 10)
    assert [p["consumer"] for p in pending] == [b"a"]
    before = await streams.read_response(redis, keys.response("long"))
    assert not before[-1].is_last
    async with serving(engine, redis_url, name="b", claim_idle_ms=500):
        chunks = await read_chunks(redis, "long")
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert joined(chunks) == (tokens, text)
    assert await num_pending(redis) == 0


async def test_abort_frees_kv_blocks(engine, redis, redis_url):
    request = GenerateRequest("ab", prompt=PROMPT, sampling=dict(max_tokens=400, **GREEDY))
    await submit(redis, request)
    async with serving(engine, redis_url) as worker:
        await read_chunks(redis, "ab", until_last=False)
        assert worker.engine_thread.stats.num_blocks_in_use > 0
        await redis.xadd(keys.control, {"data": Abort("ab").encode()})
        start = time.monotonic()
        chunks = await read_chunks(redis, "ab", timeout=1.0)
        while worker.engine_thread.stats.num_blocks_in_use and time.monotonic() - start < 1.0:
            await asyncio.sleep(0.01)
        assert worker.engine_thread.stats.num_blocks_in_use == 0
    assert chunks[-1].finish_reason == "abort"
    assert chunks[-1].usage["completion_tokens"] == sum(len(c.token_ids) for c in chunks) < 400
    assert await num_pending(redis) == 0


async def test_bad_entries_are_dead_lettered_and_the_worker_keeps_serving(engine, redis, redis_url):
    await redis.xadd(keys.requests, {"data": b"\xc1 not msgpack"})
    await redis.xadd(keys.requests, {"prompt": b"no data field"})  # issue 12: was acked, lost
    wrong_type = msgpack.packb({"v": 1, "request_id": "types", "prompt": 5})
    await redis.xadd(keys.requests, {"data": wrong_type})
    await submit(redis, GenerateRequest("oov", prompt_token_ids=[1, 10**7]))
    await submit(redis, GenerateRequest("temp", prompt=PROMPT, sampling={"temperature": -1.0}))
    past = int(time.time() * 1000) - 1000
    await submit(redis, GenerateRequest("late", prompt=PROMPT, deadline_ms=past))
    await redis.hset(keys.request_state("gone"), "aborted", 1)  # the client's abort came first
    await submit(redis, GenerateRequest("gone", prompt=PROMPT))
    await submit(redis, GenerateRequest("ok", prompt=PROMPT, sampling=dict(max_tokens=4, **GREEDY)))
    # Decoded off the event loop (over OFF_LOOP_DECODE_BYTES), then refused by length.
    await submit(redis, GenerateRequest("big", prompt="word " * 60_000))
    oversize = b"\xdd" + b"\x80" * (24 << 20)  # issue 12: 24 MiB of empty maps, not decoded
    await redis.xadd(keys.requests, {"data": oversize})
    async with serving(engine, redis_url):
        ok = await read_chunks(redis, "ok")
        errors = {
            rid: (await read_chunks(redis, rid))[-1]
            for rid in ("types", "oov", "temp", "late", "gone", "big")
        }
    assert ok[-1].usage["completion_tokens"] == 4
    assert all(c.finish_reason == "error" and c.seq == 0 for c in errors.values())
    assert "prompt" in errors["types"].error
    assert "vocab" in errors["oov"].error or "[0," in errors["oov"].error
    assert "temperature" in errors["temp"].error
    assert errors["late"].error == "deadline exceeded"
    assert errors["gone"].error == "aborted"
    assert "max_model_len" in errors["big"].error
    dead = await redis.xrange(keys.dead)
    assert len(dead) == 7  # late and aborted requests are answered, not bad entries
    assert "msgpack" in dead[0][1][b"reason"].decode()
    assert dead[1][1][b"reason"] == b"entry has no 'data' field"
    [too_large] = [fields for _, fields in dead if b"too large" in fields[b"reason"]]
    assert len(too_large[b"data"]) == streams.DEAD_LETTER_DATA_BYTES
    assert int(too_large[b"data_bytes"]) == len(oversize)
    assert await num_pending(redis) == 0


async def test_a_full_waiting_queue_is_overload_to_retry_not_a_dead_letter(
    model_dir, redis, redis_url, monkeypatch
):
    engine = LLMEngine.from_kwargs(model=model_dir, **{**ENGINE_KWARGS, "max_waiting_requests": 1})
    release = threading.Event()
    hold_steps(engine, monkeypatch, None, release=release)  # the first request stays waiting
    ids = [f"r{i}" for i in range(4)]
    for rid in ids:
        await submit(redis, GenerateRequest(rid, prompt=PROMPT, sampling=dict(max_tokens=2)))
    async with serving(engine, redis_url):
        refused = [(await read_chunks(redis, rid))[-1] for rid in ids[1:]]
        release.set()
        done = await read_chunks(redis, ids[0])
    assert done[-1].usage["completion_tokens"] == 2 and not done[-1].retry
    assert all(c.retry and c.error.endswith("; retry later") for c in refused), refused
    assert not any(c.invalid for c in refused)
    assert await redis.xrange(keys.dead) == []
    assert await num_pending(redis) == 0


async def test_requests_redis_lost_are_dropped_so_new_ones_are_served(
    engine, redis, redis_url, monkeypatch
):
    # Reliability scenario 2b on a loaded machine: after Redis restarted empty, a new request
    # waited over 30 s behind lost ones the worker went on generating for no reader.
    hold_steps(engine, monkeypatch, ["held"])  # never finishes by itself
    await submit(redis, GenerateRequest("held", prompt=PROMPT, sampling=dict(max_tokens=200)))
    async with serving(engine, redis_url) as worker:
        await until(lambda: engine.get_unfinished_request("held") is not None)
        await redis.flushall()  # Redis without its data, as after an empty restart
        await until(lambda: engine.get_unfinished_request("held") is None)
        assert "held" not in worker.inflight
        await submit(redis, GenerateRequest("after", prompt=PROMPT, sampling=dict(max_tokens=4)))
        after = await read_chunks(redis, "after")
    assert after[-1].usage["completion_tokens"] == 4


async def test_a_read_whose_reply_was_lost_is_served_without_waiting_for_a_claim(
    engine, redis, redis_url, lose_a_reply
):
    # Docs/reliability.md item 31: Redis stopped between running the worker's XREADGROUP and
    # writing its reply; the entry sat pending under the worker, read by no one, until a claim
    # (15 s idle), past its client's chunk timeout on a loaded machine.
    lose_a_reply("XREADGROUP")
    await submit(redis, GenerateRequest("lost", prompt=PROMPT, sampling=dict(max_tokens=4)))
    async with serving(engine, redis_url, claim_idle_ms=600_000):
        chunks = await read_chunks(redis, "lost")
    assert chunks and chunks[-1].usage["completion_tokens"] == 4
    assert await num_pending(redis) == 0


async def test_a_worker_holds_two_batches_and_leaves_the_rest_to_a_worker_with_room(
    model_dir, engine, redis, redis_url, monkeypatch
):
    # Docs/reliability.md item 31: a worker of 2 sequences read ~20 requests after a Redis
    # restart while the other worker idled, and the last waited past its client's timeout.
    busy = LLMEngine.from_kwargs(model=model_dir, **{**ENGINE_KWARGS, "max_num_seqs": 2})
    release = threading.Event()
    hold_steps(busy, monkeypatch, None, release=release)  # nothing it holds progresses
    ids = [f"r{i}" for i in range(10)]
    for rid in ids:
        await submit(redis, GenerateRequest(rid, prompt=PROMPT, sampling=dict(max_tokens=3)))
    async with serving(busy, redis_url, name="busy") as held:
        await until(lambda: len(held.inflight) == 4)  # 2 x max_num_seqs
        await asyncio.sleep(0.5)  # several reads' time: it takes no more
        assert sorted(held.inflight) == ids[:4]
        assert (await redis.xinfo_groups(keys.requests))[0]["lag"] == 6
        async with serving(engine, redis_url, name="free"):
            served = [await read_chunks(redis, rid) for rid in ids[4:]]
        assert sorted(held.inflight) == ids[:4]
        release.set()
        served += [await read_chunks(redis, rid) for rid in ids[:4]]
    assert [chunks[-1].usage["completion_tokens"] for chunks in served] == [3] * 10
    assert await num_pending(redis) == 0


async def test_priority_reaches_the_engine_which_refuses_it_under_fcfs(engine, redis, redis_url):
    """This engine schedules fcfs: priority 0 is served, another is the request's error (the
    engine's refusal, as vLLM's), dead-lettered as other requests the engine refuses."""
    params = dict(max_tokens=2, **GREEDY)
    await submit(redis, GenerateRequest("zero", prompt=PROMPT, sampling=params, priority=0))
    await submit(redis, GenerateRequest("urgent", prompt=PROMPT, sampling=params, priority=-1))
    async with serving(engine, redis_url):
        zero = await read_chunks(redis, "zero")
        (urgent,) = await read_chunks(redis, "urgent")
    assert zero[-1].usage["completion_tokens"] == 2
    assert urgent.finish_reason == "error" and urgent.invalid and not urgent.retry
    assert urgent.error == (
        "got priority -1 but priority scheduling is not enabled (scheduling_policy='priority')"
    )
    assert await num_pending(redis) == 0


async def test_engine_fault_and_running_deadline_fail_only_their_requests(
    engine, redis, redis_url, monkeypatch
):
    hold_steps(engine, monkeypatch, ["slow"], free_steps=3)  # its prompt and 2 tokens
    held_step, calls = engine.engine_core.step, [0]

    def step_failing_once():
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected fault")
        return held_step()

    monkeypatch.setattr(engine.engine_core, "step", step_failing_once)
    await submit(redis, GenerateRequest("fault", prompt=PROMPT))
    async with serving(engine, redis_url):
        fault = await read_chunks(redis, "fault")
        # Far enough ahead that admission never sees it passed, even on a loaded machine.
        deadline = int(time.time() * 1000) + 2000
        sampling = dict(max_tokens=400, **GREEDY)
        await submit(
            redis, GenerateRequest("slow", prompt=PROMPT, sampling=sampling, deadline_ms=deadline)
        )
        slow = await read_chunks(redis, "slow", timeout=10.0)
        await submit(
            redis, GenerateRequest("next", prompt=PROMPT, sampling=dict(max_tokens=4, **GREEDY))
        )
        after = await read_chunks(redis, "next")
    assert fault[-1].error == "engine error: injected fault"
    assert slow[-1].error == "deadline exceeded" and len(slow) > 1
    assert sum(len(c.token_ids) for c in slow) == 3  # its prompt step and 2 decode steps
    assert after[-1].usage["completion_tokens"] == 4
    [(_, dead)] = await redis.xrange(keys.dead)
    assert dead[b"reason"] == b"engine error: injected fault"
    assert await num_pending(redis) == 0


async def test_a_fault_tied_to_one_request_fails_it_alone_in_its_batch(
    engine, reference, redis, redis_url, monkeypatch
):
    """Issue 12: one request whose step raised (a seed past torch's range) failed the three
    unrelated requests of its batch with "engine error" and dead-lettered them. The engine
    now undoes the step and isolates the culprit: only it gets the error and a dead letter,
    the others finish with their normal tokens."""
    prompts = {"a": PROMPT, "b": "Once upon a time", "c": "The capital of Japan is"}
    step_together(engine, monkeypatch, [*prompts, "poison"])
    runner = engine.engine_core.model_runner
    real_prepare_inputs = runner._prepare_inputs

    def prepare_inputs(scheduler_output, req_ids):
        inputs = real_prepare_inputs(scheduler_output, req_ids)
        if "poison" in req_ids:
            raise RuntimeError("injected fault")
        return inputs

    monkeypatch.setattr(runner, "_prepare_inputs", prepare_inputs)
    sampling = dict(max_tokens=8, **GREEDY)
    for request_id, prompt in prompts.items():
        await submit(redis, GenerateRequest(request_id, prompt=prompt, sampling=sampling))
        if request_id == "a":
            await submit(redis, GenerateRequest("poison", prompt=PROMPT, sampling=sampling))
    async with serving(engine, redis_url):
        poison = await read_chunks(redis, "poison")
        served = {r: await read_chunks(redis, r) for r in prompts}
    for request_id, prompt in prompts.items():
        chunks = served[request_id]
        assert chunks[-1].finish_reason == "length" and chunks[-1].error is None
        assert joined(chunks) == reference(prompt, 8), request_id
    assert poison[-1].finish_reason == "error"
    assert poison[-1].error == "engine error: RuntimeError: injected fault"
    [(_, dead)] = await redis.xrange(keys.dead)
    assert dead[b"reason"] == b"engine error: RuntimeError: injected fault"
    assert await num_pending(redis) == 0


async def test_a_key_of_the_wrong_type_fails_only_its_own_request(engine, redis, redis_url):
    """Issue 12: a response key that is not a stream made the ingest loop restart on its
    entry forever (WRONGTYPE), and the good requests read with it got no answer."""
    await redis.set(keys.response("poison-x"), b"not a stream")
    await submit(redis, GenerateRequest("poison-x", prompt=PROMPT))
    good = dict(max_tokens=4, **GREEDY)
    await submit(redis, GenerateRequest("good", prompt=PROMPT, sampling=good))
    async with serving(engine, redis_url):
        chunks = await read_chunks(redis, "good")
        deadline = time.monotonic() + 10
        while not await redis.xlen(keys.dead) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    assert chunks[-1].usage["completion_tokens"] == 4
    [(_, dead)] = await redis.xrange(keys.dead)
    assert dead[b"reason"].startswith(b"redis error: WRONGTYPE")
    assert await num_pending(redis) == 0


async def test_an_entry_delivered_too_often_is_dead_lettered(
    engine, reference, redis, redis_url, monkeypatch
):
    """Issue 12: an entry that brought down whoever served it was claimed again and again
    (`times_delivered` 11 in 45 s), never dead-lettered. Past `KVRAIL_MAX_DELIVERIES` it is,
    with an error chunk after what its response stream holds; one at the limit is served, and
    delivered once by the worker that claims it (a worker that claimed entries at start, then
    read its own pending ones, delivered each claimed entry twice)."""
    tokens, text = reference(PROMPT, 4)
    sampling = dict(max_tokens=4, **GREEDY)
    crashy = await submit(redis, GenerateRequest("crashy", prompt=PROMPT, sampling=sampling))
    unlucky = await submit(redis, GenerateRequest("unlucky", prompt=PROMPT, sampling=sampling))
    # The last of the workers that held them published a token of "crashy", then died; the
    # delivery counts are set as if three (two) workers had read them, and their idle time
    # past the claim time (XCLAIM RETRYCOUNT, IDLE).
    await streams.ensure_group(redis)
    dead = streams.RequestConsumer(redis, redis, "dead")
    assert [e.entry_id for e in await dead.read()] == [crashy, unlucky]
    assert await streams.own_request(redis, "crashy", crashy, 60) == (crashy, False)
    partial = TokenChunk("crashy", 0, token_ids=tokens[:1])
    await streams.ResponsePublisher(redis, 60).publish([(keys.response("crashy"), partial)])
    for entry_id, count in ((crashy, 3), (unlucky, 2)):
        await redis.xclaim(
            keys.requests,
            keys.group,
            "dead",
            0,
            [entry_id],
            idle=60_000,
            retrycount=count,
            justid=True,
        )
    release = threading.Event()
    hold_steps(engine, monkeypatch, ["unlucky"], release=release)
    monkeypatch.setenv("KVRAIL_MAX_DELIVERIES", "3")
    async with serving(engine, redis_url, claim_idle_ms=500) as worker:
        crashy_chunks = await read_chunks(redis, "crashy")
        # Past its own pending entries, the worker blocks on new ones (XREADGROUP ">").
        while not any(
            c["cmd"] == "xreadgroup" and "b" in c["flags"] for c in await redis.client_list()
        ):
            await asyncio.sleep(0.01)
        [pending] = await redis.xpending_range(keys.requests, keys.group, unlucky, unlucky, 1)
        assert pending["times_delivered"] == 3
        release.set()
        unlucky_chunks = await read_chunks(redis, "unlucky")
        await submit(redis, GenerateRequest("next", prompt=PROMPT, sampling=sampling))
        after = await read_chunks(redis, "next")
        assert worker.engine_thread.num_added == 2  # "crashy" never reached the engine
    assert [(c.seq, c.error) for c in crashy_chunks] == [
        (0, None),
        (1, "delivered 4 times (limit 3)"),
    ]
    assert joined(unlucky_chunks) == (tokens, text)  # delivered 3 times: at the limit, served
    assert after[-1].usage["completion_tokens"] == 4
    [(_, dead_letter)] = await redis.xrange(keys.dead)
    assert dead_letter[b"entry_id"].decode() == crashy
    assert dead_letter[b"reason"] == b"delivered 4 times (limit 3)"
    assert await num_pending(redis) == 0


async def test_a_response_key_turned_into_a_string_fails_only_its_request(
    engine, reference, redis, redis_url, monkeypatch
):
    """Issue 12: a running request's response key SET to a string wedged the publisher: the
    other requests' streams stalled, their chunks appended again at every retry. Now that
    request alone is aborted and dead-lettered, and a state key of the wrong type costs only
    its done mark."""
    tokens, text = reference(PROMPT, 12)
    ids = ["p1", "p2", "victim"]
    all_added, first_tokens = threading.Event(), threading.Event()
    # Outer hold: no step until all three are in the engine; inner: three steps (prompt and
    # two tokens each), then none until the victim's key is poisoned.
    hold_steps(engine, monkeypatch, ids, free_steps=3, release=first_tokens)
    hold_steps(engine, monkeypatch, ids, release=all_added)
    sampling = dict(max_tokens=12, **GREEDY)
    entries = {
        rid: await submit(redis, GenerateRequest(rid, PROMPT, sampling=sampling)) for rid in ids
    }
    async with serving(engine, redis_url) as worker:
        while worker.engine_thread.num_added < 3:
            await asyncio.sleep(0.01)
        all_added.set()
        await read_chunks(redis, "victim", until_last=False)
        await redis.set(keys.response("victim"), b"not a stream")
        await redis.set(keys.request_state("p2"), b"not a hash")
        first_tokens.set()
        answered = {rid: await read_chunks(redis, rid) for rid in ("p1", "p2")}
        deadline = time.monotonic() + 10
        while not await redis.xlen(keys.dead) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await submit(redis, GenerateRequest("next", PROMPT, sampling=dict(max_tokens=4, **GREEDY)))
        after = await read_chunks(redis, "next")
        assert "victim" not in worker.inflight
    for rid, chunks in answered.items():
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        assert await redis.xlen(keys.response(rid)) == len(chunks)  # none stored twice
        assert joined(chunks) == (tokens, text)
        assert chunks[-1].finish_reason == "length"
    assert await redis.hget(keys.request_state("p1"), "state") == b"done"
    [(_, dead)] = await redis.xrange(keys.dead)
    assert dead[b"entry_id"].decode() == entries["victim"]
    assert dead[b"reason"].startswith(b"redis error: WRONGTYPE")
    assert after[-1].usage["completion_tokens"] == 4
    assert await num_pending(redis) == 0


async def test_out_of_memory_holds_every_stream_until_redis_has_room(
    engine, reference, redis, redis_url, monkeypatch
):
    """Out of memory (`maxmemory` with `noeviction`) refuses every write, not one request's:
    no request is failed for it, the publisher retries with backoff, and once Redis has room
    each request completes, no chunk lost or stored twice."""
    tokens, text = reference(PROMPT, 8)
    ids = ["m1", "m2"]
    all_added, room = threading.Event(), threading.Event()
    hold_steps(engine, monkeypatch, ids, free_steps=2, release=room)  # prompt and a token
    hold_steps(engine, monkeypatch, ids, release=all_added)
    sampling = dict(max_tokens=8, **GREEDY)
    for rid in ids:
        await submit(redis, GenerateRequest(rid, PROMPT, sampling=sampling))

    async def rejected_xadds() -> int:
        stats = await redis.info("commandstats")
        return stats.get("cmdstat_xadd", {}).get("rejected_calls", 0)

    policy = (await redis.config_get("maxmemory-policy"))["maxmemory-policy"]
    async with serving(engine, redis_url) as worker:
        while worker.engine_thread.num_added < 2:
            await asyncio.sleep(0.01)
        all_added.set()
        await read_chunks(redis, "m1", until_last=False)
        rejected = await rejected_xadds()
        await redis.config_set("maxmemory-policy", "noeviction")
        await redis.config_set("maxmemory", 1)
        try:
            room.set()
            deadline = time.monotonic() + 10
            while await rejected_xadds() < rejected + 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert await rejected_xadds() >= rejected + 2  # the publisher tried, and again
        finally:
            await redis.config_set("maxmemory", 0)
            await redis.config_set("maxmemory-policy", policy)
        answered = {rid: await read_chunks(redis, rid) for rid in ids}
    for rid, chunks in answered.items():
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        assert await redis.xlen(keys.response(rid)) == len(chunks)
        assert joined(chunks) == (tokens, text)
    assert await redis.xlen(keys.dead) == 0
    assert await num_pending(redis) == 0


async def test_keys_of_a_running_request_outlive_their_ttl(engine, redis, redis_url, monkeypatch):
    """Issue 12: with a short TTL, `kvrail:req:{id}` and `kvrail:sse:{id}` expired while their
    request still ran. The heartbeat renews them while the worker holds the request."""
    release = threading.Event()
    hold_steps(engine, monkeypatch, ["long"], release=release)
    await redis.set(keys.sse("long"), b"{}", ex=1)  # as the API stores an SSE shape
    sampling = dict(max_tokens=4, **GREEDY)
    await submit(redis, GenerateRequest("long", prompt=PROMPT, sampling=sampling))
    async with serving(engine, redis_url, response_ttl_s=1, claim_idle_ms=1000):  # tick 0.25 s
        await asyncio.sleep(2.5)  # the request runs well past its 1 s TTL
        assert await redis.exists(keys.request_state("long"), keys.sse("long")) == 2
        release.set()
        chunks = await read_chunks(redis, "long")
    assert chunks[-1].usage["completion_tokens"] == 4
    assert 0 < await redis.ttl(keys.request_state("long")) <= 1  # then the TTL after the end


async def test_prompts_are_tokenized_off_the_engine_thread(
    engine, reference, redis, redis_url, monkeypatch
):
    """Issue 12: prompts were tokenized on the engine thread, so two 1M-character prompts
    stretched a running stream's inter-token gap from 0.1 s to 2.4 s. Here the tokenizer
    blocks on the large prompt until the running request has made 8 more tokens: on the
    engine thread that never happens. An abort, and a deadline, that come while a prompt
    waits to be tokenized end their request once the engine has it."""
    big = "word " * 450  # 451 tokens, with max_tokens 8 within the context of 512
    big_tokens, big_text = reference(big, 8)
    run_tokens, _ = reference(PROMPT, 16)
    tokenizing, release = threading.Event(), threading.Event()
    real_encode = engine.tokenizer.encode

    def encode(text, *args, **kwargs):
        if text == big:
            tokenizing.set()
            assert release.wait(20), "the test never released the tokenizer"
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", encode)
    # "run" makes its first token, then no progress until the large prompt is being tokenized.
    hold_steps(engine, monkeypatch, ["run"], free_steps=1, release=tokenizing)
    sampling = dict(max_tokens=16, **GREEDY)
    async with serving(engine, redis_url) as worker:
        await submit(redis, GenerateRequest("run", prompt=PROMPT, sampling=sampling))
        await read_chunks(redis, "run", until_last=False)
        await submit(
            redis, GenerateRequest("big", prompt=big, sampling=dict(max_tokens=8, **GREEDY))
        )
        await submit(redis, GenerateRequest("gone", prompt=PROMPT))
        # Far enough ahead that admission never sees it passed, even on a loaded machine.
        deadline_ms = int(time.time() * 1000) + 2000
        await submit(redis, GenerateRequest("late", prompt=PROMPT, deadline_ms=deadline_ms))
        assert await asyncio.to_thread(tokenizing.wait, 10)
        key, last_id, made = keys.response("run"), "0-0", 0
        deadline = time.monotonic() + 10
        while made < 1 + 8:  # tokens of "run" while the tokenizer holds the large prompt
            assert time.monotonic() < deadline, f"{made} tokens while a prompt was tokenized"
            for _, entries in await redis.xread({key: last_id}, block=100) or []:
                for entry_id, fields in entries:
                    last_id = entry_id
                    made += len(TokenChunk.decode(fields[b"data"]).token_ids)
        await until(lambda: "gone" in worker.engine_thread.tokenizing)  # held, queued
        await redis.xadd(keys.control, {"data": Abort("gone").encode()})
        # The abort waits for its request's prompt.
        await until(lambda: worker.engine_thread.tokenizing["gone"] == "abort")
        await until(lambda: worker.engine_thread.tokenizing.get("late") == "deadline")
        assert not release.is_set() and worker.engine_thread.tokenizing["big"] is None
        release.set()
        served = await read_chunks(redis, "big")
        gone = await read_chunks(redis, "gone")
        late = await read_chunks(redis, "late")
        run = await read_chunks(redis, "run")
    assert joined(served) == (big_tokens, big_text)
    assert served[-1].usage["prompt_tokens"] == 451
    assert joined(run)[0] == run_tokens
    assert gone[-1].finish_reason == "abort" and gone[-1].usage["completion_tokens"] < 16
    assert late[-1].error == "deadline exceeded" and late[-1].usage["completion_tokens"] < 16
    assert await num_pending(redis) == 0


async def test_load_engine_builds_in_a_thread_that_has_ended(model_dir):
    # A loader thread left alive keeps an OpenMP pool that slows the engine thread's steps.
    before = set(threading.enumerate())
    engine = await load_engine(model=model_dir, dtype="float32", num_kv_blocks=16)
    # No thread it started is left (another test's pool thread may end meanwhile).
    assert not set(threading.enumerate()) - before
    assert isinstance(engine, LLMEngine) and engine.config.num_kv_blocks == 16
    assert engine.engine_core.scheduler.kv_cache_manager.get_num_blocks_in_use() == 0
    with pytest.raises(ValueError, match="unknown engine option"):
        await load_engine(model=model_dir, no_such_option=1)
    assert not set(threading.enumerate()) - before  # nor one of the failed build
