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
import time
import uuid
from collections.abc import Awaitable, Callable

import httpx
from tqdm.auto import tqdm

from benchmarks.common import fmt, markdown_table, verdict, warm_up, write_results
from benchmarks.serve import IDLE_TTFT_TARGET_MS, launched_server

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
    """Per path, the first-chunk time of each round in seconds."""
    from engine import LLM, SamplingParams
    from queueing.client import KvrailClient
    from queueing.schema import GenerateRequest

    llm = LLM(model=args.model, **({"dtype": args.dtype} if args.dtype else {}))
    engine = llm.llm_engine
    warm_up(engine)
    sampling = {"temperature": 0.0, "max_tokens": args.max_tokens}
    params = SamplingParams(**sampling)
    body = {"model": "kvrail", "prompt": PROMPT, "stream": True, **sampling}

    async def offline() -> float:
        start = time.perf_counter()
        engine.add_request(uuid.uuid4().hex, PROMPT, params)
        first = None
        while engine.has_unfinished_requests():
            outputs = engine.step()
            if first is None and outputs:
                first = time.perf_counter() - start
        return first

    async def redis() -> float:
        request_id = uuid.uuid4().hex
        start = time.perf_counter()
        await client.submit(GenerateRequest(request_id, prompt=PROMPT, sampling=sampling))
        first = None
        async for _ in client.stream(request_id):  # read to the end before the next round
            first = first or time.perf_counter() - start
        return first

    async def http() -> float:
        start = time.perf_counter()
        first = None
        async with http_client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if first is None and line.startswith("data: "):
                    first = time.perf_counter() - start
        return first

    senders: dict[str, Callable[[], Awaitable[float]]] = {
        "offline": offline, "redis": redis, "http": http,
    }  # fmt: skip
    times: dict[str, list] = {path: [] for path in PATHS}
    async with (
        KvrailClient(redis_url) as client,
        httpx.AsyncClient(base_url=base_url, timeout=60) as http_client,
    ):
        models = (await http_client.get("/v1/models")).json()
        body["model"] = models["data"][0]["id"]
        for path in PATHS:  # one unrecorded request each: connections, first-call costs
            await senders[path]()
        for i in tqdm(range(args.rounds), desc="rounds (offline, redis, http)"):
            for path in PATHS[i % 3 :] + PATHS[: i % 3]:
                times[path].append(await senders[path]())
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
            f"Prompt {PROMPT!r}, max_tokens {args.max_tokens}, greedy; {args.rounds} rounds of"
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
