"""The worker's writes to Redis: chunks first, then dead letters, XACKs and state marks.

Everything the worker answers goes through one queue of `Batch`es, written in order by one
task, so a request's chunks are stored before its entry is acknowledged: an entry acked is an
entry answered in full, or dead-lettered. A write that Redis refuses for everyone (unreachable,
out of memory) is retried with `Backoff`, the worker's one retry policy while Redis cannot
write, shared with the supervisor that restarts the worker's loops. A key that refuses its own
writes (WRONGTYPE) fails only the request it serves: one bad key never stalls the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from queueing import streams
from queueing.schema import TokenChunk

log = structlog.get_logger("kvrail.worker")

RETRY_MIN_S = 0.05  # backoff between attempts while Redis is unreachable
RETRY_MAX_S = 2.0

T = TypeVar("T")


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
    waiting: list[str] = field(default_factory=list)  # sessions whose turn was, left open
    # request id -> (entry id, data) of each request with chunks here: what a request whose
    # response key refuses them is dead-lettered and acknowledged with
    entries: dict[str, tuple[str, bytes | None]] = field(default_factory=dict)

    def add_chunk(self, key: str, chunk: TokenChunk, entry_id: str, data: bytes | None) -> None:
        """Queue `chunk` for the response stream `key`, answering the entry `entry_id`."""
        self.chunks.append((key, chunk))
        self.entries[chunk.request_id] = (entry_id, data)


class _GaveUp(Exception):
    """A write failed while the worker is stopping: the rest of the batch is left unwritten."""


class Publisher:
    """Writes queued batches in order until `close()`. Redis errors are retried with `Backoff`;
    once `stopping` is set a failed write gives up and leaves its entries pending. A request
    whose response key refuses its chunks is dead-lettered and acknowledged, and
    `on_unwritable(request_id)` tells the worker to stop generating it."""

    def __init__(
        self,
        r: aioredis.Redis,
        consumer: streams.RequestConsumer,
        response_ttl_s: int,
        stopping: asyncio.Event,
        on_unwritable: Callable[[str], None],
    ) -> None:
        self._batches: asyncio.Queue[Batch | None] = asyncio.Queue()
        self.chunk_writer = streams.ResponsePublisher(r, response_ttl_s)
        self.consumer = consumer
        self.r, self.response_ttl_s = r, response_ttl_s  # for the done marks
        self.stopping = stopping
        self.on_unwritable = on_unwritable
        # Requests failed by the last flush: batches queued before the worker heard of it
        # may still hold their chunks, dropped from the next flush (which takes every batch
        # queued until then).
        self._unwritable: set[str] = set()
        # Entries whose ack is queued and not yet written: still pending under this worker,
        # so they count towards what it holds (`Worker.max_inflight`).
        self.num_unacked = 0

    def put(self, batch: Batch) -> None:
        self.num_unacked += len(batch.acks)
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
                    merged.waiting += b.waiting
                    merged.entries.update(b.entries)
            failed, self._unwritable = self._unwritable, set()
            merged.chunks = [(k, c) for k, c in merged.chunks if c.request_id not in failed]
            merged.done = [rid for rid in merged.done if rid not in failed]
            merged.waiting = [rid for rid in merged.waiting if rid not in failed]
            try:
                await self._flush(merged)
            except Exception:
                # Not a Redis error (those are retried): not acked, so the entries stay
                # pending and are resumed by whoever claims them; keep publishing the rest.
                log.exception("publishing failed", entries=merged.acks)
            self.num_unacked -= sum(len(b.acks) for b in batches if b is not None)
            if stop:
                return

    async def _flush(self, batch: Batch) -> None:
        """Store chunks, then dead letters, acks and done marks, each step retried alone so
        a Redis outage neither drops chunks (a gap for the reader) nor writes them twice.
        A step given up (while stopping) skips the rest: nothing is acked unless stored."""
        try:
            refused = await self._retry("publish", partial(self.chunk_writer.publish, batch.chunks))
            self._fail_unwritable(batch, refused)
            for entry_id, data, reason in batch.dead:
                write = partial(self.consumer.dead_letter, entry_id, data, reason)
                if (error := await self._retry("dead-letter", write)) is not None:
                    # A `kvrail:dead` of another type: the record goes to the log instead.
                    log.error(
                        "dead letter refused", entry_id=entry_id, reason=reason, error=str(error)
                    )
            if batch.acks:
                await self._retry("ack", partial(self.consumer.ack, *batch.acks))
            for state, request_ids in (("done", batch.done), ("waiting", batch.waiting)):
                if not request_ids:
                    continue
                mark = partial(streams.mark_done, self.r, request_ids, self.response_ttl_s, state)
                for rid, error in (await self._retry("mark-done", mark)).items():
                    log.warning("state mark refused", request_id=rid, state=state, error=str(error))
        except _GaveUp:
            return

    def _fail_unwritable(self, batch: Batch, refused: dict[str, Exception]) -> None:
        """Fail the requests whose response key refused their chunks (issue 12: a string at a
        running request's `kvrail:resp:{id}` wedged the publisher): dead-lettered with the
        reason and acknowledged (after the dead letter is stored), not marked done, and no
        longer generated. The other requests' chunks were stored."""
        failed = {c.request_id: key for key, c in batch.chunks if key in refused}
        for rid, key in failed.items():
            entry_id, data = batch.entries[rid]
            reason = f"redis error: {refused[key]}"
            log.warning("response stream refused its chunks", request_id=rid, reason=reason)
            batch.dead.append((entry_id, data, reason))
            batch.acks.append(entry_id)
            self.on_unwritable(rid)
        batch.done = [rid for rid in batch.done if rid not in failed]
        batch.waiting = [rid for rid in batch.waiting if rid not in failed]
        self._unwritable.update(failed)

    async def _retry(self, what: str, write: Callable[[], Awaitable[T]]) -> T:
        """Run `write()` until it succeeds, backing off on Redis errors. Once the worker is
        stopping it gives up after one failure (raises `_GaveUp`): its entries stay pending
        and whoever claims them resumes from the chunks that were stored."""
        backoff = Backoff()
        while True:
            try:
                return await write()
            except RedisError:
                log.warning("redis write failed, retrying", step=what, delay_s=backoff.delay)
                if self.stopping.is_set():
                    raise _GaveUp(what) from None
                await backoff.sleep()
