"""Resuming a dropped SSE stream (issue 12): a client whose connection drops may come back with
`/v1/streams/{id}` within `KVRAIL_RESUME_GRACE_S`, on any API process, before its request is
aborted.

A real `Worker` on the tiny model and two API apps on one Redis, each with its own Redis client
and reader state, as two `kvrail api` processes would be. The engine's steps are held after a
few tokens until the test releases them, so no outcome depends on generation speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import httpx
import pytest
import redis.asyncio as aioredis

from queueing.schema import Abort, keys
from service import metrics
from service.api import create_app
from service.settings import Settings
from tests.service.test_api import Api, parse_sse
from tests.service.test_worker import PROMPT, hold_steps, read_chunks, serving

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

MAX_TOKENS = 12
BODY = {"model": "llama", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True,
        "temperature": 0.0, "ignore_eos": True}  # fmt: skip
FREE_STEPS = 4  # the prompt's step and 3 decode steps: 4 tokens before the hold


@contextlib.asynccontextmanager
async def two_apis(redis_url, model_dir, **settings):
    """Two API apps (as two processes) on free ports: their HTTP clients."""
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for _ in range(2):
            app = create_app(redis_url, "llama", model_dir, Settings(**settings), worker_cache_s=0)
            api = await stack.enter_async_context(Api(app))
            http = httpx.AsyncClient(base_url=api.url, timeout=30)
            clients.append(await stack.enter_async_context(http))
        yield clients


async def wait_until(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"not {what} within {timeout_s} s"
        await asyncio.sleep(0.02)


async def requests_in_progress(count: int) -> None:
    """Until the APIs handle at most `count` HTTP requests: a departed client's request is
    over once its departure has been dealt with (an abort sent, or the reader marked as due
    back)."""

    async def settled() -> bool:
        return metrics.http_requests_in_progress._value.get() <= count

    await wait_until(settled, f"{count} requests in progress")


async def read_events(lines, count: int | None = None) -> list[dict]:
    """The next `count` SSE events (None: all that are left) of a response's `aiter_lines()`."""
    events, block = [], []
    async for line in lines:
        if line:
            block.append(line)
            continue
        events.extend(parse_sse("\n".join(block)))
        block = []
        if len(events) == count:
            return events
    assert count is None, f"the stream ended after {len(events)} of {count} events"
    return events


def check_complete(events: list[dict], reference: list[dict]) -> None:
    """`events` are the whole stream: seq 0..N-1 without gap or repeat, the reference's
    tokens, a normal end."""
    assert [e["id"] for e in events[:-1]] == list(range(len(events) - 1))
    assert events[-1]["data"] == "[DONE]"
    assert [e["data"]["choices"] for e in events[:-1]] == [
        e["data"]["choices"] for e in reference[:-1]
    ]
    assert events[-2]["data"]["choices"][0]["finish_reason"] == "length"


async def aborts(redis_url: str) -> list[str]:
    r = aioredis.Redis.from_url(redis_url)
    try:
        return [Abort.decode(f[b"data"]).request_id for _, f in await r.xrange(keys.control)]
    finally:
        await r.aclose()


