"""Paged decode attention on the CPU: a C kernel (OpenMP) and its Python launcher.

The kernel (`cpu_decode_attention.c`) reads K and V straight from the paged cache through the
block table; the torch path's per-layer gather of every context into a padded copy, then
SDPA over it, cost about three passes over the context (measured: 11.4 ms per layer for 48
sequences of 432 tokens on 2 AVX2 cores, against 3-4 ms here). Its reference is
`decode_attention_ref`, which the Triton decode kernel shares.

The source is compiled on first use with the system C compiler (`$CC`, else `cc`) into
`KVRAIL_CACHE_DIR/kernels/`, keyed by the source, the flags and the CPU, and loaded with
ctypes, which releases the GIL for the call. It links the `libgomp.so.1` torch has already
loaded, so it shares torch's OpenMP threads instead of starting a second pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from engine import envs

SOURCE = Path(__file__).with_name("cpu_decode_attention.c")
# -ffast-math lets expf and the dot-product reductions vectorize (glibc's libmvec); the kernel
# keeps to finite values. It is a compile flag only: linked with it, gcc 12 adds
# crtfastmath.o, which turns on flush-to-zero for the whole process when the library loads.
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
LDFLAGS = ("-shared", "-fopenmp")
# (q and out dtype, cache dtype) -> entry point.
_FUNCTIONS = {
    (torch.float32, torch.float32): "paged_decode_attention_f32",
    (torch.bfloat16, torch.bfloat16): "paged_decode_attention_bf16",
    (torch.float32, torch.float8_e4m3fn): "paged_decode_attention_f32_fp8",
    (torch.bfloat16, torch.float8_e4m3fn): "paged_decode_attention_bf16_fp8",
}
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)  # model dtypes; the cache may also be fp8


def compiler() -> str | None:
    """The C compiler to build with, or None when the machine has none."""
    return shutil.which(os.environ.get("CC", "cc"))


def _cpu_signature() -> str:
    """What `-march=native` depends on: a library built for another CPU may not run here."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return os.uname().machine


@functools.cache
def _library() -> ctypes.CDLL:
    """Build (once per source, flags and CPU) and load the kernel library."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("the cpu attention backend needs a C compiler: install gcc or set CC")
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join((cc, *CFLAGS, *LDFLAGS)).encode() + _cpu_signature().encode()
    ).hexdigest()[:16]
    path = envs.KVRAIL_CACHE_DIR / "kernels" / f"cpu_decode_attention-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: workers starting together never load half a file.
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            obj, built = Path(tmp) / "kernel.o", Path(tmp) / path.name
            for command in (
                [cc, *CFLAGS, "-c", "-o", str(obj), str(SOURCE)],
                [cc, *LDFLAGS, "-o", str(built), str(obj), "-lm"],
            ):
                result = subprocess.run(command, capture_output=True, text=True)
                if result.returncode != 0:
                    raise RuntimeError(f"building {SOURCE.name} failed:\n{result.stderr}")
            os.replace(built, path)
    lib = ctypes.CDLL(str(path))
    for name in _FUNCTIONS.values():
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int] * 5 + [ctypes.c_int64]
        fn.argtypes += [ctypes.c_int, ctypes.c_float, ctypes.c_float, ctypes.c_int]
    return lib


def load() -> None:
    """Build and load the kernel now (raises RuntimeError when it cannot be built)."""
    _library()


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    req_indices: torch.Tensor,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Attend each request `req_indices[i]`'s single query token to its paged context.

    Same contract as the Triton `decode_attention`: q, out `[T, num_heads, head_dim]`
    (contiguous, fp32 or bf16); k_cache, v_cache `[num_blocks, block_size, num_kv_heads,
    head_dim]` in q's dtype, or fp8 e4m3 read as stored * `k_scale` (`v_scale`);
    block_table `[R, max_blocks]`, query_start_loc `[R + 1]`, seq_lens `[R]` and req_indices
    `[n]`, all int32; `max_seq_len` >= every selected seq_len. Writes row
    `query_start_loc[req]` of `out` for each selected request, nothing else.
    """
    lib = _library()
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    for t in (q, out, k_cache, v_cache, block_table, query_start_loc, seq_lens, req_indices):
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("paged_decode_attention takes contiguous CPU tensors")
    function = _FUNCTIONS.get((q.dtype, k_cache.dtype))
    if function is None or not q.dtype == out.dtype or not k_cache.dtype == v_cache.dtype:
        raise ValueError(
            f"q and out must share one dtype of {SUPPORTED_DTYPES}, and the caches that dtype "
            f"or torch.float8_e4m3fn; got q {q.dtype}, out {out.dtype}, caches {k_cache.dtype} "
            f"and {v_cache.dtype}"
        )
    for t in (block_table, query_start_loc, seq_lens, req_indices):
        if t.dtype != torch.int32:
            raise ValueError("block_table, query_start_loc, seq_lens and req_indices are int32")
    # k_scale folds into the query scaling (exact up to fp32 rounding), v_scale into the
    # output's normalization.
    getattr(lib, function)(
        out.data_ptr(),
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        query_start_loc.data_ptr(),
        seq_lens.data_ptr(),
        req_indices.data_ptr(),
        req_indices.numel(),
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        block_table.stride(0),
        max_seq_len,
        scale * k_scale,
        v_scale,
        torch.get_num_threads(),
    )
