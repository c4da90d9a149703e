"""Fault 1: workers SIGKILLed at random moments under load, and restarted.

200 streaming requests over three `kvrail worker` processes; a killer picks a random worker at
random moments, SIGKILLs it and starts it again under the same name (it then resumes its own
pending entries) while the others take over idle entries with XAUTOCLAIM. Every reader must
see seq 0..N-1 with no repeat and no gap, and the greedy tokens of the offline reference.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid

import pytest

from queueing.client import KvrailClient
from queueing.redis_server import EmbeddedRedis
from queueing.schema import GenerateRequest
from tests.engine.tiny_models import make_tiny_model
from tests.reliability.harness import (
    GREEDY,
    Cluster,
    assert_complete,
    collect,
    prompts,
    reference,
    wait_for_workers,
)

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(420)]

NUM_REQUESTS = 200
MAX_TOKENS = 24
NUM_WORKERS = 3
NUM_KILLS = 6
SUBMIT_WINDOW_S = 20.0
# Few sequences per step: requests queue inside each worker, so a kill catches several.
WORKER_OPTIONS = ("--max-num-seqs", "4")


def test_random_sigkills_lose_no_request_and_repeat_no_chunk(tmp_path):
    model = make_tiny_model(tmp_path / "tiny", "llama")
    texts = prompts(NUM_REQUESTS)
    expected = reference(model, texts, MAX_TOKENS)
    with EmbeddedRedis() as redis:
        cluster = Cluster(model, redis.url, tmp_path, env={"KVRAIL_CLAIM_IDLE_MS": "1500"})
        try:
            for i in range(NUM_WORKERS):
                cluster.start_worker(f"w{i}", *WORKER_OPTIONS)
            results, kills = asyncio.run(_run_with_kills(cluster, texts))
        finally:
            cluster.close()
    resumed = cluster.logs(tail=10**7).count('"event": "resuming"')
    print(f"{NUM_REQUESTS} requests, {kills} SIGKILLs, {resumed} resumed mid-request")
    assert kills >= NUM_KILLS // 2 and resumed > 0  # the kills did hit requests in flight
    for chunks, tokens in zip(results, expected, strict=True):
        assert_complete(chunks, tokens)


async def _run_with_kills(cluster: Cluster, texts: list[str]) -> tuple[list, int]:
    """Submit at a steady pace (the tiny model would otherwise answer all 200 in about a
    second, before any kill) while the killer runs; its count of kills comes back."""
    # Readers open before the first submit, so each waits for the whole run. On 2 loaded
    # cores of a Zen 3 EPYC (`make test-reliability-loaded`), kills of workers still warming
    # up can leave 30 s with no progress: 166-185 of 200 had finished after 120 s.
    async with KvrailClient(cluster.redis_url, chunk_timeout_s=240) as client:
        await wait_for_workers(client, NUM_WORKERS)
        ids = [uuid.uuid4().hex for _ in texts]
        sampling = {"max_tokens": MAX_TOKENS, **GREEDY}
        readers = [asyncio.create_task(collect(client, rid)) for rid in ids]
        done = asyncio.Event()
        killer = asyncio.create_task(_kill_at_random(cluster, client, done))
        try:
            for rid, text in zip(ids, texts, strict=True):
                await client.submit(GenerateRequest(rid, prompt=text, sampling=sampling))
                await asyncio.sleep(SUBMIT_WINDOW_S / len(texts))
            results = await asyncio.wait_for(asyncio.gather(*readers), timeout=300)
        finally:
            done.set()
            kills = await killer
    return results, kills


async def _kill_at_random(cluster: Cluster, client: KvrailClient, done: asyncio.Event) -> int:
    """SIGKILL a random serving worker every 1-2.5 s, at most `NUM_KILLS` times or until
    `done`, restarting it at once under the same name (it resumes its own pending entries)."""
    rng = random.Random(6)
    kills = 0
    while kills < NUM_KILLS and not done.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), rng.uniform(1.0, 2.5))
        serving = await cluster.serving(client)
        if done.is_set() or not serving:
            continue
        name = rng.choice(serving)
        cluster.kill(name)
        cluster.start_worker(name, *WORKER_OPTIONS)
        kills += 1
    return kills
