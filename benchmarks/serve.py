"""Serving benchmark, in the manner of `vllm bench serve`, over HTTP/SSE or raw Redis Streams.

Requests arrive as a gamma process (`--burstiness` 1 = Poisson) at `--request-rate`
(inf = all at once), at most `--max-concurrency` in flight, each asking for exactly its
`output_len` tokens (greedy, EOS ignored). Reports request and token throughput, TTFT,
TPOT, ITL and end-to-end latency (mean, median, p99) and failed requests.

`--launch` starts `kvrail serve` (with its own Redis) and stops it afterwards; otherwise
the script targets `--base-url` (http) or `--redis-url` (redis). `--offline-baseline`
runs the same workload at the same arrivals and concurrency through an offline `LLMEngine`
in this process right after each service load (the server idles meanwhile), and probes
idle TTFT on both sides, so the service's overhead shows as ratios from one run.
`--rounds N` repeats the pair with N seeds; the verdict takes the median round's ratio.
`--peer-url` names another OpenAI-compatible server (llama.cpp's `llama-server`, say): each
round sends it the same workload at the same arrivals right after kvrail's, for the ratio
of output tokens/s and kvrail's TTFT p99 against the peer's median.

    python -m benchmarks.serve --launch --backend http --request-rate 4 --offline-baseline
    python -m benchmarks.serve --launch --backend http --quantization int8 --request-rate inf \
        --max-concurrency 32 --peer-url http://127.0.0.1:8080
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
from tqdm.auto import tqdm

from benchmarks.common import (
    BenchRequest,
    RequestTiming,
    arrival_offsets,
    corpus_token_ids,
    fmt,
    latency_rows,
    make_workload,
    markdown_table,
    parse_range,
    run_timed_offline,
    summarize_timings,
    verdict,
    warm_up,
    write_results,
)

ENGINE_OPTIONS = (
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_memory_bytes",
)
THROUGHPUT_TARGET = 0.90  # service output tokens/s over offline
IDLE_TTFT_TARGET_MS = 15.0  # service idle TTFT minus offline
PEER_THROUGHPUT_TARGET = 3.0  # kvrail output tokens/s over the peer's
SERVER_START_TIMEOUT_S = 300.0

Sender = Callable[[BenchRequest], Awaitable[RequestTiming]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--backend", choices=("http", "redis"), default="http")
    add("--base-url", default="http://127.0.0.1:8000")
    add("--redis-url", default=os.environ.get("REDIS_URL"))
    add("--launch", action="store_true", help="start `kvrail serve` with its own Redis")
    add("--model", default=None, help="for the tokenizer, --launch and the baseline")
    add("--dtype", default=None, help="engine dtype for --launch and the baseline")
    add("--quantization", default=None, help="engine quantization (int8) for the same")
    add("--kv-cache-dtype", default=None, help="engine KV cache dtype (fp8) for the same")
    add("--max-num-seqs", type=int, default=None)
    add("--max-num-batched-tokens", type=int, default=None)
    add("--kv-cache-memory-bytes", type=int, default=None, help="KV pool size on CPU")
    add("--num-requests", type=int, default=64)
    add("--input-len", type=parse_range, default=(64, 512), help="LOW:HIGH prompt tokens")
    add("--output-len", type=parse_range, default=(64, 256), help="LOW:HIGH output tokens")
    add("--seed", type=int, default=0)
    add("--request-rate", type=float, default=math.inf, help="requests/s; inf = all at once")
    add("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    add("--max-concurrency", type=int, default=None)
    add("--offline-baseline", action="store_true", help="also run the offline engine")
    add("--peer-url", default=None, help="another OpenAI-compatible server, run after kvrail")
    add("--idle-probes", type=int, default=5, help="one-at-a-time requests for idle TTFT")
    add("--rounds", type=int, default=1, help="loads, each with its own seed (+ baseline)")
    add("--name", default=None, help="results/<name>.json and .md (default serve-<backend>)")
    args = parser.parse_args(argv)
    args.name = args.name or f"serve-{args.backend}"
    if args.backend == "redis" and not (args.launch or args.redis_url):
        parser.error("--backend redis needs --redis-url (or REDIS_URL) or --launch")
    return args


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings given on the command line: the server and the baseline share them."""
    return {k: getattr(args, k) for k in ENGINE_OPTIONS if getattr(args, k) is not None}


