"""Overload 5: a burst at ten times the sustainable rate, on `kvrail api` + `kvrail worker`.

The sustainable rate is measured first (closed loop); then requests arrive open-loop at ten
times that for a few seconds. The API answers the excess with 429 and Retry-After once the
backlog reaches KVRAIL_MAX_PENDING, every accepted request completes in full, nothing is a
5xx, and the worker's resident memory stays bounded. On the raw stream the excess waits in
the stream: a worker holds at most two batches (2 x max_num_seqs requests), and every request
completes.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

import httpx
import pytest

from queueing.client import KvrailClient
from queueing.redis_server import EmbeddedRedis
from queueing.schema import GenerateRequest, keys
from tests.engine.tiny_models import make_tiny_model
from tests.reliability.harness import GREEDY, Cluster, collect, rss_bytes, wait_for_workers

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(300)]

MAX_TOKENS = 32
MAX_PENDING = 24  # the API's 429 threshold
BURST_S = 5.0
MAX_BURST_REQUESTS = 1000  # the client shares 2 cores with the server: cap its own load
RSS_GROWTH_LIMIT = 150 << 20


def test_burst_gets_429_accepted_complete_memory_bounded(tmp_path):
    model = make_tiny_model(tmp_path / "llama", "llama")
    with EmbeddedRedis() as redis:
        cluster = Cluster(model, redis.url, tmp_path, env={"KVRAIL_MAX_PENDING": str(MAX_PENDING)})
        try:
            worker = cluster.start_worker("w0", "--max-num-seqs", "8")
            cluster.start_api()
            report = asyncio.run(_burst(cluster, worker.pid))
        finally:
            cluster.close()
    print(report)
    assert report["statuses"][429] > 0 and report["statuses"][200] > 0
    assert set(report["statuses"]) <= {200, 429}, report["statuses"]
    assert report["rss_growth"] < RSS_GROWTH_LIMIT


async def _burst(cluster: Cluster, worker_pid: int) -> dict:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=cluster.api_url, timeout=120, limits=limits) as http:
        rate = await _sustainable_rate(http)
        rss_before = rss_bytes(worker_pid)
        burst_rate = 10 * rate
        count = min(MAX_BURST_REQUESTS, int(burst_rate * BURST_S))
        tasks = []
        for _ in range(count):
            tasks.append(asyncio.create_task(_complete(http)))
            await asyncio.sleep(1 / burst_rate)
        statuses = Counter(await asyncio.gather(*tasks))
        rss_after = rss_bytes(worker_pid)
    return {
        "sustainable_req_s": round(rate, 1),
        "burst_req_s": round(burst_rate, 1),
        "sent": count,
        "statuses": statuses,
        "rss_before_mb": rss_before >> 20,
        "rss_after_mb": rss_after >> 20,
        "rss_growth": rss_after - rss_before,
    }


async def _sustainable_rate(http: httpx.AsyncClient, count: int = 24) -> float:
    """Requests per second the worker completes with `count` requests in flight."""
    start = time.monotonic()
    assert Counter(await asyncio.gather(*(_complete(http) for _ in range(count)))) == {200: count}
    return count / (time.monotonic() - start)


async def _complete(http: httpx.AsyncClient) -> int:
    """One completion; a 200 must carry every token, a 429 a Retry-After."""
    body = {"model": "llama", "prompt": "Burst", "max_tokens": MAX_TOKENS, **GREEDY}
    response = await http.post("/v1/completions", json=body)
    if response.status_code == 200:
        assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS
    elif response.status_code == 429:
        assert int(response.headers["retry-after"]) > 0
    return response.status_code


def test_raw_stream_burst_waits_in_the_stream_not_in_the_worker(tmp_path):
    model = make_tiny_model(tmp_path / "llama", "llama")
    with EmbeddedRedis() as redis:
        cluster = Cluster(model, redis.url, tmp_path)
        try:
            cluster.start_worker("w0", "--max-num-seqs", "4")
            endings, max_held = asyncio.run(_raw_burst(cluster.redis_url, 200))
        finally:
            cluster.close()
    print(f"raw burst of 200: {Counter(endings)}, at most {max_held} held by the worker")
    assert endings == ["length"] * 200
    assert 0 < max_held <= 2 * 4


async def _raw_burst(redis_url: str, count: int) -> tuple[list[str], int]:
    """XADD `count` requests at once; how each ended (finish_reason, or the error text), and
    the most entries the worker held (delivered, not yet acknowledged) meanwhile."""
    async with KvrailClient(redis_url) as client:
        await wait_for_workers(client, 1)
        ids = [uuid.uuid4().hex for _ in range(count)]
        sampling = {"max_tokens": MAX_TOKENS, **GREEDY}
        for rid in ids:
            await client.submit(GenerateRequest(rid, prompt="Burst", sampling=sampling))
        collecting = asyncio.gather(*(collect(client, rid) for rid in ids))
        max_held = 0
        while not collecting.done():
            pending = await client.redis.xpending(keys.requests, keys.group)
            max_held = max(max_held, pending["pending"])
            await asyncio.sleep(0.02)
        results = await collecting
    return [chunks[-1].error or chunks[-1].finish_reason for chunks in results], max_held
