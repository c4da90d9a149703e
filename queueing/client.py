"""The producer side of the wire: submit requests, read their chunks, abort them.

`KvrailClient` (asyncio) serves many concurrent streams over a bounded connection pool: one
`ResponseReader` task per client runs `XREAD BLOCK` over every response stream currently
awaited and fans the chunks out to per-stream queues, so a thousand open streams cost one
blocked connection, not a thousand (field notes: one XREAD per stream exhausts the pool).

When a stream is added while the reader is blocked, the reader would only notice after its
BLOCK expires; instead `subscribe` appends to the reader's private wake stream
`kvrail:wake:{reader id}`, which the reader always reads, so the blocked XREAD returns at
once. Appending (rather than `CLIENT UNBLOCK`) has no race: an entry added before the XREAD
is sent makes it return immediately.

The client owns every Redis call the API makes, so the API speaks in requests, streams and
workers, never in keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis

from queueing.schema import (
    Abort,
    GenerateRequest,
    SchemaError,
    SessionHistory,
    TokenChunk,
    WorkerInfo,
    keys,
    session_history,
)
from queueing.streams import connect, read_response

logger = logging.getLogger("kvrail.client")

DEFAULT_BLOCK_MS = 1000  # short BLOCK in a loop (field notes: long blocks meet socket timeouts)
DEFAULT_CHUNK_TIMEOUT_S = 120.0
DEFAULT_MAX_CONNECTIONS = 64
REQUEST_STATE_TTL_S = 600  # how long an abort mark outlives the request
CONTROL_MAXLEN = 10_000  # aborts are broadcast; old ones are of no use to anyone
WAKE_MAXLEN = 16
WAKE_TTL_S = 3600
_READ_COUNT = 256  # entries per stream per XREAD
_RECONNECT_DELAY_S = 0.1  # first wait after a failed XREAD; doubles up to the cap
_RECONNECT_DELAY_MAX_S = 2.0
_MARKER_CHECK_S = 1.0  # how often the reader checks that Redis still holds its marker
_MARKER_TTL_S = 86_400
_BACKLOG_COUNT_CAP = 10_000

# The readers of a streaming request (`kvrail:readers:{id}`, a sorted set): each SSE connection
# following it is a member, scored +inf while connected and, once it has left, by the time
# (ms, Redis's clock: API processes on several hosts compare on one clock) until which its
# request waits for a reader to come back before being aborted.
_HOLD_READER = """
local score = '+inf'
if tonumber(ARGV[2]) >= 0 then
  local t = redis.call('TIME')
  score = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])
