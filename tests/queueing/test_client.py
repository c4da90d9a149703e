"""KvrailClient against a real Redis, with chunks written by a real producer."""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError

from queueing.client import KvrailClient, SeqGapError, StreamTimeout
from queueing.schema import Abort, GenerateRequest, TokenChunk, WorkerInfo, keys


class ChunkProducer:
    """Writes TokenChunks to response streams, as a worker would (no mocks: real XADDs)."""

    def __init__(self, redis_url: str) -> None:
        self.redis = aioredis.Redis.from_url(redis_url)

    async def write(self, request_id: str, seqs: list[int], last_seq: int | None = None) -> None:
        """XADD one chunk per seq; the chunk whose seq is `last_seq` carries usage (ends it)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for seq in seqs:
                chunk = TokenChunk(
                    request_id=request_id,
                    seq=seq,
                    token_ids=[seq],
                    text=f"t{seq}",
                    usage={"completion_tokens": seq + 1} if seq == last_seq else None,
                )
                pipe.xadd(keys.response(request_id), {"data": chunk.encode()})
            await pipe.execute()


@pytest_asyncio.fixture
async def client(redis_url):
    async with KvrailClient(redis_url, chunk_timeout_s=5.0) as c:
        yield c


@pytest_asyncio.fixture
async def producer(redis_url):
    p = ChunkProducer(redis_url)
    yield p
    await p.redis.aclose()


async def collect(client: KvrailClient, request_id: str, **kwargs) -> list[int]:
    return [chunk.seq async for chunk in client.stream(request_id, **kwargs)]


@pytest.mark.asyncio
async def test_chunks_arrive_in_order_and_stream_ends_after_last(client, producer):
    reader = asyncio.create_task(collect(client, "r1"))
    await producer.write("r1", [0, 1, 2])
    await producer.write("r1", [3, 4], last_seq=4)
    assert await asyncio.wait_for(reader, 5) == [0, 1, 2, 3, 4]
    assert client.reader.num_subscriptions == 0


@pytest.mark.asyncio
async def test_stream_reads_chunks_written_before_it_started(client, producer):
    await producer.write("early", [0, 1, 2], last_seq=2)
    assert await collect(client, "early") == [0, 1, 2]


@pytest.mark.asyncio
async def test_duplicates_are_dropped(client, producer):
    await producer.write("dup", [0, 1, 1, 0, 2, 2], last_seq=2)
    assert await collect(client, "dup") == [0, 1, 2]


@pytest.mark.asyncio
async def test_gap_raises(client, producer):
    await producer.write("gap", [0, 2, 3], last_seq=3)
    with pytest.raises(SeqGapError, match="expected chunk seq 1, got 2"):
        await collect(client, "gap")


@pytest.mark.asyncio
async def test_silence_raises_timeout(client, producer):
    await producer.write("slow", [0])
    with pytest.raises(StreamTimeout):
        await collect(client, "slow", timeout_s=0.3)


@pytest.mark.asyncio
async def test_resume_after_seq_returns_only_the_rest(client, producer):
    await producer.write("res", [0, 1, 2, 3], last_seq=3)
    assert await collect(client, "res", after_seq=1) == [2, 3]
    # Resuming after the final chunk ends at once instead of waiting for more.
    assert await asyncio.wait_for(collect(client, "res", after_seq=3, timeout_s=30), 2) == []


@pytest.mark.asyncio
async def test_new_stream_wakes_the_blocked_reader(redis_url, producer):
    """A stream added while XREAD is blocked must not wait for the BLOCK to expire."""
    async with KvrailClient(redis_url, block_ms=5000) as client:
        await asyncio.sleep(0.2)  # let the reader block on its wake stream
        start = time.monotonic()
        reader = asyncio.create_task(collect(client, "fast"))
        await asyncio.sleep(0.05)
        await producer.write("fast", [0], last_seq=0)
        assert await asyncio.wait_for(reader, 5) == [0]
        assert time.monotonic() - start < 1.0


@pytest.mark.asyncio
async def test_a_wake_that_fails_leaves_the_stream_to_the_next_read(
    redis_url, producer, monkeypatch
):
    """Redis stopping as a stream is opened: its wake failed, and so did the stream, though the
    request had been accepted. The reader's next XREAD, after its BLOCK, reads it instead."""
    async with KvrailClient(redis_url, block_ms=300) as client:
        await asyncio.sleep(0.2)  # let the reader block on its wake stream
        real_execute, calls = Pipeline.execute, []

        async def wake_fails_once(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise ConnectionError("Connection reset by peer (injected)")
            return await real_execute(self, *args, **kwargs)

        monkeypatch.setattr(Pipeline, "execute", wake_fails_once)
        reader = asyncio.create_task(collect(client, "woken"))
        await asyncio.sleep(0.05)
        await producer.write("woken", [0], last_seq=0)
        assert await asyncio.wait_for(reader, 5) == [0]
        assert len(calls) == 2  # the failed wake, then the producer's write


@pytest.mark.asyncio
async def test_two_readers_of_one_stream_each_get_everything(client, producer):
    first = asyncio.create_task(collect(client, "shared"))
    await producer.write("shared", [0, 1])
    await asyncio.sleep(0.1)
    second = asyncio.create_task(collect(client, "shared"))
    await producer.write("shared", [2], last_seq=2)
    assert await asyncio.wait_for(first, 5) == [0, 1, 2]
    assert await asyncio.wait_for(second, 5) == [0, 1, 2]


@pytest.mark.asyncio
async def test_200_concurrent_streams_share_one_reader(client, producer, redis_url):
    ids = [f"many-{i}" for i in range(200)]
    readers = [asyncio.create_task(collect(client, rid)) for rid in ids]
    await asyncio.sleep(0.1)
    for step in range(3):  # interleave the streams, as concurrent requests would be
        for rid in ids:
            await producer.write(rid, [step], last_seq=2 if step == 2 else None)
    results = await asyncio.wait_for(asyncio.gather(*readers), 10)
    assert results == [[0, 1, 2]] * 200
    assert client.reader.num_subscriptions == 0
    # One blocked reader plus a handful of command connections, not one per stream.
    info = await client.redis.client_list()
    assert len(info) < 30


@pytest.mark.asyncio
async def test_submit_appends_a_decodable_request(client):
    request = GenerateRequest("sub-1", prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 4})
    assert await client.submit(request) == "sub-1"
    ((_, fields),) = await client.redis.xrange(keys.requests)
    assert GenerateRequest.decode(fields[b"data"]) == request


