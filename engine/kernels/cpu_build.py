"""Build and load kvrail's C kernels for the CPU (`engine/kernels/cpu_*.c`) as one library.

The sources are compiled on first use with the system C compiler (`$CC`, else `cc`) into
`KVRAIL_CACHE_DIR/kernels/`, keyed by the sources, the flags and the CPU, and loaded with
ctypes, which releases the GIL for the call. The library links the `libgomp.so.1` torch has
already loaded, so it shares torch's OpenMP threads instead of starting a second pool.
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

from engine import envs

KERNEL_DIR = Path(__file__).parent
# -ffast-math lets expf and the dot-product reductions vectorize (glibc's libmvec); the kernels
# keep to finite values. It is a compile flag only: linked with it, gcc 12 adds
# crtfastmath.o, which turns on flush-to-zero for the whole process when the library loads.
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
LDFLAGS = ("-shared", "-fopenmp")


def compiler() -> str | None:
    """The C compiler to build with, or None when the machine has none."""
    return shutil.which(os.environ.get("CC", "cc"))


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    return frozenset(_cpu_signature().partition(":")[2].split())


@functools.cache
def has_amx_bf16() -> bool:
    """Whether this CPU has AMX-BF16: the tile unit the C packed bf16 kernel and bf16 prompt
    attention run on."""
    return "amx_bf16" in cpu_flags()


def cpu_bf16_unit() -> str | None:
    """What multiplies bf16 on this CPU: "amx" (the tile unit), "vector" (AVX512-BF16's
    vdpbf16ps on the vector unit), or None (bf16 widened to fp32 first). Kernel limits and
    speculation's threshold were measured per unit, since their crossovers differ."""
    import torch

    if not torch.cpu._is_avx512_bf16_supported():
        return None
    return "amx" if has_amx_bf16() else "vector"


def _cpu_signature() -> str:
    """What `-march=native` depends on: a library built for another CPU may not run here."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return os.uname().machine


@functools.cache
def load_library() -> ctypes.CDLL:
    """Build (once per sources, flags and CPU) and load the kernel library."""
    sources = sorted(KERNEL_DIR.glob("cpu_*.c"))
    cc = compiler()
    if cc is None:
        raise RuntimeError("kvrail's CPU kernels need a C compiler: install gcc or set CC")
    digest = hashlib.sha256()
    for path in [*sources, *sorted(KERNEL_DIR.glob("cpu_*.h"))]:
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join((cc, *CFLAGS, *LDFLAGS)).encode() + _cpu_signature().encode())
    path = envs.KVRAIL_CACHE_DIR / "kernels" / f"kvrail_cpu-{digest.hexdigest()[:16]}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: workers starting together never load half a file.
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            objects = []
            for source in sources:
                objects.append(str(Path(tmp) / f"{source.stem}.o"))
                _run([cc, *CFLAGS, "-c", "-o", objects[-1], str(source)], source.name)
            built = Path(tmp) / path.name
            _run([cc, *LDFLAGS, "-o", str(built), *objects, "-lm"], path.name)
            os.replace(built, path)
    return ctypes.CDLL(str(path))


def _run(command: list[str], what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building {what} failed:\n{result.stderr}")


def declare(lib: ctypes.CDLL, name: str, argtypes: list) -> None:
    """Give `lib.name` its argument types (ctypes then converts and checks each call)."""
    fn = getattr(lib, name)
    fn.restype = None
    fn.argtypes = argtypes
