"""The thin Redis Streams layer: connections, the request consumer group, response streams.

Consumer side (`RequestConsumer`): a worker reads `kvrail:requests` through the group
"engines", first its own pending entries (left by an earlier run under the same name, or by a
read whose reply was lost: again after any error), then new ones, and takes over entries of
dead workers with XAUTOCLAIM. Entries are acknowledged only
once their request is answered; an entry read again (own pending entries, claims) comes with
its delivery count, which the worker caps. Publisher side (`ResponsePublisher`): token chunks go
to their response streams in one MULTI/EXEC per batch, each stream capped and given a TTL.

Stream entries carry one field, `data`: the msgpack bytes of a `queueing.schema` message.
A trimmed or deleted entry reads back without fields: it is returned with `data=None`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError

from queueing.schema import TokenChunk, keys


class Entry(NamedTuple):
    """A request-stream entry as delivered to this consumer."""

    entry_id: str
    data: bytes | None  # the `data` field; None if the entry was trimmed
    deliveries: int = 1  # times the group delivered it, this delivery included (XPENDING)


DEAD_LETTER_MAXLEN = 100_000
DEAD_LETTER_DATA_BYTES = 64 << 10  # enough to read what went wrong; a 24 MiB entry was copied whole
RESPONSE_MAXLEN = 1 << 20  # chunks per response stream: more than any request produces


def connect(url: str, blocking: bool = False) -> aioredis.Redis:
    """An asyncio client. `blocking` clients carry XREAD/XREADGROUP BLOCK calls: no socket
    timeout (redis-py's default would cut a blocked read), so keep each BLOCK short instead.

    They also carry the consumer group's reads (XREADGROUP, XAUTOCLAIM), which redis-py must
    not send again on its own after a dropped connection (recent redis-py does by default,
    10 times in 8.x): such a command may have run with its reply lost (Redis stopping between
    the two), and running it again moves on, leaving the first run's entries pending under
    this consumer with no one serving them until a claim 15 s later (docs/reliability.md item
    31). Every caller of a blocking client already retries in its own loop, with backoff."""
    return aioredis.Redis.from_url(
        url,
        decode_responses=False,
        protocol=2,
        socket_timeout=None if blocking else 5.0,
        socket_connect_timeout=5.0,
        health_check_interval=30,
        **({"retry": Retry(NoBackoff(), 0)} if blocking else {}),
    )


def _entry(entry_id: bytes | str, fields: dict | None) -> Entry:
    """A trimmed entry (no fields) reads as `data=None`; one whose fields lack `data`, as b""
    (a bad entry, answered like any undecodable one)."""
    entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return Entry(entry_id, fields.get(b"data", b"") if fields else None)


async def ensure_group(r: aioredis.Redis) -> None:
    """Create the request stream and its consumer group if missing (idempotent)."""
    try:
        await r.xgroup_create(keys.requests, keys.group, id="0", mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


class GroupLost(Exception):
    """The request stream's consumer group was gone (Redis restarted without its data, a
    FLUSHALL) and is created again: the entries this consumer held are no longer pending."""


class RequestConsumer:
    """One worker's view of the consumer group on `kvrail:requests`.

    `r_blocking` carries the reads that hand entries to this consumer, XREADGROUP and
    XAUTOCLAIM (no socket timeout, no retries inside redis-py: `connect`), `r` everything
    else. After any error, call `reread_pending()`: entries whose reply was lost, or read but
    not yet served, are pending under this consumer and only a read of its own pending list
    finds them.
    """

    def __init__(
        self,
        r_blocking: aioredis.Redis,
        r: aioredis.Redis,
        consumer_name: str,
        block_ms: int = 1000,
        count: int = 32,
    ) -> None:
        self.r_blocking = r_blocking
        self.r = r
        self.name = consumer_name
        self.block_ms = block_ms
        self.count = count
        # Own pending entries are drained once, from the start of the PEL, before new ones:
        # re-reading them later would redeliver requests this worker is still serving.
        self._pending_cursor: str | None = "0"
        self._claim_cursor = "0-0"

    async def read(self, count: int | None = None) -> list[Entry]:
        """The next entries for this consumer, at most `count` (default `self.count`); empty
        after one BLOCK with nothing new."""
        while True:
            start = self._pending_cursor or ">"
            try:
                reply = await self.r_blocking.xreadgroup(
                    keys.group,
                    self.name,
                    {keys.requests: start},
                    count=count or self.count,
                    block=None if self._pending_cursor else self.block_ms,
                )
            except ResponseError as e:
                await self._group_lost(e)
            entries = [_entry(i, f) for _, stream in reply or [] for i, f in stream]
            if self._pending_cursor is None:
                return entries  # new entries: delivered once
            if not entries:
                self._pending_cursor = None  # caught up with our pending entries
                continue
            self._pending_cursor = entries[-1].entry_id
            return await self._with_deliveries(entries)

    async def _group_lost(self, error: ResponseError) -> None:
        """Re-raise `error` unless it is NOGROUP; then create the group again (reading from the
        stream's start) and raise `GroupLost`."""
        if "NOGROUP" not in str(error):
            raise error
        await ensure_group(self.r)
        self._pending_cursor, self._claim_cursor = None, "0-0"  # the new group has no PEL
        raise GroupLost(str(error)) from None

    def reread_pending(self) -> None:
        """Read this consumer's own pending entries again, from the start, before new ones.
        Entries the caller still serves come back too (their delivery counts grow by one): it
        skips them."""
        self._pending_cursor = "0"

    @property
    def caught_up(self) -> bool:
        """Whether `read()` has returned every own pending entry and now reads new ones."""
        return self._pending_cursor is None

    async def ack(self, *entry_ids: str) -> None:
        """Acknowledge entries and delete them: an answered entry is never read again (one
        group), so the request stream holds only unfinished work (issue 12: every prompt
        was kept forever)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.xack(keys.requests, keys.group, *entry_ids)
        pipe.xdel(keys.requests, *entry_ids)
        await pipe.execute()

    async def claim_stale(self, min_idle_ms: int, count: int | None = None) -> list[Entry]:
        """Take over at most `count` (default `self.count`) entries pending longer than
        `min_idle_ms` in other consumers (dead workers). Walks the pending list a page per
        call. Entries deleted from the stream meanwhile are dropped from the pending list by
        Redis 7 and not returned."""
        try:
            reply = await self.r_blocking.xautoclaim(
                keys.requests,
                keys.group,
                self.name,
                min_idle_ms,
                start_id=self._claim_cursor,
                count=count or self.count,
            )
        except ResponseError as e:
            await self._group_lost(e)
        cursor, claimed = reply[0], reply[1]
        self._claim_cursor = cursor.decode() if isinstance(cursor, bytes) else cursor
        # Redis 6.2 returns trimmed entries as (None, None): they have no id to act on.
        return await self._with_deliveries([_entry(i, f) for i, f in claimed if i is not None])

    async def _with_deliveries(self, entries: list[Entry]) -> list[Entry]:
        """`entries`, read again, with their delivery counts: XREADGROUP of own pending entries
        and XAUTOCLAIM count each delivery, neither returns the count (one XPENDING per entry,
        one round trip). An entry no longer pending (acknowledged meanwhile) keeps 1."""
        if not entries:
            return entries
        pipe = self.r.pipeline(transaction=False)
        for e in entries:
            pipe.xpending_range(keys.requests, keys.group, e.entry_id, e.entry_id, 1)
        replies = await pipe.execute()
        return [
            e._replace(deliveries=p[0]["times_delivered"]) if p else e
            for e, p in zip(entries, replies, strict=True)
        ]

    async def touch(self, entry_ids: Sequence[str]) -> None:
        """Reset the idle time of entries this worker is still serving, so that no other
        worker's `claim_stale` takes a long-running request over (XCLAIM JUSTID keeps the
        delivery count)."""
        if entry_ids:
            await self.r.xclaim(
                keys.requests, keys.group, self.name, 0, list(entry_ids), justid=True
            )

    async def dead_letter(self, entry_id: str, data: bytes | None, reason: str) -> Exception | None:
        """Record an entry that could not be served on `kvrail:dead` (the caller acks it): its
        first DEAD_LETTER_DATA_BYTES bytes and its full size, not a copy of any size. Returns
        the error of a `kvrail:dead` that refuses it (see `execute_per_key`), else None."""
        data = data or b""
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(
            keys.dead,
            {
                "entry_id": entry_id,
                "data": data[:DEAD_LETTER_DATA_BYTES],
                "data_bytes": len(data),
                "reason": reason,
            },
            maxlen=DEAD_LETTER_MAXLEN,
            approximate=True,
        )
        [result] = await execute_per_key(pipe)
        return result if isinstance(result, Exception) else None


async def execute_per_key(pipe: Pipeline) -> list[object]:
    """Run a MULTI/EXEC pipeline, telling a key's own failure from everyone's.

    A condition that refuses every write (Redis unreachable, OOM under `maxmemory` with
    `noeviction`, a read-only replica) refuses the whole transaction: it raises, nothing was
    stored (or, reply lost, everything), and a retry mends it. A command's own failure, which no
    retry mends (WRONGTYPE: its key holds another type), comes back in its place in the
    results while the other commands are done: the caller fails only what that key served
    (issue 12: one response key turned into a string made the publisher retry everyone's batch
    forever, re-appending the chunks it had stored)."""
    return await pipe.execute(raise_on_error=False)


class ResponsePublisher:
    """Writes token chunks to response streams, one MULTI/EXEC (one round trip) per batch."""

    def __init__(self, r: aioredis.Redis, ttl_s: int, maxlen: int = RESPONSE_MAXLEN) -> None:
        self.r = r
        self.ttl_s = ttl_s
        self.maxlen = maxlen

    async def publish(self, items: Iterable[tuple[str, TokenChunk]]) -> dict[str, Exception]:
        """XADD each `(stream key, chunk)` in order, then EXPIRE each key once: a stream
        created by XADD has no TTL, and the TTL counts from the latest chunk. Returns the keys
        that refused their chunks, with the error (`execute_per_key`): none of those chunks is
        stored, every other is. One transaction keeps a stream's chunks in seq order: a write
        refused for everyone (OOM) stores none of the batch, never a later chunk without an
        earlier one."""
        pipe = self.r.pipeline(transaction=True)
        written: list[str] = []
        for key, chunk in items:
            pipe.xadd(key, {"data": chunk.encode()}, maxlen=self.maxlen, approximate=True)
            written.append(key)
        for key in dict.fromkeys(written):
            pipe.expire(key, self.ttl_s)
        if not written:
            return {}
        results = await execute_per_key(pipe)
        refused: dict[str, Exception] = {}
        for key, result in zip(written, results, strict=False):  # the XADDs come first
            if isinstance(result, Exception):
                refused.setdefault(key, result)
        return refused


async def read_response(r: aioredis.Redis, key: str, page: int = 1000) -> list[TokenChunk]:
    """Every chunk a response stream holds, in stream order (used to resume a request)."""
    chunks: list[TokenChunk] = []
    start = "-"
    while True:
        entries = await r.xrange(key, min=start, max="+", count=page)
        chunks.extend(TokenChunk.decode(f[b"data"]) for _, f in entries)
        if len(entries) < page:
            return chunks
        last = entries[-1][0].decode()
        start = "(" + last


async def own_request(
    r: aioredis.Redis, request_id: str, entry_id: str, ttl_s: int, turn: int = 0
) -> tuple[str, bool]:
    """Claim `request_id` (a session's: its `turn`) for the stream entry `entry_id` unless
    another entry owns it.

    Returns the owning entry id, `entry_id` itself when this entry is (or already was) the
    owner, e.g. when it is redelivered to resume, another id for a duplicate submission; and
    whether a client marked the request aborted (`aborted` field, set by the producer side:
    an Abort broadcast before any worker held the request reaches nobody).
    """
    key = keys.request_state(request_id)
    entry = "entry" if turn == 0 else f"entry:{turn}"
    pipe = r.pipeline(transaction=True)
    pipe.hsetnx(key, entry, entry_id)
    pipe.hsetnx(key, "state", "running")
    pipe.hmget(key, [entry, "aborted"])
    pipe.expire(key, ttl_s)
    _, _, (owner, aborted), _ = await pipe.execute()
    return owner.decode(), aborted is not None


async def request_state(r: aioredis.Redis, request_id: str) -> str | None:
    """The `state` of a request id (see `mark_done`); None when unknown."""
    state = await r.hget(keys.request_state(request_id), "state")
    return None if state is None else state.decode()


async def renew_ttl(r: aioredis.Redis, names: list[str], ttl_s: int) -> None:
    """Give each existing key of `names` `ttl_s` seconds to live from now (one round trip)."""
    if not names:
        return
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.expire(name, ttl_s)
    await pipe.execute()


async def mark_done(
    r: aioredis.Redis, request_ids: Iterable[str], ttl_s: int, state: str = "done"
) -> dict[str, Exception]:
    """Record that requests were answered in full (their final chunk is stored): `state`
    "done". A session's state is "running" while a turn is served, "waiting" between turns,
    "done" once closed. Returns the requests whose state key refused the mark
    (`execute_per_key`), with the error."""
    pipe = r.pipeline(transaction=True)
    marked: list[str] = []
    for request_id in request_ids:
        pipe.hset(keys.request_state(request_id), "state", state)
        pipe.expire(keys.request_state(request_id), ttl_s)
        marked += [request_id, request_id]
    if not marked:
        return {}
    results = await execute_per_key(pipe)
    return {
        rid: result
        for rid, result in zip(marked, results, strict=True)
        if isinstance(result, Exception)
    }
