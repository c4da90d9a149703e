"""The one place kvrail reads its environment variables, as vLLM's envs.py.

Read them as attributes, `envs.KVRAIL_CACHE_DIR`: each access evaluates the variable anew,
so a test that changes the environment is seen on the next read.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    KVRAIL_CACHE_DIR: Path
    REDIS_URL: str | None
    KVRAIL_API_KEY: str | None
    KVRAIL_MODEL: str | None
    KVRAIL_WORKER_NAME: str | None
    KVRAIL_LOG_LEVEL: str
    KVRAIL_LOG_JSON: bool | None
    KVRAIL_RESPONSE_TTL_S: int
    KVRAIL_CLAIM_IDLE_MS: int
    KVRAIL_SHUTDOWN_GRACE_S: float
    KVRAIL_MAX_BODY_BYTES: int
    KVRAIL_MAX_PENDING: int
    KVRAIL_STREAM_TIMEOUT_S: float

environment_variables: dict[str, Callable[[], Any]] = {
    # Where converted models (GGUF dequantized to safetensors) are cached.
    "KVRAIL_CACHE_DIR": lambda: Path(
        os.environ.get("KVRAIL_CACHE_DIR", "~/.cache/kvrail")
    ).expanduser(),
    # Redis holding the streams; unset: `kvrail serve` starts an embedded one.
    "REDIS_URL": lambda: os.environ.get("REDIS_URL") or None,
    # When set, the API requires `Authorization: Bearer <key>`.
    "KVRAIL_API_KEY": lambda: os.environ.get("KVRAIL_API_KEY") or None,
    # Model for `kvrail worker|serve` when --model is not given (HF folder or .gguf).
    "KVRAIL_MODEL": lambda: os.environ.get("KVRAIL_MODEL") or None,
    # Consumer name in the group; default host-pid.
    "KVRAIL_WORKER_NAME": lambda: os.environ.get("KVRAIL_WORKER_NAME") or None,
    "KVRAIL_LOG_LEVEL": lambda: os.environ.get("KVRAIL_LOG_LEVEL", "INFO").upper(),
    # JSON logs (1) or readable (0); unset: readable on a terminal, JSON otherwise.
    "KVRAIL_LOG_JSON": lambda: _bool(os.environ.get("KVRAIL_LOG_JSON")),
    # Seconds a response stream lives after its last chunk.
    "KVRAIL_RESPONSE_TTL_S": lambda: int(os.environ.get("KVRAIL_RESPONSE_TTL_S", "600")),
    # A pending request entry idle this long is taken over from a dead worker.
    "KVRAIL_CLAIM_IDLE_MS": lambda: int(os.environ.get("KVRAIL_CLAIM_IDLE_MS", "15000")),
    # On SIGTERM, how long in-flight requests may run before being left to other workers.
    "KVRAIL_SHUTDOWN_GRACE_S": lambda: float(os.environ.get("KVRAIL_SHUTDOWN_GRACE_S", "30")),
    "KVRAIL_MAX_BODY_BYTES": lambda: int(os.environ.get("KVRAIL_MAX_BODY_BYTES", str(1 << 20))),
    # The API answers 429 once this many requests wait undelivered or unacknowledged.
    "KVRAIL_MAX_PENDING": lambda: int(os.environ.get("KVRAIL_MAX_PENDING", "1024")),
    # A response stream silent this long (no chunk) fails with a timeout and is aborted.
    "KVRAIL_STREAM_TIMEOUT_S": lambda: float(os.environ.get("KVRAIL_STREAM_TIMEOUT_S", "120")),
}


def _bool(value: str | None) -> bool | None:
    if value is None or value == "":
        return None
    return value.lower() in ("1", "true", "yes", "on")


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
