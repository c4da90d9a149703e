"""Shared pieces of the reliability tests (not a test file): a tiny model, its offline reference,
worker and API processes on a private Redis, response collection and process measurements.

Processes are started with the helpers of `tests/service/test_e2e.py` (`start`, `stop`,
`wait_healthy`), so a worker here is exactly what `kvrail worker` runs in production.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine import LLM, SamplingParams
from queueing.client import KvrailClient
from queueing.redis_server import free_port
from queueing.schema import TokenChunk
from tests.service.test_e2e import start, stop, wait_healthy

# A small engine: requests are short, so CPU time goes to the faults, not to generation.
MAX_MODEL_LEN = 256
ENGINE_KWARGS = dict(dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=16, num_kv_blocks=256)
GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompts(count: int, tag: str = "") -> list[str]:
    """Distinct prompts, so a chunk delivered to the wrong request cannot go unnoticed."""
    return [f"{tag}Request {i}: tell me about the number {i * 7}." for i in range(count)]


def reference(model: Path, texts: list[str], max_tokens: int) -> list[list[int]]:
    """Greedy token ids from the offline engine: what every served request must reproduce."""
    llm = LLM(str(model), **ENGINE_KWARGS)
    outputs = llm.generate(texts, SamplingParams(max_tokens=max_tokens, **GREEDY))
    return [out.outputs[0].token_ids for out in outputs]


def worker_args(model: Path, name: str, *extra: str) -> list[str]:
    return [
        "worker", "--model", str(model), "--name", name,
        "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "256", "--dtype", "float32",
        *extra,
    ]  # fmt: skip


@dataclass
class Cluster:
    """`kvrail worker` (and optionally `kvrail api`) processes on one Redis, with logs in
    `log_dir`. Workers are addressed by name; `kill` SIGKILLs, `restart` starts again."""

    model: Path
    redis_url: str
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)
    api: subprocess.Popen | None = None
    api_url: str = ""
    started_ms: dict[str, int] = field(default_factory=dict)  # by worker name, latest start
    _starts: int = 0

    def start_worker(self, name: str, *extra: str) -> subprocess.Popen:
        self._starts += 1
        self.started_ms[name] = int(time.time() * 1000)
        log = self.log_dir / f"{name}.{self._starts}.log"
        env = {"REDIS_URL": self.redis_url, **self.env}
        self.workers[name] = start(worker_args(self.model, name, *extra), env, log)
        return self.workers[name]

    def start_api(self, timeout_s: float = 60) -> str:
        port = free_port()
        log = self.log_dir / "api.log"
        args = ["api", "--model", str(self.model), "--port", str(port)]
        self.api = start(args, {"REDIS_URL": self.redis_url, **self.env}, log)
        self.api_url = f"http://127.0.0.1:{port}"
        wait_healthy(self.api_url, self.api, log, timeout_s)
        # A /health that found no worker yet left the API's worker view (cached 1 s) empty.
        time.sleep(1.1)
        return self.api_url

    async def serving(self, client: KvrailClient) -> list[str]:
        """Workers whose heartbeat comes from their latest process: a killed worker's
        heartbeat outlives it by its TTL, and killing a process still loading proves little."""
        return [
            w.name
            for w in await client.workers()
            if w.started_ms >= self.started_ms.get(w.name, 0) and w.name in self.workers
        ]

    def kill(self, name: str) -> None:
        stop(self.workers[name], signal.SIGKILL)

    def close(self) -> None:
        for proc in [*self.workers.values(), self.api]:
            if proc is not None:
                stop(proc, signal.SIGKILL)

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(p.read_text()[-tail:] for p in sorted(self.log_dir.glob("*.log")))


async def wait_for_workers(client: KvrailClient, count: int, timeout_s: float = 120) -> None:
    """Until `count` worker heartbeats are alive."""
    deadline = time.monotonic() + timeout_s
    while len(await client.workers()) < count:
        assert time.monotonic() < deadline, f"fewer than {count} workers after {timeout_s} s"
        await asyncio.sleep(0.2)


async def collect(client: KvrailClient, request_id: str) -> list[TokenChunk]:
    """Every chunk of a request as the client hands them out (repeats dropped, gaps raise)."""
    return [chunk async for chunk in client.stream(request_id)]


def assert_complete(chunks: list[TokenChunk], expected: list[int]) -> None:
    """seq 0..N-1 without repeat or gap, a final chunk, and the reference tokens."""
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert chunks[-1].is_last and chunks[-1].error is None, chunks[-1]
    assert [t for c in chunks for t in c.token_ids] == expected


def rss_bytes(pid: int) -> int:
    """Resident memory of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def open_fds(pid: int = 0) -> int:
    """Open file descriptors (sockets included) of a process, this one by default."""
    return len(os.listdir(f"/proc/{pid or os.getpid()}/fd"))
