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


def prefer_huge_pages() -> None:
    """Ask torch for 2 MiB pages for its large CPU tensors (the weights, the KV pool), unless
    the environment says otherwise: torch reads THP_MEM_ALLOC_ENABLE at its first CPU
    allocation, so this runs before the engine imports torch (`engine/__init__.py`); a process
    that allocated with torch before importing the engine keeps torch's default.

    Weights streamed every step from 4 KiB pages ran slower in an engine built early in its
    process than in one built later (`benchmarks/engine_process.py`; by hand, SmolLM2's LM
    head read from memory took about a third longer in the first of three engines, and about
    the same in all three with 2 MiB pages). One stream on 2 vCPUs of an AMX Xeon, engines in
    processes of their own started in rotating order (`python -m benchmarks.latency --rounds 8
    --systems kvrail,kvrail-4k-pages`, `results/latency-amx-pages.md`): 89.8 tok/s against
    85.7 in 4 KiB pages (1.05x)."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