end
redis.call('ZADD', KEYS[1], score, ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
"""
# -1: nothing to decide (the request is done or a session waits between turns, or a reader
# is connected: it decides when it leaves); 0: no reader left and none due back; n > 0: ms
# until the last one's grace ends.
_UNREAD_IN = """
local state = redis.call('HGET', KEYS[2], 'state')
if state == 'done' or state == 'waiting' then return -1 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if #last == 0 then return 0 end
if last[2] == 'inf' then return -1 end
return math.max(1, tonumber(last[2]) - now)
"""

# A session's next turn: appended to the request stream only if it is the turn after the
# last one submitted (the state's `turn`) and the session is not closed, in one step, so two
# API processes cannot both submit a turn. The readers of the turn before are forgotten (one
# whose stream ended never left: it would pass for connected). Returns {1, last} when
# submitted, {0, last} when `turn` is not the next one, {-1, last} when the session is closed.
_SUBMIT_TURN = """
local last = tonumber(redis.call('HGET', KEYS[1], 'turn') or '-1')
if redis.call('HGET', KEYS[1], 'state') == 'done' then return {-1, last} end
if tonumber(ARGV[1]) ~= last + 1 then return {0, last} end
redis.call('HSET', KEYS[1], 'turn', ARGV[1])
if redis.call('TTL', KEYS[1]) < tonumber(ARGV[3]) then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
redis.call('DEL', KEYS[3])
redis.call('XADD', KEYS[2], '*', 'data', ARGV[2])
return {1, last}
"""

StreamId = tuple[int, int]


class StreamError(RuntimeError):
    """A response stream that cannot be read to its end."""


class SeqGapError(StreamError):
    """A chunk arrived whose `seq` skips one or more chunks: some output was lost."""


class SessionError(ValueError):
    """A turn a session cannot take: it is closed, its last turn is still running, or the
    turn is not its next one."""


class StreamTimeout(StreamError):
    """No chunk arrived within the timeout."""


class RedisDataLost(StreamError):
    """Redis came back without its data (restarted without persistence): the request and its
    response stream are gone, so waiting longer would only end in a timeout."""


class SeqTracker:
    """Orders one request's chunks: drops repeats, raises on gaps, notices the end (of a
    session's stream: the end of `turn`)."""

    def __init__(self, request_id: str, after_seq: int = -1, turn: int = 0) -> None:
        self.request_id = request_id
        self.next_seq = after_seq + 1
        self.turn = turn
        self.finished = False

    def accept(self, chunk: TokenChunk) -> bool:
        """True when `chunk` is the next one to hand out; False for a repeat.

        A repeated final chunk still marks the stream finished: a reader resuming after the
        last chunk it saw has nothing left to wait for. A session's earlier turn ended
        before this one began: its final chunk does not.
        """
        if chunk.seq < self.next_seq:
            self.finished = self.finished or (chunk.is_last and chunk.turn >= self.turn)
            return False
        if chunk.seq > self.next_seq:
            raise SeqGapError(
                f"request {self.request_id}: expected chunk seq {self.next_seq}, got {chunk.seq}"
            )
        self.next_seq += 1
        self.finished = chunk.is_last
        return True


def _parse_id(entry_id: bytes | str) -> StreamId:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _format_id(stream_id: StreamId) -> str:
    return f"{stream_id[0]}-{stream_id[1]}"


def _decode_chunk(fields: dict[bytes, bytes]) -> TokenChunk | SchemaError:
    try:
        return TokenChunk.decode(fields.get(b"data"))
    except SchemaError as e:
        return e


@dataclass(eq=False)
class Subscription:
    """One reader of one response stream: its queue and the last entry id it was given."""

    key: str
    queue: asyncio.Queue[TokenChunk | Exception] = field(default_factory=asyncio.Queue)
    last_id: StreamId = (0, 0)


class ResponseReader:
    """One task reading every awaited response stream with a single blocking connection."""

    def __init__(
        self,
        blocking_redis: aioredis.Redis,
        command_redis: aioredis.Redis,
        block_ms: int = DEFAULT_BLOCK_MS,
    ) -> None:
        self._redis = blocking_redis
        self._command_redis = command_redis
        self._block_ms = block_ms
        self._subs: dict[str, list[Subscription]] = {}
        reader_id = uuid.uuid4().hex
        self.wake_key = keys.wake(reader_id)
        # A key only this reader writes: finding it missing means Redis lost its data.
        self.marker_key = keys.reader(reader_id)
        self._marker_written = False
        self._next_marker_check = 0.0
        self._wake_id: StreamId = (0, 0)
        # A wake entry was sent since the reader last chose its streams: later subscribers
        # are picked up by that same wake-up, so a burst of subscribes sends one entry.
        self._wake_sent = False
        self._task: asyncio.Task[None] | None = None

    @property
    def num_subscriptions(self) -> int:
        return sum(len(subs) for subs in self._subs.values())

    def start(self) -> None:
        """Start the reader task (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="kvrail-response-reader")

    async def stop(self) -> None:
        """Stop the reader task; subscriptions stay and get nothing more."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def subscribe(self, key: str) -> Subscription:
        """Register a reader of `key` from its first entry and wake the blocked XREAD."""
        self.start()
        sub = Subscription(key)
        self._subs.setdefault(key, []).append(sub)
        if self._wake_sent:
            return sub
        self._wake_sent = True
        try:
            async with self._command_redis.pipeline(transaction=False) as pipe:
                pipe.xadd(self.wake_key, {"k": key}, maxlen=WAKE_MAXLEN, approximate=True)
                pipe.expire(self.wake_key, WAKE_TTL_S)
                await pipe.execute()
        except redis.RedisError as e:
            # The wake only cuts the reader's BLOCK short: its next XREAD reads `key` all the
            # same, the first once Redis answers again. Raising failed the stream of a request
            # accepted just before Redis stopped (reliability scenario 2a, under load).
            self._wake_sent = False
            logger.warning("response reader: wake failed (%s); %s is read after the BLOCK", e, key)
        except BaseException:
            # The caller never gets `sub` to unsubscribe: drop it here, or it leaks.
            self._wake_sent = False
            self.unsubscribe(sub)
            raise
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Forget `sub`; its stream is dropped from the next XREAD when nobody else reads it."""
        subs = self._subs.get(sub.key, [])
        if sub in subs:
            subs.remove(sub)
        if not subs:
            self._subs.pop(sub.key, None)

    def _streams_to_read(self) -> dict[str, StreamId]:
        # Per stream, read from the id of its least advanced subscriber; the others skip
        # what they already have (see `_dispatch`).
        self._wake_sent = False
        streams = {self.wake_key: self._wake_id}
        for key, subs in self._subs.items():
            streams[key] = min(sub.last_id for sub in subs)
        return streams

    async def _run(self) -> None:
        delay = _RECONNECT_DELAY_S
        while True:
            read_from = self._streams_to_read()
            try:
                if time.monotonic() >= self._next_marker_check:
                    await self._check_marker()
                reply = await self._redis.xread(
                    {key: _format_id(start) for key, start in read_from.items()},
                    count=_READ_COUNT,
                    block=self._block_ms,
                )
            except redis.RedisError as e:  # connection loss, or a foreign key of the wrong type
                logger.warning("response reader: XREAD failed (%s); retrying in %g s", e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RECONNECT_DELAY_MAX_S)
                self._next_marker_check = 0.0  # first thing once Redis answers again
                continue
            delay = _RECONNECT_DELAY_S
            for raw_key, entries in reply or []:
                key = raw_key.decode()
                if key == self.wake_key:
                    self._wake_id = _parse_id(entries[-1][0])
                else:
                    self._dispatch(key, read_from[key], entries)

    async def _check_marker(self) -> None:
        """Write the reader's marker; if an earlier write of it is gone, Redis restarted
        empty, so every awaited stream fails now with `RedisDataLost` instead of waiting
        for a chunk that will never come. Checked every `_MARKER_CHECK_S` and after errors
        (redis-py may reconnect inside a command without raising)."""
        old = await self._command_redis.set(self.marker_key, b"1", ex=_MARKER_TTL_S, get=True)
        if old is None and self._marker_written:
            logger.error("Redis lost its data; failing %d awaited streams", self.num_subscriptions)
            error = RedisDataLost("Redis restarted without its data: the request was lost")
            for subs in self._subs.values():
                for sub in subs:
                    sub.queue.put_nowait(error)
        self._marker_written = True
        self._next_marker_check = time.monotonic() + _MARKER_CHECK_S

    def _dispatch(
        self, key: str, read_from: StreamId, entries: list[tuple[bytes, dict[bytes, bytes]]]
    ) -> None:
        for entry_id, fields in entries:
            parsed_id = _parse_id(entry_id)
            chunk = _decode_chunk(fields)
            for sub in self._subs.get(key, []):
                # A subscriber that joined while this XREAD was in flight may lack entries
                # before `read_from`: it waits for the next read, which starts at its id.
                if read_from <= sub.last_id < parsed_id:
                    sub.last_id = parsed_id
                    sub.queue.put_nowait(chunk)


class KvrailClient:
    """Asyncio producer client: `submit`, `stream`, `abort`, `workers`, `backlog`, `ping`,
    sessions (`session`, and under it `session_history`, `submit_turn`),
    the SSE shape of a streaming request (`save_sse_shape`, `sse_shape`) and who reads it
    (`hold_reader`, `unread_in`).

    Use as `async with KvrailClient(url) as client:`; `aclose()` stops the reader and closes
    the connections.
    """

    def __init__(
        self,
        redis_url: str,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        chunk_timeout_s: float = DEFAULT_CHUNK_TIMEOUT_S,
        block_ms: int = DEFAULT_BLOCK_MS,
    ) -> None:
        # A blocking pool waits for a free connection instead of raising MaxConnectionsError
        # when a burst of requests submits at once.
        pool = aioredis.BlockingConnectionPool.from_url(
            redis_url,
            max_connections=max_connections,
            timeout=10,
            protocol=2,
            socket_timeout=5.0,
            socket_connect_timeout=5.0,
            health_check_interval=30,
        )
        self.redis = aioredis.Redis(connection_pool=pool)
        self._blocking_redis = connect(redis_url, blocking=True)
        self.reader = ResponseReader(self._blocking_redis, self.redis, block_ms)
        self.chunk_timeout_s = chunk_timeout_s
        self._hold_reader = self.redis.register_script(_HOLD_READER)
        self._unread_in = self.redis.register_script(_UNREAD_IN)
        self._submit_turn = self.redis.register_script(_SUBMIT_TURN)

    async def __aenter__(self) -> KvrailClient:
        self.reader.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the reader and close both connection pools."""
        await self.reader.stop()
        await self._blocking_redis.aclose()
        await self.redis.aclose()

    async def submit(self, request: GenerateRequest) -> str:
        """Validate and append `request` to the request stream (never trimmed: a trim could
        drop entries still pending); returns its request id."""
        request.validate()
        await self.redis.xadd(keys.requests, {"data": request.encode()})
        return request.request_id

    async def stream(
        self,
        request_id: str,
        after_seq: int = -1,
        *,
        reply_to: str | None = None,
        timeout_s: float | None = None,
        turn: int = 0,
    ) -> AsyncIterator[TokenChunk]:
        """Yield the chunks of `request_id` after `after_seq`, in seq order, once each.

        Ends after the final chunk (or at once when the final chunk is at or before
        `after_seq`); of a session, after the final chunk of `turn`. Raises `SeqGapError` on
        a missing seq, `StreamTimeout` when no chunk arrives within `timeout_s` (default: the
        client's), `SchemaError` on a bad entry.
        """
        timeout_s = self.chunk_timeout_s if timeout_s is None else timeout_s
        sub = await self.reader.subscribe(reply_to or keys.response(request_id))
        tracker = SeqTracker(request_id, after_seq, turn)
        try:
            while not tracker.finished:
                try:
                    item = await asyncio.wait_for(sub.queue.get(), timeout_s)
                except TimeoutError:
                    raise StreamTimeout(
                        f"request {request_id}: no chunk for {timeout_s:g} s"
                    ) from None
                if isinstance(item, Exception):
                    raise item
                if tracker.accept(item):
                    yield item
        finally:
            self.reader.unsubscribe(sub)

    async def session_history(self, session_id: str) -> SessionHistory:
        """What the session's response stream holds (`queueing.schema.session_history`);
        raises SchemaError for a stream that is not a session's."""
        return session_history(await read_response(self.redis, keys.response(session_id)))

    async def submit_turn(self, request: GenerateRequest) -> None:
        """Validate and submit a session's turn (`GenerateRequest.turn`), only if it is the
        turn after the last one submitted; raises `SessionError` if not, or if the session is
        closed."""
        request.validate()
        rid = request.request_id
        submitted, last = await self._submit_turn(
            keys=[keys.request_state(rid), keys.requests, keys.readers(rid)],
            args=[request.turn, request.encode(), REQUEST_STATE_TTL_S],
        )
        if submitted == -1:
            raise SessionError(f"session {request.request_id!r} is closed")
        if not submitted:
            raise SessionError(
                f"turn {request.turn} is not the next turn of session {request.request_id!r}: "
                f"the last one submitted is {last}"
            )

    def session(self, session_id: str) -> Session:
        """A streaming-input session (new, or begun by any client) to send turns to."""
        return Session(self, session_id)

    async def save_sse_shape(self, request_id: str, shape: str, ttl_s: int) -> None:
        """Keep how `request_id`'s SSE response is shaped (JSON), for a client resuming it."""
        await self.redis.set(keys.sse(request_id), shape, ex=ttl_s)

    async def sse_shape(self, request_id: str) -> bytes | None:
        """The shape saved by `save_sse_shape`; None when unknown or expired."""
        return await self.redis.get(keys.sse(request_id))

    async def hold_reader(
        self, request_id: str, reader: str, ttl_s: int, grace_s: float | None = None
    ) -> None:
        """Record that `reader` follows `request_id`'s response: while it is connected
        (`grace_s` None), or, once it has left, for `grace_s` more seconds. The record lives
        `ttl_s` (at least the grace); a worker holding the request renews it."""
        grace_ms = -1 if grace_s is None else round(grace_s * 1000)
        await self._hold_reader(
            keys=[keys.readers(request_id)],
            args=[reader, grace_ms, max(ttl_s * 1000, grace_ms)],
        )

    async def unread_in(self, request_id: str) -> float | None:
        """Seconds until `request_id` has no reader (0: none now, none due back); None when
        there is nothing to decide: the request is done, or a reader is connected."""
        ms = await self._unread_in(keys=[keys.readers(request_id), keys.request_state(request_id)])
        return None if ms < 0 else ms / 1000

    async def ping(self) -> None:
        """Raise the Redis error unless Redis answers."""
        await self.redis.ping()

    async def abort(self, request_id: str) -> None:
        """Broadcast an Abort on the control stream and mark the request aborted."""
        state_key = keys.request_state(request_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(
                keys.control,
                {"data": Abort(request_id).encode()},
                maxlen=CONTROL_MAXLEN,
                approximate=True,
            )
            pipe.hset(state_key, "aborted", 1)
            pipe.expire(state_key, REQUEST_STATE_TTL_S)
            await pipe.execute()

    async def workers(self) -> list[WorkerInfo]:
        """The workers whose heartbeat key is alive (undecodable heartbeats are skipped)."""
        names = [k async for k in self.redis.scan_iter(match=keys.worker("*"), count=1000)]
        if not names:
            return []
        return _decode_workers(await self.redis.mget(names))

    async def backlog(self) -> int:
        """Requests not yet finished by a worker: undelivered plus delivered-but-unacked.

        On Redis < 7 the undelivered part is counted by XRANGE, capped at `_BACKLOG_COUNT_CAP`.
        """
        try:
            groups = await self.redis.xinfo_groups(keys.requests)
        except redis.ResponseError:  # no request stream yet
            return 0
        group = next((g for g in groups if g["name"] == keys.group.encode()), None)
        if group is None:  # no worker ever joined: everything is undelivered
            return await self.redis.xlen(keys.requests)
        undelivered = group.get("lag")
        if undelivered is None:  # Redis < 7, or lag unknown after a trim
            undelivered = await self._count_after(group["last-delivered-id"])
        return int(group["pending"]) + int(undelivered)

    async def _count_after(self, last_delivered_id: bytes) -> int:
        entries = await self.redis.xrange(
            keys.requests, min=b"(" + last_delivered_id, count=_BACKLOG_COUNT_CAP
        )
        return len(entries)


class Session:
    """One streaming-input session (`KvrailClient.session`): `send` submits its next turn and
    yields that turn's chunks, numbered on from the turns before (one `seq` sequence). Its
    state is Redis's (the turns' chunks), read at each turn, so any client may continue it."""

    def __init__(self, client: KvrailClient, session_id: str) -> None:
        self.client = client
        self.session_id = session_id

    async def send(
        self,
        *,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        sampling: dict[str, Any] | None = None,
        resumable: bool = True,
        timeout_s: float | None = None,
    ) -> AsyncIterator[TokenChunk]:
        """Send the next turn and yield its chunks until its last. Its prompt follows
        everything so far (`messages`: the new ones only, templated by the worker as a
        continuation); `resumable=False` closes the session once this turn ends. Raises
        `SessionError` when the session cannot take a turn now."""
        history = await self.client.session_history(self.session_id)
        if history.failed:
            raise SessionError(f"session {self.session_id!r} is closed")
        if not history.ended:
            raise SessionError(f"turn {history.num_turns - 1} of {self.session_id!r} is running")
        request = GenerateRequest(
            self.session_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            messages=messages,
            sampling=sampling or {},
            turn=history.num_turns,
            resumable=resumable,
        )
        await self.client.submit_turn(request)
        turns = self.client.stream(
            self.session_id, history.last_seq, timeout_s=timeout_s, turn=request.turn
        )
        async for chunk in turns:
            yield chunk


def _decode_workers(values: list[bytes | None]) -> list[WorkerInfo]:
    workers = []
    for value in values:
        if value is None:  # expired between SCAN and MGET
            continue
        try:
            workers.append(WorkerInfo.decode(value))
        except SchemaError as e:
            logger.warning("skipping a bad worker heartbeat: %s", e)
    return workers
