"""The service's settings: every environment variable the worker, the API and the CLI read.

The engine reads only its own (`engine.envs`); what configures Redis, the HTTP API, the
worker's consumer and the logs belongs to the service and is read here, once per process:
`Settings.from_env()` parses and checks every variable, and a bad value stops the process at
startup with an error naming the variable, not at the first request that needs it.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
UNKNOWN_FIELDS = ("reject", "warn")  # what the API does with a request field it does not know
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SettingsError(ValueError):
    """A setting with a value it cannot take; the text names the environment variable."""


def _number(raw: str) -> float:
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError(raw)
    return value


def _bool(raw: str) -> bool:
    if raw.lower() not in _TRUE + _FALSE:
        raise ValueError(raw)
    return raw.lower() in _TRUE


def _origins(raw: str) -> tuple[str, ...]:
    origins = tuple(o.strip() for o in raw.split(",") if o.strip())
    if any(o != "*" and "://" not in o for o in origins):
        raise ValueError(raw)
    return origins


def _setting(
    env: str,
    default: Any,
    parse: Callable[[str], Any] = str,
    check: Callable[[Any], bool] | None = None,
    why: str = "",
) -> Any:
    """A field read from `env` by `parse` (unset or empty: `default`), then held to `check`."""
    return field(default=default, metadata={"env": env, "parse": parse, "check": check, "why": why})


def _positive_int(env: str, default: int) -> Any:
    return _setting(env, default, int, lambda v: v > 0, "must be a positive integer")


@dataclass(frozen=True)
class Settings:
    """The service's configuration, one field per environment variable (named in each)."""

    # Redis holding the streams; unset: `kvrail serve` starts an embedded one.
    redis_url: str | None = _setting("REDIS_URL", None)
    # When set, the API requires `Authorization: Bearer <key>`.
    api_key: str | None = _setting("KVRAIL_API_KEY", None)
    # Model for `kvrail worker|serve|api` when --model is not given (HF folder or .gguf).
    model: str | None = _setting("KVRAIL_MODEL", None)
    # Consumer name in the group; unset: host-pid.
    worker_name: str | None = _setting("KVRAIL_WORKER_NAME", None)
    log_level: str = _setting(
        "KVRAIL_LOG_LEVEL",
        "INFO",
        str.upper,
        lambda v: v in _LOG_LEVELS,
        f"must be one of {', '.join(_LOG_LEVELS)}",
    )
    # JSON logs (true) or readable (false); unset: readable on a terminal, JSON otherwise.
    log_json: bool | None = _setting("KVRAIL_LOG_JSON", None, _bool)
    # Seconds a response stream lives after its last chunk.
    response_ttl_s: int = _positive_int("KVRAIL_RESPONSE_TTL_S", 600)
    # A pending request entry idle this long is taken over from a dead worker.
    claim_idle_ms: int = _positive_int("KVRAIL_CLAIM_IDLE_MS", 15_000)
    # An entry delivered more often than this is dead-lettered, not served: each delivery
    # after the first follows a worker lost (or stopped) while it held the entry. Measured:
    # 5 at most over 200 requests in reliability scenario 1 (6 SIGKILLs in 20 s, 3 workers),
    # so 10 leaves twice that, and retires an entry that kills every worker it reaches after
    # 10 of them (about 10 claim idle times: 2.5 min at the default).
    max_deliveries: int = _positive_int("KVRAIL_MAX_DELIVERIES", 10)
    # On SIGTERM, how long in-flight requests may run before being left to other workers.
    shutdown_grace_s: float = _setting(
        "KVRAIL_SHUTDOWN_GRACE_S", 30.0, _number, lambda v: v >= 0, "must be a number >= 0"
    )
    max_body_bytes: int = _positive_int("KVRAIL_MAX_BODY_BYTES", 1 << 20)
    # The API answers 429 once this many requests wait undelivered or unacknowledged.
    max_pending: int = _positive_int("KVRAIL_MAX_PENDING", 1024)
    # A response stream silent this long (no chunk) fails with a timeout and is aborted.
    stream_timeout_s: float = _setting(
        "KVRAIL_STREAM_TIMEOUT_S", 120.0, _number, lambda v: v > 0, "must be a number > 0"
    )

    # A field of a /v1/completions or /v1/chat/completions body that the API does not know
    # (a typo, another server's extension) or a chat_template_kwargs key the chat template
    # does not read: "reject" answers 400 naming it, as OpenAI does; "warn" logs a warning
    # and ignores it, for deployments whose clients send such fields. `--unknown-fields`.
    unknown_fields: str = _setting(
        "KVRAIL_UNKNOWN_FIELDS",
        "reject",
        str.lower,
        lambda v: v in UNKNOWN_FIELDS,
        f"must be one of {', '.join(UNKNOWN_FIELDS)}",
    )

    # Origins a browser page may call the API from (CORS), comma-separated; "*" for any;
    # unset: none (preflights are refused).
    cors_origins: tuple[str, ...] = _setting("KVRAIL_CORS_ORIGINS", (), _origins)

    # How the API treats its connections (issue 12). A streaming client that dropped its
    # connection has this long to resume it (`/v1/streams/{id}`, on any API process) before
    # its request is aborted; 0: aborted at once.
    resume_grace_s: float = _setting(
        "KVRAIL_RESUME_GRACE_S", 30.0, _number, lambda v: v >= 0, "must be a number >= 0"
    )
    # Seconds a client has to send a request's head (request line and headers), from the
    # connection's opening or from the first byte of a later request; then it is closed.
    http_header_timeout_s: float = _setting(
        "KVRAIL_HTTP_HEADER_TIMEOUT_S", 10.0, _number, lambda v: v > 0, "must be a number > 0"
    )
    # Seconds a client has to send a request's body, from the end of its head; then 408.
    http_body_timeout_s: float = _setting(
        "KVRAIL_HTTP_BODY_TIMEOUT_S", 30.0, _number, lambda v: v > 0, "must be a number > 0"
    )
    # Seconds a connection may stay idle after a response before it is closed.
    http_keep_alive_s: float = _setting(
        "KVRAIL_HTTP_KEEP_ALIVE_S", 5.0, _number, lambda v: v > 0, "must be a number > 0"
    )
    # Connections (and requests) served at once; a request beyond them gets 503. Keep the
    # process's open-file limit (ulimit -n) above it.
    http_max_connections: int = _positive_int("KVRAIL_HTTP_MAX_CONNECTIONS", 1000)

    def __post_init__(self) -> None:
        for f in fields(self):
            value, check = getattr(self, f.name), f.metadata["check"]
            if value is not None and check is not None and not check(value):
                raise SettingsError(f"{f.metadata['env']} {f.metadata['why']}, got {value!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        """The settings from `environ`: an unset or empty variable keeps its default."""
        values = {}
        for f in fields(cls):
            env = f.metadata["env"]
            raw = environ.get(env, "")
            if raw == "":
                continue
            try:
                values[f.name] = f.metadata["parse"](raw)
            except ValueError:
                kind = {
                    int: "an integer",
                    _number: "a number",
                    _bool: "a boolean",
                    _origins: "a comma-separated list of origins (scheme://host[:port]) or *",
                }
                expected = kind.get(f.metadata["parse"], "valid")
                raise SettingsError(f"{env} must be {expected}, got {raw!r}") from None
        return cls(**values)

    @property
    def logging_level(self) -> int:
        return logging.getLevelNamesMapping()[self.log_level]


def served_model_name(model: str | os.PathLike[str] | None) -> str:
    """The name clients use for `model` (the API's `model` field, workers' heartbeats)."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name
