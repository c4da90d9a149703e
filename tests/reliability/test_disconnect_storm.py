"""Fault 3: 100 streaming HTTP clients that leave at random moments.

The API (uvicorn) and a `Worker` run in this process on a real Redis, so leaks can be counted
from inside: asyncio tasks, open file descriptors, Redis client connections, the response
reader's subscriptions and the in-progress HTTP gauge are the same after the storm as before,
every request ends aborted (none is generated to its end), and the KV pool is fully free.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
import redis.asyncio as aioredis

from engine import LLMEngine
from queueing.client import DEFAULT_MAX_CONNECTIONS
from queueing.schema import TokenChunk, keys
from service import metrics
from service.api import create_app
from service.settings import Settings
from tests.engine.tiny_models import make_tiny_model
from tests.reliability.harness import open_fds
from tests.service.test_api import Api
from tests.service.test_worker import serving

pytestmark = [pytest.mark.reliability, pytest.mark.asyncio, pytest.mark.timeout(180)]

NUM_CLIENTS = 100
MAX_TOKENS = 400  # far more than any client waits for: every request must end by abort
RESUME_GRACE_S = 0.3
WORKER_LOOPS = 4  # the worker's loops that share its Redis pool


async def test_disconnect_storm_aborts_all_and_leaks_nothing(tmp_path, redis_url):
    model = str(make_tiny_model(tmp_path / "llama", "llama"))
    engine = LLMEngine.from_kwargs(
        model=model, max_model_len=512, num_kv_blocks=256, block_size=16, max_num_seqs=16
    )
    probe = aioredis.Redis.from_url(redis_url)
    # Each departure marks its reader due back, and the abort follows the short grace.
    settings = Settings(resume_grace_s=RESUME_GRACE_S)
    app = create_app(redis_url, "llama", model, settings, worker_cache_s=0.0)
    async with serving(engine, redis_url, claim_idle_ms=2000) as worker, Api(app) as api:
        while not await probe.exists(keys.worker(worker.name)):  # first heartbeat
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(base_url=api.url, timeout=60) as http:
            await _one_full_request(http)  # opens the reader and pool connections once
        before = await _resources(app, probe)
        after = []
        for storm in range(2):
            async with httpx.AsyncClient(base_url=api.url, timeout=60) as http:
                rng = random.Random(storm)
                fates = [rng.random() for _ in range(NUM_CLIENTS)]
                await asyncio.gather(*(_leave_at_random(http, fate) for fate in fates))
            after.append(await _settled(worker, app, probe, before))
        endings = await _endings(probe)
        # Clients that left early never submit; answered entries are deleted, so count adds.
        submitted = (await probe.xinfo_stream(keys.requests))["entries-added"]
        assert await probe.xlen(keys.requests) == 0  # every entry answered and deleted
    await probe.aclose()
    # Connections kept for reuse are bounded by the API's pool and the worker's, and a second
    # storm adds none: a leak would grow with every storm. The worker's pool holds one per loop
    # that ran a command at once (ingest, publish, heartbeat, control), so it can hold more
    # after a storm than at `before` (once 6 -> 71, one past the API's pool alone).
    for name in ("redis_clients", "fds"):
        bound = before[name] + DEFAULT_MAX_CONNECTIONS + WORKER_LOOPS
        assert after[1][name] <= after[0][name] <= bound
    print(f"before {before}; after storm 1 {after[0]}; after storm 2 {after[1]}")
    print(f"{submitted - 1} of {2 * NUM_CLIENTS} storm requests reached the stream")
    assert len(endings) == submitted > NUM_CLIENTS
    assert endings.count("length") == 1, endings  # the warm-up request only
    assert all(e in ("abort", "aborted") for e in endings if e != "length"), endings


def _body() -> dict:
    return {"model": "llama", "prompt": "Tell me a story", "max_tokens": MAX_TOKENS,
            "stream": True, "ignore_eos": True}  # fmt: skip


async def _one_full_request(http: httpx.AsyncClient) -> None:
    body = {**_body(), "max_tokens": 4}
    response = await http.post("/v1/completions", json=body)
    assert response.text.rstrip().endswith("data: [DONE]")


async def _leave_at_random(http: httpx.AsyncClient, fate: float) -> None:
    """A third leave before the response starts (random delay), the rest after 1-12 events."""
    if fate < 1 / 3:
        request = asyncio.create_task(http.post("/v1/completions", json=_body()))
        await asyncio.sleep(fate * 0.3)
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)
        return
    events = 1 + int(fate * 12)
    async with http.stream("POST", "/v1/completions", json=_body()) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            events -= line.startswith("data: ")
            if events <= 0:
                break  # leaving the block closes the connection mid-stream


async def _resources(app, probe: aioredis.Redis) -> dict[str, int]:
    state = app.state.api
    return {
        "tasks": len(asyncio.all_tasks()),
        "fds": open_fds(),
        "redis_clients": len(await probe.client_list()),
        "subscriptions": state.client.reader.num_subscriptions,
        "http_in_progress": int(metrics.http_requests_in_progress._value.get()),
    }


async def _settled(worker, app, probe: aioredis.Redis, before: dict[str, int]) -> dict[str, int]:
    """Wait (up to 20 s) for every abort to land and the KV pool to be free, with as many
    tasks, subscriptions and HTTP requests in progress as `before`; returns the resources."""
    deadline = time.monotonic() + 20
    exact = ("tasks", "subscriptions", "http_in_progress")
    while True:
        now = await _resources(app, probe)
        idle = not worker.inflight and worker.engine_thread.stats.num_blocks_in_use == 0
        if idle and all(now[k] == before[k] for k in exact):
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"not settled: before {before}, after {now}, idle {idle}")
        await asyncio.sleep(0.2)


async def _endings(probe: aioredis.Redis) -> list[str]:
    """How each request's response stream ended: finish_reason, or the error text."""
    endings = []
    async for key in probe.scan_iter(match=keys.response("*")):
        [(_, fields)] = await probe.xrevrange(key, count=1)
        last = TokenChunk.decode(fields[b"data"])
        assert last.is_last, last
        endings.append(last.error or last.finish_reason)
    return endings
