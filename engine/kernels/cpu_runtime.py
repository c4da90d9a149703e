"""Launching kvrail's CPU team kernels: one at a time, or recorded into a graph and replayed.

A team kernel (`cpu_common.h`) takes one argument struct, mirrored here by a ctypes
Structure. `launch` runs it in a fresh OpenMP team. Inside `capture()`, every launch is also
recorded, with the tensors its struct points to kept alive, into a `CpuGraph`; `replay()`
then runs the whole list in one C call and one team, with a barrier after each kernel: the
CPU's counterpart of a CUDA graph (engine/decode_graphs.py uses it for decode steps). Like a
CUDA graph, a replay reads and writes the captured addresses, so a capture may only launch
kernels: any other tensor op would run once at capture and never again, and is refused.
Kernels allocate their outputs with `empty`: in a capture they come from the capture's
`CpuGraphPool`, whose memory graphs that never run at once share (as CUDA graphs share a
memory pool).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.kernels import cpu_build

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}  # cpu_common.h
_state = threading.local()


def dtype_code(dtype: torch.dtype) -> int:
    if dtype not in DTYPE_CODES:
        raise ValueError(f"the CPU kernels take {list(DTYPE_CODES)}, got {dtype}")
    return DTYPE_CODES[dtype]


@functools.cache
def library() -> ctypes.CDLL:
    lib = cpu_build.load_library()
    cpu_build.declare(lib, "kvrail_run", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int])
    cpu_build.declare(lib, "kvrail_replay", [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int])
    return lib


@functools.cache
def _kernel_address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


@contextlib.contextmanager
def kernel_library(lib: ctypes.CDLL | None) -> Iterator[None]:
    """Launch this thread's kernels from `lib`, another build of the kernel library (a git
    ref's; None: this checkout's), inside this block: a benchmark's before and after of a
    kernel in one process, the two builds taking turns (`benchmarks.linear_kernels
    --baseline-ref`). The launchers are this checkout's, so `lib`'s kernels must take the
    same argument structs and data layouts."""
    if lib is not None:
        cpu_build.declare(lib, "kvrail_run", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int])
    previous = getattr(_state, "library", None)
    _state.library = lib
    try:
        yield
    finally:
        _state.library = previous


class _Node(ctypes.Structure):  # struct kvrail_node
    _fields_ = [("fn", ctypes.c_void_p), ("args", ctypes.c_void_p), ("serial", ctypes.c_int64)]


class CpuGraph:
    """Kernels recorded by `capture()`, replayed in order by one call."""

    def __init__(self) -> None:
        self.nodes: list[tuple[int, ctypes.Structure, bool]] = []
        self.keep: list[Any] = []  # every tensor a recorded struct points to
        self._array: ctypes.Array | None = None

    def record(
        self, fn: int, args: ctypes.Structure, serial: bool, tensors: tuple[Any, ...]
    ) -> None:
        self.nodes.append((fn, args, serial))
        self.keep.extend(tensors)

    def replay(self) -> None:
        if self._array is None:
            self._array = (_Node * len(self.nodes))(
                *(_Node(fn, ctypes.addressof(args), serial) for fn, args, serial in self.nodes)
            )
        with _profiled("kvrail::cpu_graph"):
            library().kvrail_replay(self._array, len(self.nodes), torch.get_num_threads())


class CpuGraphPool:
    """Memory for the tensors that captures allocate, in chunks that never move. Each capture
    starts again at the first chunk (`reset`), so graphs share it: only one runs at a time."""

    CHUNK_BYTES = 16 << 20

    def __init__(self) -> None:
        self.chunks: list[torch.Tensor] = []
        self.index = 0  # the chunk being filled
        self.offset = 0  # bytes used in it

    def reset(self) -> None:
        self.index = self.offset = 0

    def allocate(self, num_bytes: int) -> torch.Tensor:
        """`num_bytes` (rounded up to 64: cache lines, AVX-512 loads) as a uint8 tensor."""
        num_bytes = -(-num_bytes // 64) * 64
        while True:
            if self.index == len(self.chunks):
                self.chunks.append(
                    torch.empty(max(self.CHUNK_BYTES, num_bytes) + 64, dtype=torch.uint8)
                )
            chunk = self.chunks[self.index]
            start = -(-(chunk.data_ptr() + self.offset) // 64) * 64 - chunk.data_ptr()
            if start + num_bytes <= chunk.numel():
                self.offset = start + num_bytes
                return chunk[start : start + num_bytes]
            self.index, self.offset = self.index + 1, 0


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor for a kernel's output: from the capture's pool while
    capturing, else a plain allocation."""
    pool = getattr(_state, "pool", None)
    if pool is None:
        return torch.empty(shape, dtype=dtype)
    num_bytes = dtype.itemsize * int(torch.Size(shape).numel())
    return pool.allocate(num_bytes)[:num_bytes].view(dtype).view(shape)


# Ops that only allocate or make views: everything a captured forward may do besides launching.
_CAPTURE_SAFE_OPS = {
    "empty",
    "empty_strided",
    "empty_like",
    "view",
    "_unsafe_view",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "as_strided",
    "unsqueeze",
    "squeeze",
    "t",
    "transpose",
    "permute",
    "expand",
    "alias",
    "detach",
    "_record_function_enter_new",  # torch.profiler's labels
    "_record_function_exit",
}


class _OnlyKernels(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _CAPTURE_SAFE_OPS:
            raise RuntimeError(
                f"aten.{name} inside a CPU graph capture would run once and never be replayed"
            )
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def capture(pool: CpuGraphPool | None = None) -> Iterator[CpuGraph]:
    """Record the kernels launched (and run) in this block on this thread into a graph; the
    tensors they allocate come from `pool` (reset first) or, without one, a private pool."""
    if getattr(_state, "graph", None) is not None:
        raise RuntimeError("CPU graph captures do not nest")
    pool = pool or CpuGraphPool()
    pool.reset()
    graph = _state.graph = CpuGraph()
    _state.pool = pool
    graph.keep.append(pool)
    try:
        with _OnlyKernels():
            yield graph
    finally:
        _state.graph = _state.pool = None


# Below this many elements of work a kernel runs on one thread (torch's grain size): waking
# the team and waiting at its barrier costs more than the work, and far more when another
# process holds the other core.
SERIAL_WORK = 32768


def launch(name: str, args: ctypes.Structure, *tensors: Any, work: int | None = None) -> None:
    """Run team kernel `name` on `args` now (and record it while capturing). `tensors` are
    what `args` points to: a graph keeps them alive. `work` (elements touched; None = a lot)
    below SERIAL_WORK runs it on one thread."""
    lib = getattr(_state, "library", None) or library()
    fn = _kernel_address(lib, name)
    serial = work is not None and work < SERIAL_WORK
    graph = getattr(_state, "graph", None)
    if graph is not None:
        graph.record(fn, args, serial, tensors)
    with _profiled(name):
        lib.kvrail_run(fn, ctypes.byref(args), 1 if serial else torch.get_num_threads())


def _profiled(name: str) -> contextlib.AbstractContextManager:
    """A label for torch.profiler, which sees no op inside a ctypes call; free without it."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def ptr(tensor: torch.Tensor | None) -> int | None:
    """A tensor's address for an argument struct (None: a NULL pointer)."""
    return None if tensor is None else tensor.data_ptr()
