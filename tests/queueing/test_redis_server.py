"""The embedded redis-server: it must not outlive the process that started it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STARTS_REDIS = (
    "import time\n"
    "from queueing.redis_server import EmbeddedRedis\n"
    "print(EmbeddedRedis().start().process.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed child may wait to be reaped by whoever adopted it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_embedded_redis_dies_with_the_process_that_started_it():
    """Issue 12: a killed test run left redis-server (in its own session) running."""
    parent = subprocess.Popen(
        [sys.executable, "-c", STARTS_REDIS], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        redis_pid = int(parent.stdout.readline())
        assert _running(redis_pid)
    finally:
        parent.kill()  # SIGKILL: no cleanup code of the parent runs
        parent.wait()
    deadline = time.monotonic() + 10
    while _running(redis_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(redis_pid)
