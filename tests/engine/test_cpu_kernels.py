"""kvrail's C kernels for the CPU against their PyTorch references, their build, and graphs.

Linear kernels: W8A8 int8, packed bf16 and the small-M float kernel; the model's small ops
(same references as the Triton kernels); the KV write (float and fp8); capture and replay of
CPU graphs.
"""

from __future__ import annotations

import ctypes
import math
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_build, cpu_linear, cpu_ops, cpu_runtime
from engine.kernels.int8_ref import int8_linear_ref, quantize_rows_int8
from engine.kernels.kv_cache_write import write_kv_cache_ref
from engine.kernels.rms_norm import rms_norm_ref
from engine.kernels.rotary import rotary_embedding_ref
from engine.kernels.silu_and_mul import silu_and_mul_ref
from engine.models.llama import build_cos_sin_cache

DTYPES = [torch.float32, torch.bfloat16]


def _rebuild() -> None:
    cpu_build.load_library.cache_clear()
    cpu_runtime.library.cache_clear()
    cpu_runtime._kernel_address.cache_clear()


def test_build_is_cached_leaves_subnormals_alone_and_fails_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRAIL_CACHE_DIR", str(tmp_path))
    _rebuild()
    try:
        cpu_runtime.library()  # built and loaded for the first time in this process
        # Built with -ffast-math, the library must not flush subnormals to zero process-wide
        # (gcc links crtfastmath.o into a library linked with -ffast-math).
        assert sys.float_info.min / 2 > 0.0
        assert (torch.tensor([1e-39]) * 0.5).item() > 0.0  # fp32 subnormal survives
        (built,) = (tmp_path / "kernels").glob("*.so")
        built_at = built.stat().st_mtime_ns
        _rebuild()
        cpu_runtime.library()  # the cached library is loaded, not rebuilt
        assert [p.stat().st_mtime_ns for p in (tmp_path / "kernels").glob("*.so")] == [built_at]
        _rebuild()
        monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
        with pytest.raises(RuntimeError, match=r"building cpu_\w+\.c failed"):
            cpu_runtime.library()
    finally:
        _rebuild()


def test_kernels_launch_from_another_build_inside_kernel_library(tmp_path):
    """A second copy of the library, loaded from another path, has its kernels at other
    addresses: launches inside the block go through it (with the same results), and through
    this build again after it."""
    copy = ctypes.CDLL(str(shutil.copy(cpu_runtime.library()._name, tmp_path / "copy.so")))
    name = "kvrail_argmax_rows"
    theirs = cpu_runtime._kernel_address(copy, name)
    assert theirs != cpu_runtime._kernel_address(cpu_runtime.library(), name)
    x = torch.randn(3, 1000)
    launched = []
    with cpu_runtime.kernel_library(copy):
        run = copy.kvrail_run  # declared by kernel_library: a pointer is not an int
        copy.kvrail_run = lambda fn, *args: (launched.append(fn), run(fn, *args))[1]
        assert torch.equal(cpu_ops.argmax_rows(x), x.argmax(-1))
    assert launched == [theirs]
    assert torch.equal(cpu_ops.argmax_rows(x), x.argmax(-1))
    assert launched == [theirs]  # not through the copy after the block


# Linear layers ------------------------------------------------------------------------------

# M = 1, 7, 64, 300 (the sizes: register-tile remainders of 6 rows and 4 panels);
# N and K off every tile size; with and without bias and the fused SiLU-and-multiply; the
# last K spans two chunks of the AVX2 W8A8 tile's widened activations (2048 k each).
LINEAR_CASES = [
    (1, 40, 36, False, True),
    (7, 34, 20, True, False),
    (64, 96, 72, False, False),
    (300, 50, 100, True, True),
    (9, 20, 2100, False, True),
]


def _int8_inputs(m, n, k, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    w = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen)
    return x, w, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,silu_mul,has_bias", LINEAR_CASES)
