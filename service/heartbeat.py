"""The worker's heartbeat: liveness, held entries, deadlines and the engine's metrics.

Every tick it writes `kvrail:worker:{name}` with a short TTL (the API lists live workers from
these), touches the entries this worker holds so that no live request looks idle to another
worker's XAUTOCLAIM, renews the TTL of their keys (state, response stream, SSE shape) so that
none expires while its request runs, aborts requests past their deadline, and moves the
engine's counters to Prometheus. The gauges read the engine thread's latest snapshot at
scrape time instead.
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from engine import EngineStats
from queueing import streams
from queueing.schema import WorkerInfo, keys
from service import metrics
from service.delivery import Inflight
from service.engine_thread import EngineThread

HEARTBEAT_TTL_S = 5
# `EngineStats` counters (since the engine started), each moved to the metric of its name.
_COUNTERS = (
    "num_preemptions",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)


class Heartbeat:
    """`run()` ticks every `tick_s` until `stopping` is set."""

    def __init__(
        self,
        r: aioredis.Redis,
        consumer: streams.RequestConsumer,
        engine_thread: EngineThread,
        inflight: dict[str, Inflight],
        stopping: asyncio.Event,
        *,
        name: str,
        model_name: str,
        max_model_len: int,
        tick_s: float,
        response_ttl_s: int,
    ) -> None:
        self.r = r
        self.consumer = consumer
        self.engine_thread = engine_thread
        self.inflight = inflight  # request_id -> state, shared with the worker
        self.stopping = stopping
        self.name = name
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tick_s = tick_s
        self.response_ttl_s = response_ttl_s
        self._started_ms = int(time.time() * 1000)
        self._last_stats = engine_thread.stats
        # Gauges read the engine's latest snapshot at scrape time, not at the last tick.
        metrics.num_requests_running.labels(model_name).set_function(
            lambda: engine_thread.stats.num_running_reqs
        )
        metrics.num_requests_waiting.labels(model_name).set_function(
            lambda: engine_thread.stats.num_waiting_reqs
        )
        metrics.kv_cache_usage_perc.labels(model_name).set_function(
            lambda: engine_thread.stats.kv_cache_usage
        )

    async def run(self) -> None:
        while not self.stopping.is_set():
            stats = self.engine_thread.stats
            info = self._worker_info(stats)
            await self.r.set(keys.worker(self.name), info.encode(), ex=HEARTBEAT_TTL_S)
            await self.consumer.touch([f.entry_id for f in self.inflight.values()])
            await streams.renew_ttl(self.r, self._held_keys(), self.response_ttl_s)
            self._enforce_deadlines()
            self._update_counters(stats)
            await asyncio.sleep(self.tick_s)

    def _worker_info(self, stats: EngineStats) -> WorkerInfo:
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

    def _held_keys(self) -> list[str]:
        """The keys of held requests that live for the TTL after their request ends (issue 12:
        with a 5 s TTL they expired mid-request: resume answered 404, a retry with the same
        id cut the original short)."""
        return [
            key
            for rid, f in self.inflight.items()
            for key in (
                keys.request_state(rid),
                f.request.response_key,
                keys.sse(rid),
                keys.readers(rid),
            )
        ]

    def _enforce_deadlines(self) -> None:
        now_ms = time.time() * 1000
        for rid, f in self.inflight.items():
            deadline = f.request.deadline_ms
            if deadline is not None and deadline < now_ms and not f.deadline_hit:
                f.deadline_hit = True
                self.engine_thread.abort(rid, "deadline")

    def _update_counters(self, stats: EngineStats) -> None:
        prev, self._last_stats = self._last_stats, stats
        for field in _COUNTERS:
            counter = getattr(metrics, field).labels(self.model_name)
            counter.inc(max(0, getattr(stats, field) - getattr(prev, field)))
        prev_per_pos = prev.spec_decode_num_accepted_tokens_per_pos
        for pos, num in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            num_before = prev_per_pos[pos] if pos < len(prev_per_pos) else 0
            metrics.spec_decode_num_accepted_tokens_per_pos.labels(self.model_name, str(pos)).inc(
                max(0, num - num_before)
            )
