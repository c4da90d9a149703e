"""`kvrail worker`: serves `kvrail:requests` with one `LLMEngine`.

Tasks on one asyncio loop (uvloop in production), each job in its own module:
    ingest     XREADGROUP (own pending first, then new) and XAUTOCLAIM of dead workers' entries,
               while the worker holds fewer than 2 x max_num_seqs requests (the rest waits in
               the stream for a worker with room)
               -> `service.delivery`: decode, de-duplicate / resume / reject -> `EngineThread.add`
    control    XREAD `kvrail:control` -> abort requests this worker holds
    heartbeat  `service.heartbeat`: `kvrail:worker:{name}` with a short TTL; keeps held entries
               from going idle (so no live request is claimed away); enforces deadlines;
               refreshes metrics
    publish    engine events -> `service.output_processor` -> TokenChunks (per-request `seq`)
               -> `service.publisher`: pipelined XADD, then XACK and mark the request done,
               only once its final chunk is stored

This module wires them together and owns the lifecycle: start, supervise (a loop that fails on
a Redis hiccup restarts with backoff), and a graceful stop that leaves unfinished requests
pending for another worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Awaitable, Callable

import structlog

from engine import LLMEngine
from queueing import streams
from queueing.schema import Abort, SchemaError, keys
from service.delivery import Delivery, Inflight
from service.engine_thread import EngineEvent, EngineThread
from service.heartbeat import Heartbeat
from service.output_processor import OutputProcessor
from service.publisher import RETRY_MAX_S, Backoff, Publisher
from service.settings import Settings, served_model_name

log = structlog.get_logger("kvrail.worker")


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
        max_inflight: int | None = None,
        settings: Settings | None = None,
    ) -> None:
        # Arguments win over `settings` (`kvrail worker` passes the process's, read once).
        settings = settings or Settings.from_env()
        self.name = name or settings.worker_name or f"{socket.gethostname()}-{os.getpid()}"
        self.model_name = model_name or served_model_name(engine.config.model)
        self.claim_idle_ms = claim_idle_ms or settings.claim_idle_ms
        self.shutdown_grace_s = (
            settings.shutdown_grace_s if shutdown_grace_s is None else shutdown_grace_s
        )
        response_ttl_s = response_ttl_s or settings.response_ttl_s
        # Entries held at once (read, not yet acknowledged): a full batch running and as many
        # waiting to join it; the rest stays in the stream for whichever worker has room.
        # Reading all it could, a worker of 2 sequences held ~20 requests after a Redis restart
        # while the other idled, and the last waited past its client's 30 s timeout (reliability
        # item 31).
        self.max_inflight = max_inflight or 2 * engine.config.max_num_seqs
        # Held entries are touched several times per claim window, so a live worker's long
        # request never looks idle to another worker's XAUTOCLAIM.
        self.tick_s = min(1.0, self.claim_idle_ms / 4000)
        self.r = streams.connect(redis_url)
        self.r_blocking = streams.connect(redis_url, blocking=True)
        self.consumer = streams.RequestConsumer(
            self.r_blocking, self.r, self.name, block_ms=read_block_ms
        )
        self.engine_thread = EngineThread(engine, self._emit)
        self.inflight: dict[str, Inflight] = {}  # request_id -> state
        self._stopping = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.publisher = Publisher(
            self.r, self.consumer, response_ttl_s, self._stopping, self._stop_unwritable
        )
        self.delivery = Delivery(
            self.r,
            self.consumer,
            self.publisher,
            self.engine_thread,
            self.inflight,
            response_ttl_s,
            settings.max_deliveries,
            self.model_name,
        )
        self.output_processor = OutputProcessor(self.inflight, self.publisher, self.model_name)
        self.heartbeat = Heartbeat(
            self.r,
            self.consumer,
            self.engine_thread,
            self.inflight,
            self._stopping,
            name=self.name,
            model_name=self.model_name,
            max_model_len=engine.max_model_len,
            tick_s=self.tick_s,
            response_ttl_s=response_ttl_s,
        )

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
            asyncio.create_task(self._supervise("heartbeat", self.heartbeat.run)),
        ]
        publish = asyncio.create_task(self.publisher.run())
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
        self.engine_thread.stop()
        await asyncio.to_thread(self.engine_thread.join)
        await asyncio.sleep(0)  # let the engine's last events (call_soon_threadsafe) land
        self.inflight.clear()
        self.publisher.close()
        await publish
        for task in side_tasks:
            task.cancel()
        await asyncio.gather(*side_tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.r.delete(keys.worker(self.name))
        await self.r_blocking.aclose()
        await self.r.aclose()
        log.info("worker stopped", worker=self.name, left_pending=left)

    async def _supervise(self, name: str, loop_fn: Callable[[], Awaitable[None]]) -> None:
        """Run one of the worker's loops; a Redis hiccup restarts it (with backoff) instead of
        ending it."""
        backoff = Backoff()
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                await loop_fn()
            except asyncio.CancelledError:
                raise
            except Exception:
                if time.monotonic() - started > RETRY_MAX_S:
                    backoff.reset()  # it had recovered: a new outage starts short again
                log.exception("worker task failed, restarting", task=name, delay_s=backoff.delay)
                await backoff.sleep()

    # ---- ingest and control --------------------------------------------------------------

    async def _ingest_loop(self) -> None:
        # A (re)start after an error begins with own pending entries: a read whose reply was
        # lost, or entries read but not yet delivered when the error came, left them there,
        # and only a claim 15 s later would find them otherwise (reliability item 31).
        self.consumer.reread_pending()
        next_claim = 0.0
        while not self._stopping.is_set():
            room = self.max_inflight - len(self.inflight) - self.publisher.num_unacked
            if room <= 0:
                # Leave entries in the stream for other workers rather than queueing here.
                await asyncio.sleep(0.05)
                continue
            # Claims wait until own pending entries are read: a claimed entry joins them, and
            # reading them would deliver it a second time, counted towards the delivery cap
            # (measured: one entry delivered 8 times over the 6 kills of reliability
            # scenario 1, twice by each worker restarted).
            try:
                if self.consumer.caught_up and time.monotonic() >= next_claim:
                    next_claim = time.monotonic() + self.claim_idle_ms / 2000
                    for entry in await self.consumer.claim_stale(self.claim_idle_ms, room):
                        await self.delivery.ingest(entry)
                    continue  # room again, after what the claim took
                for entry in await self.consumer.read(room):
                    await self.delivery.ingest(entry)
            except streams.GroupLost:
                self._drop_lost()

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
                        self.engine_thread.abort(rid, "abort")

    def _stop_unwritable(self, request_id: str) -> None:
        """The publisher failed `request_id` (its response key refuses chunks): forget it, so
        no more chunks are made for it, and abort it in the engine (its KV blocks freed)."""
        if self.inflight.pop(request_id, None) is not None:
            self.engine_thread.abort(request_id, "unwritable")

    def _drop_lost(self) -> None:
        """Redis lost the request group (restarted without its data): the requests this worker
        holds have no entry left to ack and their clients were told they were lost
        (`RedisDataLost`), so abort them rather than generate for no one while new requests
        wait behind them (measured: a request after an empty restart waited over 30 s behind
        7 lost ones of 240 tokens, on a loaded machine)."""
        if self.inflight:
            log.warning("Redis lost the request group; dropping its requests", n=len(self.inflight))
        for request_id in list(self.inflight):
            self.inflight.pop(request_id)
            self.engine_thread.abort(request_id, "lost")

    def _emit(self, event: EngineEvent) -> None:
        """Called on the engine thread: hop onto the loop."""
        with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
            self._loop.call_soon_threadsafe(self.output_processor.process, event)