def test_w8a8_matches_its_reference(dtype, m, n, k, silu_mul, has_bias):
    x, w, bias = _int8_inputs(m, 2 * n if silu_mul else n, k, dtype)
    bias = bias if has_bias else None
    w_q, w_scale = quantize_rows_int8(w)
    packed = cpu_linear.pack_int8(w_q, w_scale, bias, silu_mul)
    out = cpu_linear.linear_w8a8(x, packed)
    expected = int8_linear_ref(x, w_q, w_scale, bias, silu_mul)
    assert out.shape == expected.shape == (m, n) and out.dtype == dtype
    # Same integer sums; an activation exactly halfway between two int8 steps may round the
    # other way (the kernel multiplies by 127 / max, the reference divides by max / 127): allow
    # one step on one activation, through SiLU-and-multiply where fused, plus the output
    # dtype's rounding.
    _, x_scale = quantize_rows_int8(x)
    step = x_scale[:, None] * (w_q.abs().amax(dim=1).float() * w_scale)[None, :]
    if silu_mul:
        pre = int8_linear_ref(x.float(), w_q, w_scale, bias).float()
        gate, up = pre.chunk(2, dim=-1)
        step_gate, step_up = step.chunk(2, dim=-1)
        step = 1.1 * up.abs() * step_gate + F.silu(gate).abs() * step_up  # |silu'| <= 1.1
    eps = 0.0 if dtype == torch.float32 else 2**-7  # one bf16 ulp
    bound = step + eps * expected.float().abs() + 1e-5
    assert ((out.float() - expected.float()).abs() <= bound).all()


@pytest.mark.parametrize("silu_mul", [False, True])
def test_w8a8_rows_do_not_depend_on_the_batch(silu_mul):
    """Integer sums are exact on every path (where the CPU has AMX, blocks of 32 and 16 rows
    and a last one of fewer; vector tiles of up to 6 rows, the tail) and all share one
    epilogue, so a row computed in a batch of 308 equals the same row computed alone, bit for
    bit."""
    x, w, bias = _int8_inputs(308, 100, 136, torch.bfloat16)  # 9 x 32 + 16 + 4 rows
    w_q, w_scale = quantize_rows_int8(w)
    packed = cpu_linear.pack_int8(w_q, w_scale, bias, silu_mul)
    out = cpu_linear.linear_w8a8(x, packed)
    for i in (0, 15, 16, 31, 32, 287, 288, 303, 304, 307):  # block and tile edges
        assert torch.equal(out[i : i + 1], cpu_linear.linear_w8a8(x[i : i + 1], packed)), i


@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_w8a8_is_close_to_the_float_linear(m):
    """W8A8 against the unquantized x W^T + b in fp32. Tolerance: int8 keeps ~7 bits per
    value; on these Gaussian inputs the measured relative error of the output is 0.87-0.97%
    (rms), so 2% flags a wrong scale or offset (errors of order 100%) without flakiness."""
    x, w, bias = _int8_inputs(m, 48, 200, torch.float32, seed=m)
    w_q, w_scale = quantize_rows_int8(w)
    out = cpu_linear.linear_w8a8(x, cpu_linear.pack_int8(w_q, w_scale, bias, False))
    expected = F.linear(x, w, bias)
    assert (out - expected).norm() / expected.norm() < 0.02


# Rows in tiles of up to 6 (and of 16 and 32 on the packed kernel's AMX-BF16 path, which
# takes k a multiple of 32); 100 columns end in a panel of 4.
FLOAT_CASES = [
    *LINEAR_CASES[:3],
    (5, 52, 64, True, True),
    (6, 36, 70, False, True),  # one tile of 6 rows, k past the last 32
    (11, 40, 96, True, False),  # tiles of 6 and 5 rows
    (16, 100, 96, False, False),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,silu_mul,has_bias", FLOAT_CASES)
def test_float_kernel_matches_torch(dtype, m, n, k, silu_mul, has_bias):
    x, w, bias = _int8_inputs(m, 2 * n if silu_mul else n, k, dtype)
    bias = bias if has_bias else None
    out = cpu_linear.linear_float(x, w.to(dtype).contiguous(), bias, silu_mul)
    expected = F.linear(x.float(), w.to(dtype).float(), bias)
    if silu_mul:
        expected = silu_and_mul_ref(expected)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), expected, **tol)
    # float32 out (the LM head's logits): the sums unrounded, where bf16 keeps 8 bits
    out32 = cpu_linear.linear_float(x, w.to(dtype).contiguous(), bias, silu_mul, torch.float32)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32, expected, atol=1e-4, rtol=1e-4 if silu_mul else 2e-5)