@contextlib.contextmanager
def launched_server(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """`kvrail serve` on a free port with a private Redis; yields (base_url, redis_url)."""
    from queueing.redis_server import EmbeddedRedis, free_port

    redis = EmbeddedRedis().start()
    port = free_port()
    command = [sys.executable, "-m", "service.cli", "serve", "--port", str(port)]
    if args.model:
        command += ["--model", args.model]
    for name, value in engine_options(args).items():
        command += ["--" + name.replace("_", "-"), str(value)]
    env = {**os.environ, "REDIS_URL": redis.url, "KVRAIL_LOG_LEVEL": "WARNING"}
    base_url = f"http://127.0.0.1:{port}"
    # The server's access log would bury the progress bars: it goes to a file, kept for
    # diagnosis.
    with tempfile.NamedTemporaryFile("w", prefix="kvrail-serve-", delete=False) as log:
        server = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            wait_healthy(base_url, server, log.name)
            yield base_url, redis.url
        finally:
            os.killpg(server.pid, signal.SIGINT)  # the server's own process group only
            server.wait(60)
            redis.cleanup()


def wait_healthy(base_url: str, server: subprocess.Popen, log_path: str) -> None:
    """Poll /health until the worker is up; raise if the server dies or never answers."""
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"kvrail serve exited ({server.returncode}); see {log_path}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"kvrail serve did not become healthy in {SERVER_START_TIMEOUT_S:.0f} s")


def completion_body(model_name: str, request: BenchRequest) -> dict[str, Any]:
    return {
        "model": model_name,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send_http(
    client: httpx.AsyncClient, model_name: str, request: BenchRequest
) -> RequestTiming:
    """POST /v1/completions with stream=true; a chunk's time is when its SSE event arrived."""
    timing = RequestTiming(start=time.perf_counter(), prompt_len=request.prompt_len)
    body = completion_body(model_name, request)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return timing
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if event.get("error"):  # a failure after the 200 arrives as an event
                    timing.error = str(event["error"])
                    break
                if event.get("choices"):
                    timing.chunk_times.append(time.perf_counter())
                    timing.output_tokens += 1
                if event.get("usage"):  # the exact count, when the server sends it
                    timing.output_tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        timing.error = f"{type(e).__name__}: {e}"
    return timing


async def send_redis(client: Any, request: BenchRequest) -> RequestTiming:
    """XADD a GenerateRequest and read its TokenChunks through the producer client."""
    from queueing.schema import GenerateRequest

    request_id = f"{request.request_id}-{uuid.uuid4().hex[:8]}"
    sampling = {"max_tokens": request.output_len, "temperature": 0.0, "ignore_eos": True}
    message = GenerateRequest(
        request_id, prompt_token_ids=request.prompt_token_ids, sampling=sampling
    )
    timing = RequestTiming(start=time.perf_counter(), prompt_len=request.prompt_len)
    try:
        await client.submit(message)
        async for chunk in client.stream(request_id):
            if chunk.error:
                timing.error = chunk.error
                break
            if chunk.token_ids:
                timing.chunk_times.append(time.perf_counter())
                timing.output_tokens += len(chunk.token_ids)
    except Exception as e:  # a failed request is counted, not fatal to the benchmark
        timing.error = f"{type(e).__name__}: {e}"
    return timing


async def run_load(
    send: Sender, workload: list[BenchRequest], offsets: list[float], max_concurrency: int | None
) -> tuple[list[RequestTiming], float]:
    """Send each request at its arrival offset, at most `max_concurrency` at once."""
    limit = asyncio.Semaphore(max_concurrency or len(workload))
    bar = tqdm(total=len(workload), desc="requests")
    t0 = time.perf_counter()

    async def one(request: BenchRequest, offset: float) -> RequestTiming:
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        async with limit:
            timing = await send(request)
        bar.update(1)
        return timing

    timings = await asyncio.gather(*(one(r, o) for r, o in zip(workload, offsets, strict=True)))
    duration = time.perf_counter() - t0
    bar.close()
    return list(timings), duration


async def run_probes(send: Sender, probes: list[BenchRequest]) -> list[RequestTiming]:
    """One request at a time on an idle server; the first only warms up and is dropped."""
    return [await send(probe) for probe in probes][1:]


@contextlib.asynccontextmanager
async def sender(args: argparse.Namespace, base_url: str, redis_url: str | None):
    """The chosen backend's `send(request) -> RequestTiming`, over one client."""
    if args.backend == "http":
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as client:
            model_name = (await client.get("/v1/models")).json()["data"][0]["id"]
            yield lambda r: send_http(client, model_name, r)
        return
    from queueing.client import KvrailClient

    async with KvrailClient(redis_url) as client:
        yield lambda r: send_redis(client, r)


async def measure(
    args: argparse.Namespace,
    base_url: str,
    redis_url: str | None,
    workloads: list[list[BenchRequest]],
    probes: list[BenchRequest],
    engine: Any | None,
) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
    """Idle probes, then one load per round through the service and, when `engine` (the
    offline baseline) or `--peer-url` is given, the same load through them right after,
    while the server idles: a shared machine's slow spells then fall on every side of a
    round alike."""
    async with contextlib.AsyncExitStack() as stack:
        send = await stack.enter_async_context(sender(args, base_url, redis_url))
        peer_send = None
        if args.peer_url:
            peer_args = argparse.Namespace(**{**vars(args), "backend": "http"})
            peer_send = await stack.enter_async_context(sender(peer_args, args.peer_url, None))
        idle = await run_probes(send, probes)
        offline_idle = peer_idle = None
        if engine is not None:
            warm_up(engine)
            offline_idle = [run_timed_offline(engine, [p], [0.0])[0][0] for p in probes][1:]
        if peer_send is not None:
            peer_idle = await run_probes(peer_send, probes)
        service_runs, offline_runs, peer_runs = [], [], []
        for i, workload in enumerate(workloads):
            offsets = arrival_offsets(
                len(workload), args.request_rate, args.burstiness, args.seed + i
            )
            service_runs.append(await run_load(send, workload, offsets, args.max_concurrency))
            if engine is not None:
                with tqdm(total=len(workload), desc="offline baseline") as bar:
                    offline_runs.append(
                        run_timed_offline(engine, workload, offsets, args.max_concurrency, bar)
                    )
            if peer_send is not None:
                peer_runs.append(await run_load(peer_send, workload, offsets, args.max_concurrency))
    service = summarize_rounds(idle, service_runs)
    service["errors"] = sorted({t.error for ts, _ in service_runs for t in ts if t.error})[:5]
    offline = summarize_rounds(offline_idle, offline_runs) if engine is not None else None
    peer = None
    if peer_send is not None:
        peer = summarize_rounds(peer_idle, peer_runs)
        peer["errors"] = sorted({t.error for ts, _ in peer_runs for t in ts if t.error})[:5]
    return service, offline, peer


def summarize_rounds(
    idle: list[RequestTiming], runs: list[tuple[list[RequestTiming], float]]
) -> dict[str, Any]:
    """Idle TTFT, the rounds' requests and durations pooled, and each round on its own."""
    pooled = [t for timings, _ in runs for t in timings]
    return {
        "idle": summarize_timings(idle, 1.0)["ttft"],
        "load": summarize_timings(pooled, sum(duration for _, duration in runs)),
        "rounds": [summarize_timings(timings, duration) for timings, duration in runs],
    }


def round_ratios(service: dict[str, Any], other: dict[str, Any]) -> list[float]:
    """Each round's output throughput of the service over the other side's."""
    return [
        s["output_throughput"] / o["output_throughput"]
        for s, o in zip(service["rounds"], other["rounds"], strict=True)
    ]


def throughput_row(
    service: dict[str, Any], other: dict[str, Any], target: float, as_percent: bool
) -> list[str]:
    """Output tok/s of both sides (rounds pooled) and the median round's ratio, judged."""
    ratio = statistics.median(round_ratios(service, other))
    shown, goal = (
        (f"{ratio:.1%}", f">= {target:.0%}") if as_percent else (f"{ratio:.2f}x", f">= {target:g}x")
    )
    return [
        "output tok/s",
        fmt(service["load"]["output_throughput"]),
        fmt(other["load"]["output_throughput"]),
        shown,
        goal,
        verdict(ratio, target),
    ]


def comparison_rows(service: dict[str, Any], offline: dict[str, Any]) -> list[list[str]]:
    """Service against offline: the output throughput ratio, and the idle TTFT difference."""
    ttft_gap = service["idle"]["median_ms"] - offline["idle"]["median_ms"]
    return [
        throughput_row(service, offline, THROUGHPUT_TARGET, as_percent=True),
        [
            "idle TTFT median (ms)",
            fmt(service["idle"]["median_ms"]),
            fmt(offline["idle"]["median_ms"]),
            f"{ttft_gap:+.1f} ms",
            f"<= +{IDLE_TTFT_TARGET_MS:g} ms",
            verdict(ttft_gap, IDLE_TTFT_TARGET_MS, False),
        ],
    ]


def peer_rows(service: dict[str, Any], peer: dict[str, Any]) -> list[list[str]]:
    """kvrail against the peer server: the output throughput ratio, and kvrail's TTFT p99
    against the peer's median (pooled over rounds)."""
    p99, peer_median = service["load"]["ttft"]["p99_ms"], peer["load"]["ttft"]["median_ms"]
    return [
        throughput_row(service, peer, PEER_THROUGHPUT_TARGET, as_percent=False),
        [
            "kvrail TTFT p99 vs peer TTFT median (ms)",
            fmt(p99),
            fmt(peer_median),
            f"{p99 / peer_median:.2f}x",
            "< 1x",
            verdict(p99, peer_median, higher_is_better=False),
        ],
    ]


def report(
    args: argparse.Namespace,
    service: dict[str, Any],
    offline: dict[str, Any] | None,
    peer: dict[str, Any] | None,
) -> str:
    load = service["load"]
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}/s"
    lines = [
        f"# Serving ({args.backend})",
        "",
        f"{args.num_requests} requests, inputs {args.input_len[0]}-{args.input_len[1]}, outputs"
        f" {args.output_len[0]}-{args.output_len[1]} tokens, seed {args.seed}; request rate"
        f" {rate}, burstiness {args.burstiness:g}, max concurrency {args.max_concurrency or '-'};"
        f" engine options {engine_options(args) or 'defaults'}.",
        "",
        markdown_table(
            ["", "value"],
            [
                ["completed / failed", f"{load['completed']} / {load['failed']}"],
                ["duration (s)", fmt(load["duration_s"], 2)],
                ["request throughput (req/s)", fmt(load["request_throughput"], 2)],
                ["output tok/s", fmt(load["output_throughput"])],
                ["total tok/s", fmt(load["total_token_throughput"])],
            ],
        ),
        "",
        markdown_table(["service latency", "mean", "median", "p99"], latency_rows(load)),
    ]
    if service["errors"]:
        lines += ["", "Errors: " + "; ".join(service["errors"])]
    if offline is not None:
        lines += [
            "",
            "## Against the offline engine (same workload, arrivals and concurrency)",
            "",
            markdown_table(
                ["", "service", "offline", "service vs offline", "target", "verdict"],
                comparison_rows(service, offline),
            ),
            "",
            "Output tok/s service/offline per round: "
            + ", ".join(f"{r:.1%}" for r in round_ratios(service, offline))
            + " (the ratio above is their median; the tok/s columns pool the rounds).",
            "",
            markdown_table(
                ["offline latency", "mean", "median", "p99"], latency_rows(offline["load"])
            ),
        ]
    if peer is not None:
        load = peer["load"]
        lines += [
            "",
            f"## Against the peer at {args.peer_url} (same workload, arrivals and concurrency)",
            "",
            markdown_table(
                ["", "kvrail", "peer", "kvrail vs peer", "target", "verdict"],
                peer_rows(service, peer),
            ),
            "",
            "Output tok/s kvrail/peer per round: "
            + ", ".join(f"{r:.2f}x" for r in round_ratios(service, peer))
            + f"; peer completed / failed: {load['completed']} / {load['failed']}.",
            "",
            markdown_table(["peer latency", "mean", "median", "p99"], latency_rows(load)),
        ]
        if peer["errors"]:
            lines += ["", "Peer errors: " + "; ".join(peer["errors"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.loader import load_tokenizer, resolve_model

    tokens = corpus_token_ids(load_tokenizer(resolve_model(args.model)))
    workloads = [
        make_workload(tokens, args.num_requests, args.input_len, args.output_len, args.seed + i)
        for i in range(args.rounds)
    ]
    # Probes use other prompts than the load, so neither side gets prefix-cache hits from them.
    probes = make_workload(tokens, args.idle_probes + 1, args.input_len, (8, 8), args.seed + 1000)
    engine = None
    if args.offline_baseline:
        from engine import LLMEngine

        engine = LLMEngine.from_kwargs(model=args.model, **engine_options(args))
    if args.launch:
        with launched_server(args) as (base_url, redis_url):
            service, offline, peer = asyncio.run(
                measure(args, base_url, redis_url, workloads, probes, engine)
            )
    else:
        service, offline, peer = asyncio.run(
            measure(args, args.base_url, args.redis_url, workloads, probes, engine)
        )
    payload = {"args": vars(args), "service": service, "offline": offline, "peer": peer}
    write_results(args.name, payload, report(args, service, offline, peer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
