"""Linear layers on the CPU: W8A8 int8 and packed bf16 for every batch size, and float GEMV
for small ones.

Launchers of `cpu_linear.c` (see its header for the kernels) and their PyTorch references.
`pack_int8` lays int8 weights out for the W8A8 kernel once, at load; `linear_w8a8` then
quantizes each token's activations, multiplies in int8 and dequantizes in one call.
`pack_bf16` lays bf16 weights out the same way for `linear_bf16_packed` (AVX512-BF16), which
beats oneDNN's bf16 matmul at every batch size where the CPU has no AMX tile unit.
`linear_float` is the float kernel over plain weights for the few-token steps of
single-stream decode elsewhere, where oneDNN's matmul reads the weights at half the memory
bandwidth.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kernels.cpu_runtime import dtype_code, empty, launch, ptr

PANEL = 16  # output columns per packed panel
KGROUP = 4  # consecutive k per 32-bit lane
K_ALIGN = 64  # k padded to one AMX tile row (64 int8), so every tile step is full
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class QuantizeRowsArgs(ctypes.Structure):  # struct kvrail_quantize_rows_args
    _fields_ = [
        *[(name, _P) for name in ("x", "x_q", "x_scale")],
        *[
            (name, _I64)
            for name in ("x_dtype", "num_tokens", "in_features", "stride_x", "k_padded")
        ],
    ]


class W8A8Args(ctypes.Structure):  # struct kvrail_w8a8_args
    _fields_ = [
        *[
            (name, _P)
            for name in ("x_q", "x_scale", "w_packed", "w_scale", "w_comp", "bias", "out")
        ],
        *[
            (name, _I64)
            for name in (
                "out_dtype",
                "num_tokens",
                "num_panels",
                "k_padded",
                "silu_mul",
                "out_features",
                "stride_out",
                "stream_out",
            )
        ],
    ]


class Bf16PackedArgs(ctypes.Structure):  # struct kvrail_bf16_packed_args
    _fields_ = [
        *[(name, _P) for name in ("x", "w_packed", "bias", "out")],
        *[
            (name, _I64)
            for name in (
                "out_dtype",
                "num_tokens",
                "num_panels",
                "in_features",
                "silu_mul",
                "out_features",
                "stride_x",
                "stride_out",
                "stream_out",
            )
        ],
    ]


class FloatLinearArgs(ctypes.Structure):  # struct kvrail_float_linear_args
    _fields_ = [
        *[(name, _P) for name in ("x", "w", "bias", "out")],
        *[
            (name, _I64)
            for name in (
                "dtype",
                "num_tokens",
                "in_features",
                "stride_x",
                "silu_mul",
                "out_features",
                "stride_out",
                "out_dtype",
            )
        ],
    ]


@dataclass
class PackedWeight:
    """A weight laid out in panels of 16 output columns (`packed_rows` order) for a C kernel."""

    packed: torch.Tensor  # [num_panels, k_padded // group, 16, group]
    bias: torch.Tensor | None  # [num_panels * 16] float32
    out_features: int  # N of the result (half the rows with silu_mul)
    in_features: int  # K
    silu_mul: bool  # rows are [gate; up]; the result is silu(x gate^T) * (x up^T)


@dataclass
class PackedInt8Weight(PackedWeight):
    """An int8 weight for `linear_w8a8`: groups of 4 k, K padded to K_ALIGN."""

    scale: torch.Tensor  # [num_panels * 16] float32, per output column
    comp: torch.Tensor  # [num_panels * 16] int32, 128 * sum_k w (the activations' +128 offset)


def packed_rows(num_rows: int, silu_mul: bool) -> torch.Tensor:
    """The weight row behind each packed column (-1 = padding). With `silu_mul`, gate panel
    p and up panel p are adjacent, so one register tile holds both halves of its outputs."""
    if not silu_mul:
        num_panels = -(-num_rows // PANEL)
        rows = torch.arange(num_panels * PANEL)
        return torch.where(rows < num_rows, rows, -1)
    half = num_rows // 2
    num_pairs = -(-half // PANEL)
    col = torch.arange(num_pairs * PANEL).view(num_pairs, 1, PANEL)
    rows = torch.cat((col, col + half), dim=1)  # [pair, gate/up, 16]
    rows = torch.where(col < half, rows, -1)
    return rows.flatten()


def _pack_columns(
    weight: torch.Tensor, silu_mul: bool, k_padded: int
) -> tuple[torch.Tensor, Callable[[torch.Tensor | None, torch.dtype], torch.Tensor | None]]:
    """weight `[N_w, K]` as `[columns, k_padded]` in packed column order (`packed_rows`; zeros
    in the padding), and what puts per-row values `[N_w]` in that order (None stays None)."""
    num_rows, in_features = weight.shape
    if silu_mul and num_rows % 2:
        raise ValueError("a gate/up weight needs an even number of rows")
    rows = packed_rows(num_rows, silu_mul)
    valid = rows >= 0
    w = torch.zeros((len(rows), k_padded), dtype=weight.dtype)
    w[valid, :in_features] = weight[rows[valid]]

    def column(values: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        if values is None:
            return None
        out = torch.zeros(len(rows), dtype=dtype)
        out[valid] = values[rows[valid]].to(dtype)
        return out

    return w, column


def _panels(w: torch.Tensor, group: int) -> torch.Tensor:
    """`[columns, k]` -> `[columns / 16, k / group, 16, group]`: a panel's 16 columns side by
    side, `group` consecutive k in each 32-bit lane."""
    return w.view(-1, PANEL, w.shape[1] // group, group).permute(0, 2, 1, 3).contiguous()


def pack_int8(
    weight_q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool
) -> PackedInt8Weight:
    """weight_q `[N_w, K]` int8, scale `[N_w]` (per row), bias `[N_w]` or None."""
    num_rows, in_features = weight_q.shape
    k_padded = -(-in_features // K_ALIGN) * K_ALIGN
    w, column = _pack_columns(weight_q, silu_mul, k_padded)
    return PackedInt8Weight(
        packed=_panels(w, KGROUP),
        scale=column(scale, torch.float32),
        comp=(128 * w.sum(dim=1, dtype=torch.int32)).to(torch.int32),
        bias=column(bias, torch.float32),
        out_features=num_rows // 2 if silu_mul else num_rows,
        in_features=in_features,
        silu_mul=silu_mul,
    )


class PackedBf16Weight(PackedWeight):
    """A bfloat16 weight for `linear_bf16_packed`: pairs of k, K rounded up to even."""


def pack_bf16(weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> PackedBf16Weight:
    """weight `[N_w, K]` bfloat16, bias `[N_w]` or None."""
    num_rows, in_features = weight.shape
    if weight.dtype != torch.bfloat16:
        raise ValueError(f"pack_bf16 takes a bfloat16 weight, got {weight.dtype}")
    w, column = _pack_columns(weight, silu_mul, in_features + in_features % 2)
    return PackedBf16Weight(
        packed=_panels(w, 2),
        bias=column(bias, torch.float32),
        out_features=num_rows // 2 if silu_mul else num_rows,
        in_features=in_features,
        silu_mul=silu_mul,
    )


def _check_activations(x: torch.Tensor, in_features: int) -> None:
    if x.dim() != 2 or x.shape[1] != in_features or x.stride(1) != 1 or x.device.type != "cpu":
        raise ValueError(f"x must be a CPU [M, {in_features}] tensor with contiguous rows")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be float32 or bfloat16, got {x.dtype}")


def linear_w8a8(
    x: torch.Tensor, weight: PackedInt8Weight, stream_out: bool = False
) -> torch.Tensor:
    """x `[M, K]` (float32 or bfloat16) -> `[M, N]` in x's dtype; `stream_out`: written around
    the caches, for an output read once, later (`cpu_linear.c`, STREAM_OUT)."""
    _check_activations(x, weight.in_features)
    num_tokens = x.shape[0]
    out = empty((num_tokens, weight.out_features), x.dtype)
    if num_tokens == 0:
        return out
    num_panels, num_groups = weight.packed.shape[:2]
    k_padded = num_groups * KGROUP
    x_q = empty((num_tokens, k_padded), torch.uint8)
    x_scale = empty((num_tokens,), torch.float32)
    quantize = QuantizeRowsArgs(
        x=x.data_ptr(),
        x_q=x_q.data_ptr(),
        x_scale=x_scale.data_ptr(),
        x_dtype=dtype_code(x.dtype),
        num_tokens=num_tokens,
        in_features=weight.in_features,
        stride_x=x.stride(0),
        k_padded=k_padded,
    )
    launch("kvrail_quantize_rows", quantize, x, x_q, x_scale, work=x_q.numel())
    multiply = W8A8Args(
        x_q=x_q.data_ptr(),
        x_scale=x_scale.data_ptr(),
        w_packed=weight.packed.data_ptr(),
        w_scale=weight.scale.data_ptr(),
        w_comp=weight.comp.data_ptr(),
        bias=ptr(weight.bias),
        out=out.data_ptr(),
        out_dtype=dtype_code(out.dtype),
        num_tokens=num_tokens,
        num_panels=num_panels,
        k_padded=k_padded,
        silu_mul=weight.silu_mul,
        out_features=weight.out_features,
        stride_out=out.stride(0),
        stream_out=stream_out,
    )
    launch("kvrail_linear_w8a8", multiply, x_q, x_scale, weight, out)
    return out


def linear_bf16_packed(
    x: torch.Tensor,
    weight: PackedBf16Weight,
    out_dtype: torch.dtype | None = None,
    stream_out: bool = False,
) -> torch.Tensor:
    """x `[M, K]` bfloat16 -> `[M, N]` in `out_dtype`: bfloat16 (None) or float32, the sums
    unrounded; `stream_out` as in `linear_w8a8`."""
    _check_activations(x, weight.in_features)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bfloat16, got {x.dtype}")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    out = empty((x.shape[0], weight.out_features), out_dtype)
    if x.shape[0]:
        args = Bf16PackedArgs(
            x=x.data_ptr(),
            w_packed=weight.packed.data_ptr(),
            bias=ptr(weight.bias),
            out=out.data_ptr(),
            out_dtype=dtype_code(out_dtype),
            num_tokens=x.shape[0],
            num_panels=weight.packed.shape[0],
            in_features=weight.in_features,
            silu_mul=weight.silu_mul,
            out_features=weight.out_features,
            stride_x=x.stride(0),
            stride_out=out.stride(0),
            stream_out=stream_out,
        )
        launch("kvrail_linear_bf16_packed", args, x, weight, out)
    return out


def linear_float(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu_mul: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x `[M, K]` @ weight `[N_w, K]`^T (+ bias `[N_w]` float32), in `out_dtype`: x's (== weight's,
    None) or float32, the sums unrounded.

    With `silu_mul` the rows of weight (and bias) are [gate; up] and the result `[M, N_w / 2]`
    is silu(gate) * up."""
    _check_activations(x, weight.shape[1])
    if weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError("weight must be contiguous and of x's dtype")
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError("bias must be a contiguous float32 tensor")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in (x.dtype, torch.float32):
        raise ValueError(f"out_dtype must be x's dtype or float32, got {out_dtype}")
    num_rows, in_features = weight.shape
    out = empty((x.shape[0], num_rows // 2 if silu_mul else num_rows), out_dtype)
    if x.shape[0]:
        args = FloatLinearArgs(
            x=x.data_ptr(),
            w=weight.data_ptr(),
            bias=ptr(bias),
            out=out.data_ptr(),
            dtype=dtype_code(x.dtype),
            num_tokens=x.shape[0],
            in_features=in_features,
            stride_x=x.stride(0),
            silu_mul=silu_mul,
            out_features=out.shape[1],
            stride_out=out.stride(0),
            out_dtype=dtype_code(out_dtype),
        )
        launch("kvrail_linear_float", args, x, out)
    return out
