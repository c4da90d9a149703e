"""Time to the first chunk on an idle server against the offline engine, interleaved.

Three paths answer the same short prompt, one request at a time:
- offline: `add_request` -> first token from an `LLMEngine` in this process;
- redis: XADD -> first `TokenChunk` on the response stream (`KvrailClient`);
- http: POST /v1/completions -> first SSE event.

They run in rounds (each round one request per path, the order rotating), so a slow spell of
a shared machine falls on all three alike; the service's overhead is the median over rounds
of (path - offline) within the round, against the 15 ms target. `kvrail serve` is launched
on a free port with its own Redis, as in `benchmarks.serve --launch`.

    python -m benchmarks.idle_latency -n 60
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections.abc import Awaitable, Callable

import httpx
from tqdm.auto import tqdm

from benchmarks.common import (
    BenchRequest,
    RequestTiming,
    fmt,
    markdown_table,
    run_timed_offline,
    verdict,
    warm_up,
    write_results,
)
from benchmarks.serve import IDLE_TTFT_TARGET_MS, launched_server, send_http, send_redis

PROMPT = "The capital of France is"
PATHS = ("offline", "redis", "http")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("-n", "--rounds", type=int, default=60, help="rounds of one request per path")
    add("--max-tokens", type=int, default=1)
    add("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    add("--dtype", default=None, help="engine dtype, both sides")
    add("--name", default="idle_latency", help="results/<name>.json and .md")
    args = parser.parse_args(argv)
    # `launched_server` passes these engine options on; idle latency keeps the defaults.
    args.max_num_seqs = args.max_num_batched_tokens = args.kv_cache_memory_bytes = None
    return args


async def measure(args: argparse.Namespace, base_url: str, redis_url: str) -> dict[str, list]:
    """Per path, the first-chunk time of each round in seconds, timed as `benchmarks.serve`
    times its requests (`run_timed_offline`, `send_redis`, `send_http`)."""
    from engine import LLM
    from queueing.client import KvrailClient

    engine = LLM(model=args.model, **({"dtype": args.dtype} if args.dtype else {})).llm_engine
    warm_up(engine)
    _, prompt_token_ids = engine.tokenize_prompt(PROMPT)

    async def offline(request: BenchRequest) -> RequestTiming:
        return run_timed_offline(engine, [request], [0.0])[0][0]

    times: dict[str, list] = {path: [] for path in PATHS}
    async with (
        KvrailClient(redis_url) as client,
        httpx.AsyncClient(base_url=base_url, timeout=60) as http_client,
    ):
        model_name = (await http_client.get("/v1/models")).json()["data"][0]["id"]
        senders: dict[str, Callable[[BenchRequest], Awaitable[RequestTiming]]] = {
            "offline": offline,
            "redis": lambda r: send_redis(client, r),
            "http": lambda r: send_http(http_client, model_name, r),
        }
        # Round -1 is not recorded: connections, first-call costs.
        for i in tqdm(range(-1, args.rounds), desc="rounds (offline, redis, http)"):
            request = BenchRequest(f"idle-{i}", prompt_token_ids, args.max_tokens)
            for path in PATHS[i % 3 :] + PATHS[: i % 3]:
                timing = await senders[path](request)
                if not timing.ok:
                    raise RuntimeError(f"{path} request failed: {timing.error}")
                if i >= 0:
                    times[path].append(timing.ttft)
    return times


def summary(values_s: list[float]) -> dict[str, float]:
    ms = sorted(v * 1e3 for v in values_s)
    return {
        "median_ms": statistics.median(ms),
        "p90_ms": ms[int(0.9 * (len(ms) - 1))],
        "min_ms": ms[0],
        "n": len(ms),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with launched_server(args) as (base_url, redis_url):
        times = asyncio.run(measure(args, base_url, redis_url))
    results = {path: summary(values) for path, values in times.items()}
    rows = [["offline add_request -> first token", *_cells(results["offline"]), "-", "-", "-"]]
    for path, label in (("redis", "XADD -> first chunk"), ("http", "POST -> first SSE event")):
        paired = [(s - o) * 1e3 for s, o in zip(times[path], times["offline"], strict=True)]
        overhead = statistics.median(paired)
        results[path]["overhead_vs_offline_ms"] = overhead
        rows.append(
            [
                f"{path}: {label}",
                *_cells(results[path]),
                fmt(overhead, 1),
                f"<= {IDLE_TTFT_TARGET_MS:.0f}",
                verdict(overhead, IDLE_TTFT_TARGET_MS, higher_is_better=False),
            ]
        )
    headers = ["path", "median ms", "p90 ms", "min ms", "n", "overhead ms", "target", "verdict"]
    markdown = "\n".join(
        [
            "# Idle time to first chunk",
            "",
            f"Prompt {PROMPT!r}, max_tokens {args.max_tokens}, greedy, EOS ignored;"
            f" {args.rounds} rounds of"
            " one request per path, order rotating. Overhead: the median over rounds of"
            " (path - offline) in the same round.",
            "",
            markdown_table(headers, rows),
        ]
    )
    write_results(args.name, {"args": vars(args), "results": results}, markdown)
    return 0


def _cells(s: dict[str, float]) -> list[str]:
    return [fmt(s["median_ms"], 2), fmt(s["p90_ms"], 2), fmt(s["min_ms"], 2), str(s["n"])]


if __name__ == "__main__":
    raise SystemExit(main())
