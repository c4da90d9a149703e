"""The worker's writes to Redis: chunks first, then dead letters, XACKs and done marks.

Everything the worker answers goes through one queue of `Batch`es, written in order by one
task, so a request's chunks are stored before its entry is acknowledged: an entry acked is an
entry answered in full. `Backoff` is the worker's one retry policy while Redis is unreachable,
shared by these writes and by the supervisor that restarts the worker's loops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from queueing import streams
from queueing.schema import TokenChunk

log = structlog.get_logger("kvrail.worker")

RETRY_MIN_S = 0.05  # backoff between attempts while Redis is unreachable
RETRY_MAX_S = 2.0


class Backoff:
    """Exponential delays between attempts: `RETRY_MIN_S` doubling up to `RETRY_MAX_S`."""

    def __init__(self) -> None:
        self.delay = RETRY_MIN_S  # the next sleep

    def reset(self) -> None:
        self.delay = RETRY_MIN_S

    async def sleep(self) -> None:
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, RETRY_MAX_S)


@dataclass
class Batch:
    """Work for the publisher: chunks first, then acks, dead letters and done marks."""

    chunks: list[tuple[str, TokenChunk]] = field(default_factory=list)  # (response key, chunk)
    acks: list[str] = field(default_factory=list)
    dead: list[tuple[str, bytes | None, str]] = field(default_factory=list)  # entry, data, why
    done: list[str] = field(default_factory=list)  # request ids answered in full


class Publisher:
    """Writes queued batches in order until `close()`. Redis errors are retried with `Backoff`;
    once `stopping` is set a failed write gives up and leaves its entries pending."""

    def __init__(
        self,
        r: aioredis.Redis,
        consumer: streams.RequestConsumer,
        response_ttl_s: int,
        stopping: asyncio.Event,
    ) -> None:
        self._batches: asyncio.Queue[Batch | None] = asyncio.Queue()
        self.chunk_writer = streams.ResponsePublisher(r, response_ttl_s)
        self.consumer = consumer
        self.r, self.response_ttl_s = r, response_ttl_s  # for the done marks
        self.stopping = stopping

    def put(self, batch: Batch) -> None:
        self._batches.put_nowait(batch)

    def close(self) -> None:
        """`run()` returns after writing what is queued now."""
        self._batches.put_nowait(None)

    async def run(self) -> None:
        """Write batches in order, merging whatever queued up meanwhile into one round trip.
        Ends at the `None` sentinel queued by `close()`."""
        while True:
            batches = [await self._batches.get()]
            while not self._batches.empty():
                batches.append(self._batches.get_nowait())
            stop = batches[-1] is None
            merged = Batch()
            for b in batches:
                if b is not None:
                    merged.chunks += b.chunks
                    merged.acks += b.acks
                    merged.dead += b.dead
                    merged.done += b.done
            try:
                await self._flush(merged)
            except Exception:
                # Not a Redis error (those are retried): not acked, so the entries stay
                # pending and are resumed by whoever claims them; keep publishing the rest.
                log.exception("publishing failed", entries=merged.acks)
            if stop:
                return

    async def _flush(self, batch: Batch) -> None:
        """Store chunks, then dead letters, acks and done marks, each step retried alone so
        a Redis outage neither drops chunks (a gap for the reader) nor writes them twice.
        A step given up (while stopping) skips the rest: nothing is acked unless stored."""
        steps = [("publish", lambda: self.chunk_writer.publish(batch.chunks))]
        steps += [("dead-letter", lambda d=d: self.consumer.dead_letter(*d)) for d in batch.dead]
        if batch.acks:
            steps.append(("ack", lambda: self.consumer.ack(*batch.acks)))
        if batch.done:
            steps.append(
                ("mark-done", lambda: streams.mark_done(self.r, batch.done, self.response_ttl_s))
            )
        for what, write in steps:
            if not await self._retry(what, write):
                return

    async def _retry(self, what: str, write: Callable[[], Awaitable[object]]) -> bool:
        """Run `write()` until it succeeds, backing off on Redis errors. Once the worker is
        stopping it gives up after one failure (returns False): its entries stay pending and
        whoever claims them resumes from the chunks that were stored."""
        backoff = Backoff()
        while True:
            try:
                await write()
                return True
            except RedisError:
                log.warning("redis write failed, retrying", step=what, delay_s=backoff.delay)
                if self.stopping.is_set():
                    return False
                await backoff.sleep()