@pytest.mark.asyncio
async def test_abort_lands_on_control_stream_and_marks_request(client):
    await client.abort("ab-1")
    ((_, fields),) = await client.redis.xrange(keys.control)
    assert Abort.decode(fields[b"data"]).request_id == "ab-1"
    assert await client.redis.hget(keys.request_state("ab-1"), "aborted") == b"1"
    assert await client.redis.ttl(keys.request_state("ab-1")) > 0


@pytest.mark.asyncio
async def test_workers_lists_live_heartbeats(client):
    info = WorkerInfo("w1", "m", 2048, started_ms=1, heartbeat_ms=2)
    await client.redis.set(keys.worker("w1"), info.encode(), ex=10)
    await client.redis.set(keys.worker("broken"), b"not msgpack", ex=10)
    assert await client.workers() == [info]


@pytest.mark.asyncio
async def test_backlog_counts_undelivered_and_pending(client):
    for i in range(3):
        await client.submit(GenerateRequest(f"b{i}", prompt="x"))
    assert await client.backlog() == 3  # no group yet
    await client.redis.xgroup_create(keys.requests, keys.group, id="0")
    reply = await client.redis.xreadgroup(keys.group, "w", {keys.requests: ">"}, count=1)
    assert await client.backlog() == 3  # one pending, two undelivered
    await client.redis.xack(keys.requests, keys.group, reply[0][1][0][0])
    assert await client.backlog() == 2


@pytest.mark.asyncio
async def test_round_trip_drops_repeats_resumes_and_aborts(client, redis_url):
    """What the blocking client's test checked (it was folded away with that client): a
    repeated chunk is yielded once, `after_seq` resumes, `abort` broadcasts one Abort."""
    await client.submit(GenerateRequest("sync-1", prompt="hello"))
    producer = aioredis.Redis.from_url(redis_url)
    for seq in (0, 1, 1, 2):
        chunk = TokenChunk("sync-1", seq, usage={"x": 1} if seq == 2 else None)
        await producer.xadd(keys.response("sync-1"), {"data": chunk.encode()})
    assert [c.seq async for c in client.stream("sync-1")] == [0, 1, 2]
    assert [c.seq async for c in client.stream("sync-1", after_seq=0)] == [1, 2]
    await client.abort("sync-1")
    assert await producer.xlen(keys.control) == 1
    assert await client.workers() == []
    await producer.aclose()
