"""Time to the first chunk on an idle server: XADD -> first TokenChunk, and HTTP POST -> first
SSE event, one request at a time (median of N), plus the offline engine's own time to first
token for the same prompt, so the service's overhead is the difference.

    python benchmarks/idle_latency.py              # launches `kvrail serve` on a free port
    python benchmarks/idle_latency.py -n 100 --max-tokens 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
from tqdm import tqdm

from engine import LLM, SamplingParams
from queueing.client import KvrailClient
from queueing.redis_server import EmbeddedRedis, free_port
from queueing.schema import GenerateRequest

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
RESULTS = Path(__file__).parent / "results"


async def redis_first_chunk(url: str, n: int, max_tokens: int) -> list[float]:
    times = []
    async with KvrailClient(url) as client:
        for _ in tqdm(range(n), desc="redis XADD -> first chunk"):
            request_id = uuid.uuid4().hex
            sampling = {"temperature": 0.0, "max_tokens": max_tokens}
            start = time.perf_counter()
            await client.submit(GenerateRequest(request_id, prompt=PROMPT, sampling=sampling))
            async for _ in client.stream(request_id):
                times.append(time.perf_counter() - start)
                break
            async for _ in client.stream(request_id):  # drain the rest before the next one
                pass
    return times


async def http_first_event(base_url: str, n: int, max_tokens: int) -> list[float]:
    times = []
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": max_tokens}
    body["stream"] = True
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        for _ in tqdm(range(n), desc="HTTP POST -> first SSE event"):
            start = time.perf_counter()
            first = None
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data: "):
                        first = time.perf_counter() - start
            times.append(first)
    return times


def offline_first_token(n: int) -> list[float]:
    llm = LLM()
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=1)
    times = []
    for i in tqdm(range(n), desc="offline add_request -> first token"):
        start = time.perf_counter()
        engine.add_request(f"offline-{i}", PROMPT, params)
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - start)
    return times


def summary(times: list[float]) -> dict[str, float]:
    ms = sorted(t * 1000 for t in times)
    return {
        "median_ms": statistics.median(ms),
        "p90_ms": ms[int(0.9 * (len(ms) - 1))],
        "min_ms": ms[0],
        "n": len(ms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("-n", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=1)
    args = parser.parse_args()

    redis = EmbeddedRedis().start()
    port = free_port()
    env = {**os.environ, "REDIS_URL": redis.url, "KVRAIL_LOG_LEVEL": "WARNING"}
    kvrail = str(Path(sys.executable).parent / "kvrail")
    serve = subprocess.Popen(
        [kvrail, "serve", "--port", str(port)], env=env, start_new_session=True
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        results = {
            "redis_xadd_to_first_chunk": summary(
                asyncio.run(redis_first_chunk(redis.url, args.n, args.max_tokens))
            ),
            "http_post_to_first_sse_event": summary(
                asyncio.run(http_first_event(base_url, args.n, args.max_tokens))
            ),
        }
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        serve.wait(60)
        redis.cleanup()
    results["offline_first_token"] = summary(offline_first_token(args.n))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "idle_latency.json").write_text(json.dumps(results, indent=2))
    lines = ["| path | median ms | p90 ms | min ms | n |", "|---|---|---|---|---|"]
    for name, s in results.items():
        lines.append(
            f"| {name} | {s['median_ms']:.2f} | {s['p90_ms']:.2f} | {s['min_ms']:.2f} | {s['n']} |"
        )
    table = "\n".join(lines)
    (RESULTS / "idle_latency.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