needs_avx512_bf16 = pytest.mark.skipif(
    not torch.cpu._is_avx512_bf16_supported(), reason="the packed bf16 kernel needs AVX512-BF16"
)
PACKED_CASES = [
    *FLOAT_CASES,
    (7, 37, 33, False, True),  # odd K: the last pair is one element
    (300, 40, 96, True, True),  # 50 tiles of 6 rows; a prompt step's size
]


@needs_avx512_bf16
@pytest.mark.parametrize("m,n,k,silu_mul,has_bias", PACKED_CASES)
def test_packed_bf16_kernel_matches_torch(m, n, k, silu_mul, has_bias):
    x, w, bias = _int8_inputs(m, 2 * n if silu_mul else n, k, torch.bfloat16)
    bias = bias if has_bias else None
    w = w.bfloat16()
    packed = cpu_linear.pack_bf16(w, bias, silu_mul)
    expected = F.linear(x.float(), w.float(), bias)
    if silu_mul:
        expected = silu_and_mul_ref(expected)
    out = cpu_linear.linear_bf16_packed(x, packed)
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=2e-2)
    # float32 out (the LM head's logits): the sums unrounded
    out32 = cpu_linear.linear_bf16_packed(x, packed, torch.float32)
    torch.testing.assert_close(out32, expected, atol=1e-4, rtol=1e-4 if silu_mul else 2e-5)
    # A row's sums are added in one order whatever the tile: any row alone, at another
    # address, equals its row of the batch bit for bit (verify steps round as decode steps).
    for i in (0, m // 2, m - 1):
        alone = cpu_linear.linear_bf16_packed(_at_offset(x[i : i + 1], 5), packed, torch.float32)
        assert torch.equal(alone[0], out32[i])


@pytest.mark.parametrize("m,n", [(1, 100), (40, 96), (300, 100)])
def test_streamed_outputs_equal_the_stored_ones(m, n):
    """`stream_out` (logits written around the caches) changes how each line is stored, never
    what: both kernels, on the vector and tile paths, with a last panel only partly filled."""
    x, w, bias = _int8_inputs(m, n, 64, torch.bfloat16)
    w_q, scale = quantize_rows_int8(w)
    packed = cpu_linear.pack_int8(w_q, scale, bias, False)
    assert torch.equal(
        cpu_linear.linear_w8a8(x, packed, stream_out=True), cpu_linear.linear_w8a8(x, packed)
    )
    if torch.cpu._is_avx512_bf16_supported():
        packed_bf16 = cpu_linear.pack_bf16(w.bfloat16(), bias, False)
        for out_dtype in (torch.bfloat16, torch.float32):
            streamed = cpu_linear.linear_bf16_packed(x, packed_bf16, out_dtype, stream_out=True)
            assert torch.equal(streamed, cpu_linear.linear_bf16_packed(x, packed_bf16, out_dtype))


def test_only_large_logits_are_streamed():
    from engine.models.layers import STREAM_LOGITS_MIN_BYTES, Linear, LinearMethod

    method = LinearMethod(None, torch.float32)
    head = Linear(576, 49152, False, method, computes_logits=True)
    rows = STREAM_LOGITS_MIN_BYTES // (49152 * 4)  # rows + 1: the fewest fp32 rows that stream
    assert head.streams_out(rows + 1, torch.float32)
    assert not head.streams_out(rows, torch.float32)
    assert not head.streams_out(rows + 1, torch.bfloat16)  # half the bytes
    other = Linear(576, 49152, False, method)
    assert not other.streams_out(4096, torch.float32)


def _at_offset(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of `t` starting `offset` elements into a fresh buffer: other addresses, so a
    kernel whose code path depends on them (alignment, alias checks) shows it."""
    buffer = torch.zeros(t.numel() + offset, dtype=t.dtype)
    out = buffer[offset:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_do_not_depend_on_the_batch(dtype):
    """A verify step's rows must equal those of decode steps bit for bit (greedy speculation
    then changes no token, in bf16 too): every per-token kernel, on a row of a batch and on
    the same row alone at other addresses. The float linear holds it up to 6 rows, one
    vector tile of rows (the packed kernels, for every M: their own tests)."""
    gen = torch.Generator().manual_seed(3)
    hidden, heads, kv_heads, head_dim = 96, 9, 3, 64  # SmolLM2's heads
    x = torch.randn(6, hidden, generator=gen).to(dtype)
    residual = torch.randn(6, hidden, generator=gen).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    w = torch.randn(2 * 40, hidden, generator=gen).to(dtype)
    cache = build_cos_sin_cache(1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim), 512)
    qkv = torch.randn(6, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype) * 4
    positions = torch.tensor([290, 291, 292, 293, 294, 17])

    def rotate(rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        q = rows[:, : heads * head_dim].view(-1, heads, head_dim)
        k = rows[:, heads * head_dim : (heads + kv_heads) * head_dim].view(-1, kv_heads, head_dim)
        cpu_ops.rotary_embedding(pos, q, k, cache)
        return rows

    batch_norm = cpu_ops.rms_norm(x, weight, 1e-6, residual.clone())
    batch_rotated = rotate(qkv.clone(), positions)
    for m in range(1, 7):
        batch_linear = cpu_linear.linear_float(x[:m], w, None, True)
        for i in range(m):
            alone = cpu_linear.linear_float(x[i : i + 1], w, None, True)
            assert torch.equal(batch_linear[i], alone[0])
    for offset in range(0, 40, 3):
        for i in range(6):
            row, res = (_at_offset(t[i : i + 1], offset) for t in (x, residual))
            out, summed = cpu_ops.rms_norm(row, weight, 1e-6, res)
            assert torch.equal(out[0], batch_norm[0][i])
            assert torch.equal(summed[0], batch_norm[1][i])
            alone = rotate(_at_offset(qkv[i : i + 1], offset), positions[i : i + 1])
            assert torch.equal(alone[0], batch_rotated[i]), (offset, i)


def test_linear_kernels_reject_what_they_cannot_read():
    x = torch.randn(3, 8)
    w_q, w_scale = quantize_rows_int8(torch.randn(4, 8))
    packed = cpu_linear.pack_int8(w_q, w_scale, None, False)
    with pytest.raises(ValueError, match="contiguous rows"):
        cpu_linear.linear_w8a8(x.t().contiguous().t(), packed)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_linear.linear_w8a8(x.half(), packed)
    with pytest.raises(ValueError, match="even number of rows"):
        cpu_linear.pack_int8(w_q[:3], w_scale[:3], None, True)
    with pytest.raises(ValueError, match="of x's dtype"):
        cpu_linear.linear_float(x, torch.randn(4, 8).bfloat16(), None)
    with pytest.raises(ValueError, match="out_dtype"):
        cpu_linear.linear_float(x, torch.randn(4, 8), None, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="bfloat16 weight"):
        cpu_linear.pack_bf16(torch.randn(4, 8), None, False)
    bf16_packed = cpu_linear.pack_bf16(torch.randn(4, 8).bfloat16(), None, False)
    with pytest.raises(ValueError, match="x must be bfloat16"):
        cpu_linear.linear_bf16_packed(x, bf16_packed)
    with pytest.raises(ValueError, match="out_dtype"):
        cpu_linear.linear_bf16_packed(x.bfloat16(), bf16_packed, torch.float16)


def test_packing_keeps_gate_and_up_panels_together():
    rows = cpu_linear.packed_rows(2 * 20, silu_mul=True).view(-1, 16)
    # pairs of (gate, up) panels; the second pair is half padding
    assert rows[0].tolist() == list(range(16)) and rows[1].tolist() == list(range(20, 36))
    assert rows[2, :4].tolist() == [16, 17, 18, 19] and (rows[2, 4:] == -1).all()
    assert rows[3, :4].tolist() == [36, 37, 38, 39] and (rows[3, 4:] == -1).all()


# Small ops ------------------------------------------------------------------------------------

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, 40, generator=gen).to(dtype)[:, 0]  # strided rows
    residual = torch.randn(5, 40, generator=gen).to(dtype)
    weight = torch.randn(40, generator=gen).to(dtype)
    torch.testing.assert_close(
        cpu_ops.rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), **TOL[dtype]
    )
    out, summed = cpu_ops.rms_norm(x, weight, 1e-6, residual)
    expected, expected_sum = rms_norm_ref(x, weight, 1e-6, residual)
    torch.testing.assert_close(out, expected, **TOL[dtype])
    assert torch.equal(summed, expected_sum)
    # Per-head rows of a strided q (Qwen3's q/k norm).
    q = torch.randn(3, 7 * 16, generator=gen).to(dtype)[:, : 4 * 16].view(3, 4, 16)
    w16 = torch.randn(16, generator=gen).to(dtype)
    torch.testing.assert_close(
        cpu_ops.rms_norm(q, w16, 1e-6), rms_norm_ref(q, w16, 1e-6), **TOL[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place(dtype):
    gen = torch.Generator().manual_seed(1)
    cache = build_cos_sin_cache(1.0 / 10000 ** (torch.arange(0, 16, 2) / 16), 64)
    qkv = torch.randn(6, (4 + 2 + 2) * 16, generator=gen).to(dtype)
    q, k = qkv[:, :64].view(6, 4, 16), qkv[:, 64:96].view(6, 2, 16)
    positions = torch.tensor([0, 5, 63, 1, 2, 30])
    expected_q, expected_k = rotary_embedding_ref(positions, q, k, cache)
    v_before = qkv[:, 96:].clone()
    cpu_ops.rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(q, expected_q, **TOL[dtype])
    torch.testing.assert_close(k, expected_k, **TOL[dtype])
    assert torch.equal(qkv[:, 96:], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = torch.randn(5, 2 * 24).to(dtype)
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), silu_and_mul_ref(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_takes_the_first_nan_as_torch_max_does(dtype):
    x = torch.randn(6, 130).to(dtype)
    x[0, 100], x[0, 7] = float("nan"), -float("nan")  # any NaN is the maximum: the first
    x[1, 129] = float("nan")
    x[2, 5] = float("inf")
    rows = x[:, ::2].contiguous()[:, :50]  # rows apart by a stride
    strided = torch.randn(6, 100).to(dtype)[:, :50]
    for t in (x, rows, strided):
        assert torch.equal(cpu_ops.argmax_rows(t), t.max(dim=-1).indices)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        cpu_ops.argmax_rows(x.t())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 15, 16, 63, 64, 65, 200, 49152])
def test_argmax_rows_takes_the_first_of_equal_maxima(dtype, width):
    """Ties (the same value twice, -0 against +0), rows of -inf, and widths around the
    kernel's 16- and 64-wide steps."""
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(8, width, generator=gen).to(dtype)
    x[1] = -float("inf")
    x[2] = 0.0
    x[2, width // 2] = -0.0  # equal to +0: the first zero wins, whatever its sign
    x[6] = 0.0
    x[6, 0] = -0.0  # so a -0 first is the one taken
    x[3, width - 1] = x[3, width // 3] = 100.0
    x[4, width // 2 :] = 7.0
    x[5, width - 1] = float("nan")
    assert torch.equal(cpu_ops.argmax_rows(x), x.max(dim=-1).indices)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding(dtype):
    weight = torch.randn(50, 24).to(dtype)
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(cpu_ops.embedding(ids, weight, dtype), weight[ids])
    # Rows of an int8 LM head packed in panels, with a column scale (SmoothQuant undone).
    w_q, w_scale = quantize_rows_int8(torch.randn(50, 24))
    packed = cpu_linear.pack_int8(w_q, w_scale, None, False)
    col_scale = torch.rand(24) + 0.5
    rows = cpu_ops.embedding_packed(ids, packed.packed, 50, 24, dtype, packed.scale, col_scale)
    expected = (w_q[ids].float() * w_scale[ids, None] * col_scale).to(dtype)
    torch.testing.assert_close(rows, expected, **TOL[dtype])
    # Rows of a bf16 head packed in pairs (odd hidden: the last pair half padding), exact.
    head = torch.randn(50, 23).bfloat16()
    rows = cpu_ops.embedding_packed(
        ids, cpu_linear.pack_bf16(head, None, False).packed, 50, 23, dtype
    )
    assert torch.equal(rows, head[ids].to(dtype))
    with pytest.raises(ValueError, match="row_scale"):
        cpu_ops.embedding_packed(ids, packed.packed, 50, 24, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache(dtype):
    gen = torch.Generator().manual_seed(2)
    k_cache = torch.randn(4, 8, 2, 16, generator=gen).to(dtype)
    v_cache = torch.randn(4, 8, 2, 16, generator=gen).to(dtype)
    kv = torch.randn(5, 3, 2, 16, generator=gen).to(dtype)
    k, v = kv[:, 1], kv[:, 2]  # strided, as after splitting qkv
    slots = torch.tensor([0, 17, -1, 31, 8])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(k, v, expected_k, expected_v, slots)
    cpu_ops.write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_write_kv_cache_fp8_rounds_and_saturates_like_torch():
    # Normals, subnormals, halfway cases, values past +-448 once scaled, zeros, inf and NaN.
    special = torch.tensor([0.0, -0.0, 1e6, -1e6, math.inf, -math.inf, math.nan])
    values = torch.cat([torch.randn(200) * 30, torch.randn(100) * 0.01, special])
    values = torch.cat([values, torch.zeros(512 - len(values))]).view(16, 2, 16)
    k_cache = torch.zeros(4, 4, 2, 16, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    k_scale, v_scale, k_shift = 0.5, 0.02, torch.randn(2, 16) * 3
    cpu_ops.write_kv_cache(
        values, -values, k_cache, v_cache, torch.arange(16), k_scale, v_scale, k_shift
    )

    def encode(x, scale):
        return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn)

    stored_k = k_cache.view(16, 2, 16).view(torch.uint8)
    stored_v = v_cache.view(16, 2, 16).view(torch.uint8)
    assert torch.equal(stored_k, encode(values - k_shift, k_scale).view(torch.uint8))
    assert torch.equal(stored_v, encode(-values, v_scale).view(torch.uint8))
    with pytest.raises(ValueError, match="k_shift must be contiguous fp32"):
        cpu_ops.write_kv_cache(values, values, k_cache, v_cache, torch.arange(16), 1, 1, k_shift.T)


# CPU graphs -----------------------------------------------------------------------------------


def test_graph_replays_what_it_captured_on_new_inputs():
    x = torch.randn(3, 40)
    w_q, w_scale = quantize_rows_int8(torch.randn(64, 40))
    packed = cpu_linear.pack_int8(w_q, w_scale, None, True)
    norm_weight = torch.randn(40)
    with cpu_runtime.capture() as graph:
        y = cpu_linear.linear_w8a8(cpu_ops.rms_norm(x, norm_weight, 1e-6), packed)
    assert len(graph.nodes) == 3  # norm, quantize, multiply
    for seed in range(3):  # new values in the captured input buffer, then one replay
        x.copy_(torch.randn(3, 40, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        expected = cpu_linear.linear_w8a8(cpu_ops.rms_norm(x, norm_weight, 1e-6), packed)
        assert torch.equal(y, expected)


def test_capture_refuses_ops_that_would_not_replay():
    x = torch.randn(3, 40)
    with pytest.raises(RuntimeError, match=r"aten\.add"), cpu_runtime.capture():
        torch.add(x, 1)
    with cpu_runtime.capture() as graph:  # views and allocations are fine
        x[1:].view(2, 4, 10).transpose(0, 1)
        torch.empty(5)
    assert graph.nodes == []
