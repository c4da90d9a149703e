"""Delivery: which stream entry a worker serves, resumes, or answers without generating.

`kvrail:req:{id}` records which stream entry owns a request id (docs/architecture.md). Another
entry with the same id is a duplicate: acknowledged without generating. The owning entry read again
(claimed from a dead worker, or pending at restart) resumes: the chunks already stored give
each choice's emitted tokens, the engine recomputes them, `seq` continues after the last. An
entry that will not be generated is rejected: an error chunk where there is a `Reply` to send
it to, a dead letter when the entry itself is bad, or when it was delivered more often than
`max_deliveries` (a worker lost with it each time: the entry is what brings them down).

A session's turns are owned one by one (de-duplication per request id and turn) and share
its response stream, which holds the whole conversation in tokens (each turn's first chunk
carries the turn's prompt): a later turn reaches the engine with that history, so a worker
that does not hold the session (it died, another worker served the turn before) recomputes
it, and one that does continues it in place (`EngineThread`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError, ResponseError

from queueing import streams
from queueing.schema import (
    MAX_ID_LEN,
    MAX_MESSAGE_BYTES,
    GenerateRequest,
    SchemaError,
    SessionHistory,
    TokenChunk,
    keys,
    session_history,
    unpack_bounded,
)
from service import metrics
from service.engine_thread import EngineThread, ResumeState
from service.publisher import Batch, Publisher

log = structlog.get_logger("kvrail.worker")
# Entries larger than this are decoded on a thread: a 4 MiB one took the event loop 1.6 s
# (issue 12), stalling every stream the worker serves.
OFF_LOOP_DECODE_BYTES = 256 << 10


@dataclass
class Inflight:
    """A request this worker holds, from ingest until its final chunk is queued."""

    entry_id: str
    data: bytes
    request: GenerateRequest
    log: structlog.stdlib.BoundLogger
    enqueued_s: float  # when the producer XADDed it (from the entry id)
    next_seq: int = 0
    completion_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the engine found in the prefix cache
    last_token_s: float | None = None  # None until the first token (or resumed)
    deadline_hit: bool = False
    # A session's turn whose first chunk is still due, carrying the turn's prompt: the
    # tokens of the history before it (None: not a session, or that chunk is stored)
    num_history_tokens: int | None = None

    def chunk(self, **fields: object) -> TokenChunk:
        """The next chunk of this request (of a session: of its turn), numbered in order."""
        turn = self.request.turn
        chunk = TokenChunk(self.request.request_id, self.next_seq, turn=turn, **fields)
        self.next_seq += 1
        return chunk


@dataclass(frozen=True)
class Reply:
    """Where a rejected entry's error chunk goes: its request's response stream, numbered
    after the chunks already stored there."""

    request_id: str
    response_key: str
    seq: int
    turn: int = 0  # of a session


class Delivery:
    """Turns request-stream entries into engine work (`EngineThread.add`) or into answers."""

    def __init__(
        self,
        r: aioredis.Redis,
        consumer: streams.RequestConsumer,
        publisher: Publisher,
        engine_thread: EngineThread,
        inflight: dict[str, Inflight],
        response_ttl_s: int,
        max_deliveries: int,
        model_name: str,
    ) -> None:
        self.r = r
        self.consumer = consumer
        self.publisher = publisher
        self.engine_thread = engine_thread
        self.inflight = inflight  # request_id -> state, shared with the worker
        self.response_ttl_s = response_ttl_s
        self.max_deliveries = max_deliveries
        self.model_name = model_name  # the metrics' label

    async def ingest(self, entry: streams.Entry) -> None:
        """Serve one entry. A Redis error propagates (the entry stays pending and is claimed
        again), unless it is the entry's own: a key of the wrong type (`WRONGTYPE`), which
        no retry mends (issue 12: such an entry restarted the ingest loop forever, and the
        good requests read with it got no answer). Any other fault answers the entry as a
        bad one."""
        entry_id, data, _ = entry
        try:
            await self._ingest(entry)
        except ResponseError as e:
            if not str(e).startswith("WRONGTYPE"):
                raise
            log.warning("request entry meets a key of the wrong type", entry_id=entry_id)
            self.reject(entry_id, data, f"redis error: {e}")
        except RedisError:
            raise
        except Exception as e:
            # A fault on one entry (say a corrupt response stream) must not wedge the loop
            # on it: answer it as a bad entry.
            log.exception("request entry could not be served", entry_id=entry_id)
            self.reject(entry_id, data, f"worker error: {e}")

    async def _ingest(self, entry: streams.Entry) -> None:
        """Turn one stream entry into engine work, a resume, a duplicate ack or an error."""
        entry_id, data, deliveries = entry
        if any(f.entry_id == entry_id for f in self.inflight.values()):
            return  # already serving it (claimed back from ourselves)
        if data is None:
            log.warning("request entry was trimmed before it was served", entry_id=entry_id)
            await self.consumer.ack(entry_id)
            return
        if not data:
            await self._reject_undecodable(entry_id, data, "entry has no 'data' field")
            return
        try:
            if len(data) > OFF_LOOP_DECODE_BYTES:  # a large prompt: keep the loop responsive
                request = await asyncio.to_thread(GenerateRequest.decode, data)
            else:
                request = GenerateRequest.decode(data)
        except SchemaError as e:
            await self._reject_undecodable(entry_id, data, str(e))
            return
        rid = request.request_id
        rlog = log.bind(request_id=rid, entry_id=entry_id, turn=request.turn)
        owner, aborted = await streams.own_request(
            self.r, rid, entry_id, self.response_ttl_s, request.turn
        )
        if owner != entry_id:
            # Same id in another entry: that one is answered (or being answered) on the same
            # response stream, so this one is never generated twice.
            rlog.info("duplicate request id, acknowledged without generating", owner=owner)
            await self.consumer.ack(entry_id)
            return
        key = request.response_key
        # A write retried after a lost reply can store a chunk twice: one per seq counts.
        chunks = list({c.seq: c for c in await streams.read_response(self.r, key)}.values())
        mine = [c for c in chunks if c.turn == request.turn] if request.is_session else chunks
        if any(c.is_last for c in mine):
            rlog.info("already answered in full")
            batch = Batch(acks=[entry_id])
            if request.resumable and not session_history(chunks).failed:
                batch.waiting.append(rid)  # the session waits for its next turn
            else:
                batch.done.append(rid)
            self.publisher.put(batch)
            return
        reply = Reply(rid, key, chunks[-1].seq + 1 if chunks else 0, request.turn)
        if deliveries > self.max_deliveries:
            # Each delivery after the first took a worker lost (or stopped) while it held the
            # entry, or an ingest that failed on it: past the limit, the entry is the cause
            # (issue 12: a poison entry was delivered 11 times in 45 s, never dead-lettered).
            reason = f"delivered {deliveries} times (limit {self.max_deliveries})"
            self.reject(entry_id, data, reason, reply)
            return
        if [c.seq for c in chunks] != list(range(len(chunks))):
            # Trimmed or expired: the emitted tokens are unknown, so it cannot resume.
            self.reject(entry_id, data, "response stream lost chunks", reply)
            return
        if request.deadline_ms is not None and request.deadline_ms < time.time() * 1000:
            self.reject(entry_id, data, "deadline exceeded", reply, dead_letter=False)
            return
        if aborted:
            # The client aborted before any worker held the request (or its worker died).
            self.reject(entry_id, data, "aborted", reply, dead_letter=False)
            return
        history = None
        if request.is_session:
            try:
                session = session_history(chunks)
            except SchemaError as e:
                self.reject(entry_id, data, f"request_id {rid!r} is not a session: {e}", reply)
                return
            problem = _turn_problem(request, session, await streams.request_state(self.r, rid))
            if problem is not None:
                # No error chunk while a turn may still write to the stream.
                self.reject(entry_id, data, problem, reply if session.ended else None)
                return
            if request.turn > 0:
                await streams.mark_done(self.r, [rid], self.response_ttl_s, "running")
            history = session.token_ids
        inflight = Inflight(entry_id, data, request, rlog, _entry_time(entry_id), reply.seq)
        if request.is_session and not mine:
            inflight.num_history_tokens = len(history)
        resume = _resume_state(mine) if mine else None
        if resume is not None:
            inflight.completion_tokens = sum(len(t) for t in resume.token_ids.values())
            inflight.last_token_s = time.time()  # no time-to-first-token for a resumed request
            rlog.info("resuming", next_seq=inflight.next_seq, emitted=inflight.completion_tokens)
        else:
            queued_s = max(0.0, time.time() - inflight.enqueued_s)
            metrics.request_queue_time_seconds.labels(self.model_name).observe(queued_s)
        self.inflight[rid] = inflight
        self.engine_thread.add(request, resume, history or None)

    def reject(
        self,
        entry_id: str,
        data: bytes | None,
        reason: str,
        reply: Reply | None = None,
        *,
        dead_letter: bool = True,
    ) -> None:
        """Answer an entry that will not be generated: an error chunk when there is a `reply`
        to send it to, a dead letter for a bad entry, then XACK once that is stored."""
        log.warning("request rejected", entry_id=entry_id, reason=reason)
        batch = Batch(acks=[entry_id])
        if dead_letter:
            batch.dead.append((entry_id, data, reason))
        if reply is not None:
            error = TokenChunk(
                reply.request_id, reply.seq, finish_reason="error", error=reason, turn=reply.turn
            )
            batch.add_chunk(reply.response_key, error, entry_id, data)
            batch.done.append(reply.request_id)
        self.publisher.put(batch)

    async def _reject_undecodable(self, entry_id: str, data: bytes, reason: str) -> None:
        """A schema error: the client still gets an error chunk on the default response
        stream when the request id is readable and no other entry owns it."""
        rid = _peek_request_id(data)
        reply = None
        if rid is not None:
            owner, _ = await streams.own_request(self.r, rid, entry_id, self.response_ttl_s)
            if owner == entry_id:
                key = keys.response(rid)
                reply = Reply(rid, key, await self.r.xlen(key))
        self.reject(entry_id, data, reason, reply)


def _turn_problem(
    request: GenerateRequest, session: SessionHistory, state: str | None
) -> str | None:
    """Why a session's turn cannot be served now, if it cannot: the session is closed, or
    the turn is not the next one (its own chunks, when stored, are of a turn to resume)."""
    rid, turn = request.request_id, request.turn
    if session.failed or (turn > 0 and state == "done"):
        return f"session {rid!r} is closed"
    if session.num_turns == turn + 1 and not session.ended:
        return None  # this turn, begun by a worker that is gone: resume it
    if session.num_turns == turn and session.ended:
        return None
    if not session.ended:
        return f"turn {turn} of session {rid!r}: turn {session.num_turns - 1} has not ended"
    return f"turn {turn} of session {rid!r} is not its next turn ({session.num_turns})"


def _entry_time(entry_id: str) -> float:
    """The XADD time of a stream entry, in unix seconds (the id's millisecond part)."""
    return int(entry_id.split("-", 1)[0]) / 1000


def _resume_state(chunks: list[TokenChunk]) -> ResumeState:
    state = ResumeState()
    for c in chunks:
        state.token_ids.setdefault(c.index, []).extend(c.token_ids)
        if c.finish_reason is not None:
            state.finished.add(c.index)
    return state


def _peek_request_id(data: bytes) -> str | None:
    """The request id of an entry that failed to decode, when it is readable and sane; never
    for one over the size limit (decoding it could allocate without bound)."""
    if len(data) > MAX_MESSAGE_BYTES:
        return None
    try:
        obj = unpack_bounded(data)
    except Exception:
        return None
    rid = obj.get("request_id") if isinstance(obj, dict) else None
    if isinstance(rid, str) and 0 < len(rid) <= MAX_ID_LEN and rid.isprintable() and " " not in rid:
        return rid
    return None
