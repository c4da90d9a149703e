"""`kvrail worker`: serves `kvrail:requests` with one `LLMEngine`.

Tasks on one asyncio loop (uvloop in production):
    ingest     XREADGROUP (own pending first, then new) and XAUTOCLAIM of dead workers' entries
               -> decode -> de-duplicate / resume -> `AddCommand` to the engine thread
    control    XREAD `kvrail:control` -> abort requests this worker holds
    heartbeat  `kvrail:worker:{name}` with a short TTL; keeps held entries from going idle
               (so no live request is claimed away); enforces deadlines; refreshes gauges
    publish    engine events -> TokenChunks (per-request `seq`) -> pipelined XADD, then XACK
               and mark the request done, only once its final chunk is stored

Delivery (design.md): `kvrail:req:{id}` records which stream entry owns a request id. Another
entry with the same id is a duplicate: acknowledged without generating. The owning entry read
again (claimed from a dead worker, or pending at restart) resumes: the chunks already stored
give each choice's emitted tokens, the engine recomputes them, `seq` continues after the last.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from dataclasses import dataclass, field

import msgpack
import structlog
from redis.exceptions import RedisError

from engine import LLMEngine, RequestOutput, envs
from engine.loader import served_model_name
from engine.scheduler import SchedulerStats
from queueing import streams
from queueing.schema import (
    MAX_ID_LEN,
    Abort,
    GenerateRequest,
    SchemaError,
    TokenChunk,
    WorkerInfo,
    keys,
)
from service import metrics
from service.engine_thread import (
    STOP,
    AbortCommand,
    AddCommand,
    EngineEvent,
    EngineThread,
    RequestAborted,
    RequestFailed,
    ResumeState,
)

log = structlog.get_logger("kvrail.worker")

HEARTBEAT_TTL_S = 5
RETRY_MIN_S = 0.05  # backoff between attempts while Redis is unreachable
RETRY_MAX_S = 2.0


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
    last_token_s: float | None = None  # None until the first token (or resumed)
    deadline_hit: bool = False

    def chunk(self, **fields: object) -> TokenChunk:
        """The next chunk of this request, numbered in order."""
        chunk = TokenChunk(request_id=self.request.request_id, seq=self.next_seq, **fields)
        self.next_seq += 1
        return chunk


@dataclass
class Batch:
    """Work for the publisher: chunks first, then acks, dead letters and done marks."""

    chunks: list[tuple[str, TokenChunk]] = field(default_factory=list)
    acks: list[str] = field(default_factory=list)
    dead: list[tuple[str, bytes | None, str]] = field(default_factory=list)
    done: list[str] = field(default_factory=list)  # request ids answered in full


@dataclass
class WorkerStats:
    num_blocks_in_use: int
    kv_cache_usage: float
    num_running: int
    num_waiting: int
    running_ids: list[str]  # request ids held by this worker (not yet finally answered)
    num_added: int  # requests handed to the engine since start


class Worker:
    """One engine serving the request stream. `run()` until `stop()` (or SIGTERM via
    `run_worker`); unfinished requests are then left pending for another worker."""

    def __init__(
        self,
        engine: LLMEngine,
        redis_url: str,
        name: str | None = None,
        *,
        model_name: str | None = None,
        claim_idle_ms: int | None = None,
        shutdown_grace_s: float | None = None,
        response_ttl_s: int | None = None,
        read_block_ms: int = 1000,
        max_inflight: int = 256,
    ) -> None:
        self.name = name or envs.KVRAIL_WORKER_NAME or f"{socket.gethostname()}-{os.getpid()}"
        model = engine.config.model
        self.model_name = model_name or served_model_name(model)
        self.max_model_len = engine.max_model_len
        self.claim_idle_ms = claim_idle_ms or envs.KVRAIL_CLAIM_IDLE_MS
        self.shutdown_grace_s = (
            envs.KVRAIL_SHUTDOWN_GRACE_S if shutdown_grace_s is None else shutdown_grace_s
        )
        self.response_ttl_s = response_ttl_s or envs.KVRAIL_RESPONSE_TTL_S
        self.max_inflight = max_inflight
        # Held entries are touched several times per claim window, so a live worker's long
        # request never looks idle to another worker's XAUTOCLAIM.
        self.tick_s = min(1.0, self.claim_idle_ms / 4000)
        self.r = streams.connect(redis_url)
        self.r_blocking = streams.connect(redis_url, blocking=True)
        self.consumer = streams.RequestConsumer(
            self.r_blocking, self.r, self.name, block_ms=read_block_ms
        )
        self.publisher = streams.ResponsePublisher(self.r, self.response_ttl_s)
        self.engine_thread = EngineThread(engine, self._emit)
        self.inflight: dict[str, Inflight] = {}  # request_id -> state
        self._batches: asyncio.Queue[Batch | None] = asyncio.Queue()
        self._stopping = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started_ms = int(time.time() * 1000)
        self._last_stats = self.engine_thread.stats
        # Gauges read the engine's latest snapshot at scrape time, not at the last tick.
        metrics.num_requests_running.set_function(lambda: self.engine_thread.stats.num_running_reqs)
        metrics.num_requests_waiting.set_function(lambda: self.engine_thread.stats.num_waiting_reqs)
        metrics.kv_cache_usage_perc.set_function(lambda: self.engine_thread.stats.kv_cache_usage)

    # ---- lifecycle -----------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until `stop()`: then drain within the grace period and leave the rest."""
        self._loop = asyncio.get_running_loop()
        await streams.ensure_group(self.r)
        self.engine_thread.start()
        log.info("worker started", worker=self.name, model=self.model_name)
        ingest = asyncio.create_task(self._supervise("ingest", self._ingest_loop))
        side_tasks = [
            asyncio.create_task(self._supervise("control", self._control_loop)),
            asyncio.create_task(self._supervise("heartbeat", self._heartbeat_loop)),
        ]
        publish = asyncio.create_task(self._publish_loop())
        try:
            await self._stopping.wait()
        finally:
            await self._shutdown(ingest, side_tasks, publish)

    def stop(self, grace_s: float | None = None) -> None:
        """Stop reading new entries; in-flight requests get `grace_s` (default
        KVRAIL_SHUTDOWN_GRACE_S) to finish. Call on the worker's loop (signal handlers are)."""
        if grace_s is not None:
            self.shutdown_grace_s = grace_s
        self._stopping.set()

    async def _shutdown(self, ingest: asyncio.Task, side_tasks: list, publish: asyncio.Task):
        ingest.cancel()
        await asyncio.gather(ingest, return_exceptions=True)
        deadline = time.monotonic() + self.shutdown_grace_s
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        left = sorted(self.inflight)
        # Abort what is left without acking: the entries stay pending, another worker
        # claims them and resumes from the chunks already stored.
        self.engine_thread.submit(STOP)
        await asyncio.to_thread(self.engine_thread.join)
        await asyncio.sleep(0)  # let the engine's last events (call_soon_threadsafe) land
        self.inflight.clear()
        self._batches.put_nowait(None)
        await publish
        for task in side_tasks:
            task.cancel()
        await asyncio.gather(*side_tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.r.delete(keys.worker(self.name))
        await self.r_blocking.aclose()
        await self.r.aclose()
        log.info("worker stopped", worker=self.name, left_pending=left)

    async def _supervise(self, name: str, loop_fn) -> None:
        """Run one of the worker's loops; a Redis hiccup restarts it (with backoff) instead of
        ending it."""
        delay = RETRY_MIN_S
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                await loop_fn()
            except asyncio.CancelledError:
                raise
            except Exception:
                if time.monotonic() - started > RETRY_MAX_S:
                    delay = RETRY_MIN_S  # it had recovered: a new outage starts short again
                log.exception("worker task failed, restarting", task=name, delay_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)

    def stats(self) -> WorkerStats:
        s = self.engine_thread.stats
        return WorkerStats(
            num_blocks_in_use=s.num_blocks_in_use,
            kv_cache_usage=s.kv_cache_usage,
            num_running=s.num_running_reqs,
            num_waiting=s.num_waiting_reqs,
            running_ids=sorted(self.inflight),
            num_added=self.engine_thread.num_added,
        )

    # ---- ingest --------------------------------------------------------------------------

    async def _ingest_loop(self) -> None:
        next_claim = 0.0
        while not self._stopping.is_set():
            while len(self.inflight) >= self.max_inflight:
                # Leave entries in the stream for other workers rather than queueing here.
                await asyncio.sleep(0.05)
            if time.monotonic() >= next_claim:
                next_claim = time.monotonic() + self.claim_idle_ms / 2000
                for entry_id, data in await self.consumer.claim_stale(self.claim_idle_ms):
                    await self._ingest_one(entry_id, data)
            for entry_id, data in await self.consumer.read():
                await self._ingest_one(entry_id, data)

    async def _ingest_one(self, entry_id: str, data: bytes | None) -> None:
        try:
            await self._ingest(entry_id, data)
        except RedisError:
            raise  # the loop restarts; the entry stays pending and is claimed again
        except Exception as e:
            # A fault on one entry (say a corrupt response stream) must not wedge the loop
            # on it: answer it as a bad entry.
            log.exception("request entry could not be served", entry_id=entry_id)
            await self._reject(entry_id, data, f"worker error: {e}")

    async def _ingest(self, entry_id: str, data: bytes | None) -> None:
        """Turn one stream entry into engine work, a resume, a duplicate ack or an error."""
        if any(f.entry_id == entry_id for f in self.inflight.values()):
            return  # already serving it (claimed back from ourselves)
        if data is None:
            log.warning("request entry was trimmed before it was served", entry_id=entry_id)
            await self.consumer.ack(entry_id)
            return
        try:
            request = GenerateRequest.decode(data)
        except SchemaError as e:
            await self._reject_undecodable(entry_id, data, str(e))
            return
        rid = request.request_id
        rlog = log.bind(request_id=rid, entry_id=entry_id)
        owner, aborted = await streams.own_request(self.r, rid, entry_id, self.response_ttl_s)
        if owner != entry_id:
            # Same id in another entry: that one is answered (or being answered) on the same
            # response stream, so this one is never generated twice.
            rlog.info("duplicate request id, acknowledged without generating", owner=owner)
            await self.consumer.ack(entry_id)
            return
        key = request.response_key
        # A write retried after a lost reply can store a chunk twice: one per seq counts.
        chunks = list({c.seq: c for c in await streams.read_response(self.r, key)}.values())
        if any(c.is_last for c in chunks):
            rlog.info("already answered in full")
            self._batches.put_nowait(Batch(acks=[entry_id], done=[rid]))
            return
        next_seq = chunks[-1].seq + 1 if chunks else 0
        if [c.seq for c in chunks] != list(range(len(chunks))):
            # Trimmed or expired: the emitted tokens are unknown, so it cannot resume.
            await self._reject(entry_id, data, "response stream lost chunks", (rid, key, next_seq))
            return
        if request.deadline_ms is not None and request.deadline_ms < time.time() * 1000:
            await self._reject(entry_id, data, "deadline exceeded", (rid, key, next_seq), False)
            return
        if aborted:
            # The client aborted before any worker held the request (or its worker died).
            await self._reject(entry_id, data, "aborted", (rid, key, next_seq), False)
            return
        inflight = Inflight(entry_id, data, request, rlog, _entry_time(entry_id), next_seq)
        resume = _resume_state(chunks) if chunks else None
        if resume is not None:
            inflight.completion_tokens = sum(len(t) for t in resume.token_ids.values())
            inflight.last_token_s = time.time()  # no time-to-first-token for a resumed request
            rlog.info("resuming", next_seq=inflight.next_seq, emitted=inflight.completion_tokens)
        else:
            metrics.request_queue_time_seconds.observe(max(0.0, time.time() - inflight.enqueued_s))
        self.inflight[rid] = inflight
        self.engine_thread.submit(AddCommand(request, resume))

    async def _reject(
        self,
        entry_id: str,
        data: bytes | None,
        reason: str,
        reply: tuple[str, str, int] | None = None,
        dead_letter: bool = True,
    ) -> None:
        """Answer an entry that will not be generated: an error chunk when there is somewhere
        to send it (`reply` = request id, response key, next seq), a dead letter for a bad
        entry, then XACK once that is stored."""
        log.warning("request rejected", entry_id=entry_id, reason=reason)
        batch = Batch(acks=[entry_id])
        if dead_letter:
            batch.dead.append((entry_id, data, reason))
        if reply is not None:
            rid, key, seq = reply
            error = TokenChunk(rid, seq, finish_reason="error", error=reason)
            batch.chunks.append((key, error))
            batch.done.append(rid)
        self._batches.put_nowait(batch)

    async def _reject_undecodable(self, entry_id: str, data: bytes, reason: str) -> None:
        """A schema error: the client still gets an error chunk on the default response
        stream when the request id is readable and no other entry owns it."""
        rid = _peek_request_id(data)
        reply = None
        if rid is not None:
            owner, _ = await streams.own_request(self.r, rid, entry_id, self.response_ttl_s)
            if owner == entry_id:
                key = keys.response(rid)
                reply = (rid, key, await self.r.xlen(key))
        await self._reject(entry_id, data, reason, reply)

    # ---- control and heartbeat -----------------------------------------------------------

    async def _control_loop(self) -> None:
        """Abort requests named on `kvrail:control` that this worker holds."""
        last = await self.r.xrevrange(keys.control, count=1)
        last_id = last[0][0] if last else b"0-0"
        while not self._stopping.is_set():
            reply = await self.r_blocking.xread({keys.control: last_id}, block=1000)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last_id = entry_id
                    try:
                        rid = Abort.decode(fields.get(b"data")).request_id
                    except SchemaError as e:
                        log.warning("bad control message", reason=str(e))
                        continue
                    if rid in self.inflight:
                        self.inflight[rid].log.info("abort requested")
                        self.engine_thread.submit(AbortCommand(rid, "abort"))

    async def _heartbeat_loop(self) -> None:
        while not self._stopping.is_set():
            stats = self.engine_thread.stats
            info = self._worker_info(stats)
            await self.r.set(keys.worker(self.name), info.encode(), ex=HEARTBEAT_TTL_S)
            await self.consumer.touch([f.entry_id for f in self.inflight.values()])
            self._enforce_deadlines()
            self._update_counters(stats)
            await asyncio.sleep(self.tick_s)

    def _worker_info(self, stats: SchedulerStats) -> WorkerInfo:
        return WorkerInfo(
            name=self.name,
            model=self.model_name,
            max_model_len=self.max_model_len,
            started_ms=self._started_ms,
            heartbeat_ms=int(time.time() * 1000),
            num_running=stats.num_running_reqs,
            num_waiting=stats.num_waiting_reqs,
            kv_cache_usage=float(stats.kv_cache_usage),
        )

    def _enforce_deadlines(self) -> None:
        now_ms = time.time() * 1000
        for rid, f in self.inflight.items():
            deadline = f.request.deadline_ms
            if deadline is not None and deadline < now_ms and not f.deadline_hit:
                f.deadline_hit = True
                self.engine_thread.submit(AbortCommand(rid, "deadline"))

    def _update_counters(self, stats: SchedulerStats) -> None:
        prev, self._last_stats = self._last_stats, stats
        metrics.num_preemptions.inc(max(0, stats.num_preemptions - prev.num_preemptions))
        metrics.prefix_cache_queries.inc(
            max(0, stats.prefix_cache_queries - prev.prefix_cache_queries)
        )
        metrics.prefix_cache_hits.inc(max(0, stats.prefix_cache_hits - prev.prefix_cache_hits))

    # ---- engine events -> chunks ---------------------------------------------------------

    def _emit(self, event: EngineEvent) -> None:
        """Called on the engine thread: hop onto the loop."""
        with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
            self._loop.call_soon_threadsafe(self._on_event, event)

    def _on_event(self, event: EngineEvent) -> None:
        batch = Batch()
        if isinstance(event, RequestFailed):
            self._on_failed(event, batch)
        elif isinstance(event, RequestAborted):
            self._on_aborted(event, batch)
        else:
            for output in event:
                self._on_output(output, batch)
        if batch.chunks:
            self._batches.put_nowait(batch)

    def _on_output(self, output: RequestOutput, batch: Batch) -> None:
        f = self.inflight.get(output.request_id)
        if f is None:
            return
        key, now = f.request.response_key, time.time()
        num_new, last = 0, None
        for c in output.outputs:
            if not (c.token_ids or c.text or c.finish_reason):
                continue
            logprobs = None
            if c.logprobs is not None:
                logprobs = [[[t, lp.logprob] for t, lp in d.items()] for d in c.logprobs]
            prompt_logprobs = None
            if output.prompt_logprobs is not None and c.index == 0:
                # With choice 0's first token, in its chunk: a resume then knows from choice
                # 0's emitted tokens whether they were sent (see `LLMEngine.add_request`).
                prompt_logprobs = [
                    None if d is None else [[t, lp.logprob, lp.rank] for t, lp in d.items()]
                    for d in output.prompt_logprobs
                ]
            chunk = f.chunk(
                index=c.index,
                token_ids=list(c.token_ids),
                text=c.text,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            batch.chunks.append((key, chunk))
            num_new, last = num_new + len(c.token_ids), chunk
        if num_new:
            if f.last_token_s is None:
                metrics.time_to_first_token_seconds.observe(max(0.0, now - f.enqueued_s))
            else:
                metrics.inter_token_latency_seconds.observe(now - f.last_token_s)
            f.last_token_s = now
            f.completion_tokens += num_new
            metrics.generation_tokens.inc(num_new)
        if output.finished:
            if last is None:  # resumed with every choice done: only the usage chunk is due
                batch.chunks.append((key, f.chunk()))
            reason = last.finish_reason if last is not None else "stop"
            self._finish(f, batch, len(output.prompt_token_ids), reason)

    def _on_aborted(self, event: RequestAborted, batch: Batch) -> None:
        f = self.inflight.get(event.request_id)
        if f is None:
            return
        key = f.request.response_key
        if event.reason == "deadline":
            batch.chunks.append((key, f.chunk(finish_reason="error", error="deadline exceeded")))
        else:
            for index in event.open_indices or [0]:
                batch.chunks.append((key, f.chunk(index=index, finish_reason="abort")))
        self._finish(f, batch, event.prompt_tokens, event.reason)

    def _on_failed(self, event: RequestFailed, batch: Batch) -> None:
        f = self.inflight.pop(event.request_id, None)
        if f is None:
            return
        f.log.warning("request failed", reason=event.error)
        batch.chunks.append(
            (f.request.response_key, f.chunk(finish_reason="error", error=event.error))
        )
        if event.dead_letter:
            batch.dead.append((f.entry_id, f.data, event.error))
        batch.acks.append(f.entry_id)
        batch.done.append(event.request_id)

    def _finish(self, f: Inflight, batch: Batch, prompt_tokens: int, reason: str) -> None:
        """Put usage on the request's last chunk and schedule its XACK after it is stored."""
        batch.chunks[-1][1].usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": f.completion_tokens,
            "total_tokens": prompt_tokens + f.completion_tokens,
        }
        del self.inflight[f.request.request_id]
        batch.acks.append(f.entry_id)
        batch.done.append(f.request.request_id)
        metrics.prompt_tokens.inc(prompt_tokens)
        metrics.request_success.labels(finished_reason=reason).inc()
        metrics.e2e_request_latency_seconds.observe(max(0.0, time.time() - f.enqueued_s))
        f.log.info("request finished", reason=reason, completion_tokens=f.completion_tokens)

    # ---- publish -------------------------------------------------------------------------

    async def _publish_loop(self) -> None:
        """Write batches in order, merging whatever queued up meanwhile into one round trip.
        Ends at the `None` sentinel queued by shutdown."""
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
        steps = [("publish", lambda: self.publisher.publish(batch.chunks))]
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

    async def _retry(self, what: str, write) -> bool:
        """Run `write()` until it succeeds, backing off on Redis errors. Once the worker is
        stopping it gives up after one failure (returns False): its entries stay pending and
        whoever claims them resumes from the chunks that were stored."""
        delay = RETRY_MIN_S
        while True:
            try:
                await write()
                return True
            except RedisError:
                log.warning("redis write failed, retrying", step=what, delay_s=delay)
                if self._stopping.is_set():
                    return False
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)


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
    """The request id of an entry that failed to decode, when it is readable and sane."""
    try:
        obj = msgpack.unpackb(data, raw=False)
    except Exception:
        return None
    rid = obj.get("request_id") if isinstance(obj, dict) else None
    if isinstance(rid, str) and 0 < len(rid) <= MAX_ID_LEN and rid.isprintable() and " " not in rid:
        return rid
    return None