async def started(worker, redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    try:
        await wait_until(lambda: r.exists(keys.worker(worker.name)), "heartbeating")
    finally:
        await r.aclose()


async def test_a_dropped_stream_resumes_on_another_api_within_the_grace(
    engine, model_dir, redis_url, monkeypatch
):
    """Before: the disconnect aborted the request at once, and the resumed stream ended with
    `finish_reason: "abort"` after the tokens made so far."""
    grace_s = 2.0
    async with (
        serving(engine, redis_url) as worker,
        two_apis(redis_url, model_dir, resume_grace_s=grace_s) as (first, second),
    ):
        await started(worker, redis_url)
        reference = parse_sse((await first.post("/v1/completions", json=BODY)).text)
        release = threading.Event()
        hold_steps(engine, monkeypatch, None, free_steps=FREE_STEPS, release=release)
        async with first.stream("POST", "/v1/completions", json=BODY) as response:
            before = await read_events(response.aiter_lines(), 3)
        request_id = before[0]["data"]["id"]
        await requests_in_progress(0)
        readers = aioredis.Redis.from_url(redis_url)
        headers = {"Last-Event-ID": str(before[-1]["id"])}
        async with second.stream("GET", f"/v1/streams/{request_id}", headers=headers) as resumed:
            # The first API's check, due when the grace ran out, found the second API's
            # reader and dropped only the first one's expired mark: nothing was aborted.
            async def one_reader() -> bool:
                return await readers.zcard(keys.readers(request_id)) == 1

            await wait_until(one_reader, "down to one reader", grace_s + 10)
            release.set()
            after = await read_events(resumed.aiter_lines())
        await readers.aclose()
    check_complete(before + after, reference)
    assert request_id not in await aborts(redis_url)


async def test_a_resumed_reader_that_leaves_does_not_abort_the_request(
    engine, model_dir, redis_url, monkeypatch
):
    """Before: any reader leaving, a resumed one too, aborted the request at once, cutting
    short the client still reading it."""
    async with (
        serving(engine, redis_url) as worker,
        two_apis(redis_url, model_dir, resume_grace_s=0.2) as (first, second),
    ):
        await started(worker, redis_url)
        reference = parse_sse((await first.post("/v1/completions", json=BODY)).text)
        release = threading.Event()
        hold_steps(engine, monkeypatch, None, free_steps=FREE_STEPS, release=release)
        async with first.stream("POST", "/v1/completions", json=BODY) as original:
            lines = original.aiter_lines()
            before = await read_events(lines, 2)
            request_id = before[0]["data"]["id"]
            headers = {"Last-Event-ID": "0"}
            async with second.stream("GET", f"/v1/streams/{request_id}", headers=headers) as other:
                assert [e["id"] for e in await read_events(other.aiter_lines(), 1)] == [1]
            await requests_in_progress(1)  # the other reader's departure is dealt with
            release.set()
            rest = await read_events(lines)
    check_complete(before + rest, reference)
    assert request_id not in await aborts(redis_url)


async def test_a_stream_nobody_resumes_is_aborted_once_the_grace_has_run_out(
    engine, model_dir, redis_url, monkeypatch
):
    """Its KV blocks are freed, not before the grace (before: at once) and not much after."""
    grace_s = 0.5
    hold_steps(engine, monkeypatch, None, free_steps=FREE_STEPS)
    async with (
        serving(engine, redis_url) as worker,
        two_apis(redis_url, model_dir, resume_grace_s=grace_s) as (first, _),
    ):
        await started(worker, redis_url)
        async with first.stream("POST", "/v1/completions", json=BODY) as response:
            [event] = await read_events(response.aiter_lines(), 1)
            left = time.monotonic()
        r = aioredis.Redis.from_url(redis_url)
        chunks = await read_chunks(r, event["data"]["id"])
        ended_after_s = time.monotonic() - left
        await r.aclose()

        async def freed() -> bool:
            return not worker.inflight and worker.engine_thread.stats.num_blocks_in_use == 0

        await wait_until(freed, "KV blocks freed")
    print(f"aborted {ended_after_s:.3f} s after the client left (grace {grace_s} s)")
    assert chunks[-1].finish_reason == "abort"
    assert grace_s <= ended_after_s < grace_s + 5, ended_after_s
    assert await aborts(redis_url) == [event["data"]["id"]]


async def test_a_client_gone_before_its_first_event_has_its_request_aborted_at_once(
    engine, model_dir, redis_url, monkeypatch
):
    """It never learned the request id (the first event carries it), so it cannot resume:
    its request is not left generating for the grace."""
    hold_steps(engine, monkeypatch, None)  # not a single token
    async with (
        serving(engine, redis_url) as worker,
        two_apis(redis_url, model_dir, resume_grace_s=30) as (first, _),
    ):
        await started(worker, redis_url)
        async with first.stream("POST", "/v1/completions", json=BODY) as response:
            assert response.status_code == 200  # submitted; leaves before any event
        await requests_in_progress(0)
        [request_id] = await aborts(redis_url)  # sent before the departed request was over
        r = aioredis.Redis.from_url(redis_url)
        chunks = await read_chunks(r, request_id)
        await r.aclose()
    assert chunks[-1].finish_reason == "abort"
