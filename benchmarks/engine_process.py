"""An engine in a child process of its own, for benchmarks that compare engines side by side.

Of identical engines, one started earlier than another ran slower all along on an AMX Xeon
(by hand: up to 14% per single-stream decode step, in one process and between processes);
`spec_decode.py`, which built its engines once in one process, base first, gave the grounded
ratio 2.18x, and 1.63x with the engines built the other way round. Where each engine's
weights landed in memory looks like the cause (2 MiB pages, which the engine now asks torch
for, narrowed the gap: `engine.envs.prefer_huge_pages`); it was not pinned down. A system
that keeps its place keeps that bias, so these benchmarks start every engine afresh each
round, each in a process of its own, in an order that rotates: each system takes every place
in turn (`rotated`).

The child runs functions of a benchmark file of this checkout (`functions_file`) on its `LLM`,
JSON in and out: with `tree`, the engine is that checkout's (a baseline's worktree on
PYTHONPATH) under this checkout's benchmark code.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def worktree(ref: str | None) -> Iterator[Path]:
    """This checkout (ref None), or `ref` in a detached worktree for as long as it is used."""
    if ref is None:
        yield ROOT
        return
    path = Path(tempfile.mkdtemp(prefix="kvrail-baseline-"))
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), ref],
        check=True,
        capture_output=True,
    )
    try:
        yield path
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
            check=False,
            capture_output=True,
        )


def baseline_library(ref: str) -> Any:
    """The CPU kernel library of git ref `ref`, built in a worktree by its own `cpu_build`
    (it lives in the kernel cache, not the worktree)."""
    import ctypes

    with worktree(ref) as tree:
        path = subprocess.run(
            [sys.executable, "-c",
             "from engine.kernels import cpu_build; print(cpu_build.load_library()._name)"],
            cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
            capture_output=True, text=True, check=True,
        ).stdout.split()[-1]  # fmt: skip
    lib = ctypes.CDLL(path)
    lib.kvrail_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return lib


def commit_of(ref: str) -> str:
    """The full hash of the commit `ref` names in this repository."""
    return subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{ref}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def git_ref(text: str) -> str:
    """argparse type of `--baseline-ref`: a ref that names a commit of this repository."""
    try:
        commit_of(text)
    except subprocess.CalledProcessError:
        raise argparse.ArgumentTypeError(f"{text!r} names no commit of this repository") from None
    return text


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """Round r's order: the names rotated by r."""
    r = round_index % len(names)
    return [*names[r:], *names[:r]]


class EngineProcess:
    """`LLM(**llm_kwargs)` in a child process (`env` added to this one's environment);
    `setup(llm)` of `functions_file` runs once it is loaded and its JSON result is `ready`;
    `call(name, *args)` runs `name(llm, *args)` there."""

    def __init__(
        self,
        functions_file: str | Path,
        llm_kwargs: dict[str, Any],
        setup: str,
        tree: Path = ROOT,
        env: dict[str, str] | None = None,
    ) -> None:
        command = [
            sys.executable, str(Path(__file__).resolve()), str(Path(functions_file).resolve()),
            json.dumps(llm_kwargs), setup,
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {}), "PYTHONPATH": str(tree)},
            cwd=tree,
        )
        self.ready = self._read()

    def _read(self) -> Any:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("an engine process died (see its stderr above)")
        return json.loads(line)

    def call(self, name: str, *args: Any) -> Any:
        self.process.stdin.write(json.dumps({"name": name, "args": args}) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=120)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.close()


def _load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("benchmark_functions", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _use_this_checkouts_benchmarks() -> None:
    """The engine is the tree's on PYTHONPATH (a baseline's worktree), but the benchmark code
    is this checkout's whatever the tree holds: a benchmark file imports its helpers from
    `benchmarks`, which an older tree lacks or holds in an older form."""
    spec = importlib.util.spec_from_file_location(
        "benchmarks", ROOT / "benchmarks" / "__init__.py",
        submodule_search_locations=[str(ROOT / "benchmarks")],
    )  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    sys.modules["benchmarks"] = module
    spec.loader.exec_module(module)


def child_main(functions_file: str, llm_kwargs: str, setup: str) -> int:
    _use_this_checkouts_benchmarks()
    functions = _load(functions_file)
    from engine import LLM

    llm = LLM(**json.loads(llm_kwargs))
    print(json.dumps(getattr(functions, setup)(llm)), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        print(json.dumps(getattr(functions, job["name"])(llm, *job["args"])), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(child_main(*sys.argv[1:4]))
