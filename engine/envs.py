"""The one place the engine reads its environment variables, as vLLM's envs.py.

Read them as attributes, `envs.KVRAIL_CACHE_DIR`: each access evaluates the variable anew,
so a test that changes the environment is seen on the next read. The service's settings
(Redis, the API, the worker, logs) are the service's own: `service/settings.py`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    KVRAIL_CACHE_DIR: Path

environment_variables: dict[str, Callable[[], Any]] = {
    # Where converted models (GGUF dequantized to safetensors) and quantized weights are cached.
    "KVRAIL_CACHE_DIR": lambda: Path(
        os.environ.get("KVRAIL_CACHE_DIR", "~/.cache/kvrail")
    ).expanduser(),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
