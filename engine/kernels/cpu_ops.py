"""Launchers of the model's small ops on the CPU (`cpu_ops.c`): same contracts as the Triton
kernels next to them (`rms_norm.py`, `rotary.py`, `silu_and_mul.py`, `kv_cache_write.py`),
whose PyTorch references they are tested against, plus the embedding lookup and the argmax
of logit rows (the sampler's greedy tokens, as torch's `max(dim=-1).indices`)."""

from __future__ import annotations

import ctypes

import torch

from engine.kernels.cpu_runtime import dtype_code, empty, launch, ptr

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def _struct(name: str, pointers: str, ints: str, floats: str = "") -> type[ctypes.Structure]:
    """A ctypes mirror of a C argument struct: its pointers, then int64s, then floats."""
    fields = [(n, _P) for n in pointers.split()] + [(n, _I64) for n in ints.split()]
    return type(name, (ctypes.Structure,), {"_fields_": fields + [(n, _F) for n in floats.split()]})


EmbeddingArgs = _struct(
    "EmbeddingArgs",
    "ids weight row_scale col_scale out",
    "weight_dtype out_dtype num_tokens hidden k_padded vocab",
)
RmsNormArgs = _struct(
    "RmsNormArgs",
    "x residual weight out residual_out",
    "dtype weight_dtype num_tokens num_heads hidden stride_x stride_xh stride_residual stride_out "
    "stride_residual_out",
    "eps",
)
RotaryArgs = _struct(
    "RotaryArgs",
    "positions q k cos_sin_cache",
    "dtype num_tokens num_q_heads num_k_heads head_dim stride_qt stride_qh stride_kt stride_kh",
)
SiluAndMulArgs = _struct("SiluAndMulArgs", "x out", "dtype num_tokens width stride_x stride_out")
ArgmaxRowsArgs = _struct("ArgmaxRowsArgs", "x out", "dtype num_rows width stride_x")
WriteKvArgs = _struct(
    "WriteKvArgs",
    "k v k_cache v_cache slot_mapping k_shift",
    "dtype cache_dtype num_tokens num_kv_heads head_dim stride_kt stride_kh stride_vt stride_vh",
    "k_scale v_scale",
)


def embedding(ids: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ids `[T]` int64, weight `[vocab, hidden]` float -> `[T, hidden]` in `dtype`."""
    out = empty((ids.shape[0], weight.shape[1]), dtype)
    args = EmbeddingArgs(
        ids=ids.data_ptr(),
        weight=weight.data_ptr(),
        out=out.data_ptr(),
        weight_dtype=dtype_code(weight.dtype),
        out_dtype=dtype_code(dtype),
        num_tokens=ids.shape[0],
        hidden=weight.shape[1],
        vocab=weight.shape[0],
    )
    launch("kvrail_embedding", args, ids, weight, out, work=out.numel())
    return out


def embedding_packed(
    ids: torch.Tensor,
    packed: torch.Tensor,
    vocab: int,
    hidden: int,
    dtype: torch.dtype,
    row_scale: torch.Tensor | None = None,
    col_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of an LM head packed by `cpu_linear` (tied embeddings): int8 by `pack_int8`,
    `packed` `[panels, k_padded // 4, 16, 4]`, row_scale `[>= vocab]`, col_scale `[hidden]`
    (or None) multiplies each column; or bfloat16 by `pack_bf16`, `[panels, hidden // 2, 16,
    2]`, no scales."""
    if (packed.dtype == torch.int8) != (row_scale is not None):
        raise ValueError("an int8 packed head takes row_scale; a bfloat16 one no scales")
    out = empty((ids.shape[0], hidden), dtype)
    args = EmbeddingArgs(
        ids=ids.data_ptr(),
        weight=packed.data_ptr(),
        row_scale=ptr(row_scale),
        col_scale=ptr(col_scale),
        out=out.data_ptr(),
        weight_dtype=-1 if packed.dtype == torch.int8 else -2,
        out_dtype=dtype_code(dtype),
        num_tokens=ids.shape[0],
        hidden=hidden,
        k_padded=packed.shape[1] * packed.shape[3],
        vocab=vocab,
    )
    launch("kvrail_embedding", args, ids, packed, row_scale, col_scale, out, work=out.numel())
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension of x `[T, H]` or `[T, heads, D]` (last dimension
    contiguous); with `residual` (2-D x only), of x + residual, and that sum is returned too.
    Inputs are not modified."""
    if x.stride(-1) != 1 or (residual is not None and x.dim() != 2):
        raise ValueError("x needs a contiguous last dimension; a residual needs a 2-D x")
    out = empty(x.shape, x.dtype)
    residual_out = empty(x.shape, x.dtype) if residual is not None else None
    args = RmsNormArgs(
        x=x.data_ptr(),
        residual=ptr(residual),
        weight=weight.data_ptr(),
        out=out.data_ptr(),
        residual_out=ptr(residual_out),
        dtype=dtype_code(x.dtype),
        weight_dtype=dtype_code(weight.dtype),
        num_tokens=x.shape[0],
        num_heads=x.shape[1] if x.dim() == 3 else 1,
        hidden=x.shape[-1],
        stride_x=x.stride(0),
        stride_xh=x.stride(1) if x.dim() == 3 else 0,
        stride_residual=0 if residual is None else residual.stride(0),
        stride_out=out.stride(0),
        stride_residual_out=0 if residual_out is None else residual_out.stride(0),
        eps=eps,
    )
    if x.shape[0]:
        launch("kvrail_rms_norm", args, x, residual, weight, out, residual_out, work=out.numel())
    return out if residual is None else (out, residual_out)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[T, num_heads, head_dim]` and k `[T, num_kv_heads, head_dim]` in place
    (last dimension contiguous; positions int64). Returns (q, k)."""
    num_tokens, num_q_heads, head_dim = q.shape
    if q.stride(-1) != 1 or k.stride(-1) != 1 or positions.dtype != torch.int64:
        raise ValueError("q and k need a contiguous last dimension, positions int64")
    if num_tokens:
        args = RotaryArgs(
            positions=positions.data_ptr(),
            q=q.data_ptr(),
            k=k.data_ptr(),
            cos_sin_cache=cos_sin_cache.data_ptr(),
            dtype=dtype_code(q.dtype),
            num_tokens=num_tokens,
            num_q_heads=num_q_heads,
            num_k_heads=k.shape[1],
            head_dim=head_dim,
            stride_qt=q.stride(0),
            stride_qh=q.stride(1),
            stride_kt=k.stride(0),
            stride_kh=k.stride(1),
        )
        launch("kvrail_rotary", args, positions, q, k, cos_sin_cache, work=q.numel() + k.numel())
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x `[T, 2 * I]` -> `[T, I]`; the last dimension of `x` must be contiguous."""
    num_tokens, width = x.shape
    out = empty((num_tokens, width // 2), x.dtype)
    if num_tokens:
        args = SiluAndMulArgs(
            x=x.data_ptr(),
            out=out.data_ptr(),
            dtype=dtype_code(x.dtype),
            num_tokens=num_tokens,
            width=width // 2,
            stride_x=x.stride(0),
            stride_out=out.stride(0),
        )
        launch("kvrail_silu_and_mul", args, x, out, work=x.numel())
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x `[B, V]` float32 or bfloat16 (last dimension contiguous) -> `[B]` int64: each row's
    first maximum (the first NaN where a row has one), as `x.max(dim=-1).indices`."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError("x must be 2-D with a contiguous last dimension")
    out = empty((x.shape[0],), torch.int64)
    if x.shape[0] and x.shape[1]:
        args = ArgmaxRowsArgs(
            x=x.data_ptr(),
            out=out.data_ptr(),
            dtype=dtype_code(x.dtype),
            num_rows=x.shape[0],
            width=x.shape[1],
            stride_x=x.stride(0),
        )
        launch("kvrail_argmax_rows", args, x, out, work=x.numel())
    return out


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    k_shift: torch.Tensor | None = None,
) -> None:
    """Write k, v `[T, num_kv_heads, head_dim]` into the caches at `slot_mapping` `[T]` int64
    (negative: skipped); an fp8 cache stores `quantize_kv`'s values: (x - shift) / scale,
    rounded, saturating at +-448, with `k_shift` fp32 `[num_kv_heads, head_dim]` for K."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or slot_mapping.dtype != torch.int64:
        raise ValueError("k and v need a contiguous last dimension, slot_mapping int64")
    if k_shift is not None and (
        k_shift.dtype != torch.float32
        or k_shift.shape != k.shape[1:]
        or not k_shift.is_contiguous()
    ):
        raise ValueError(f"k_shift must be contiguous fp32 {tuple(k.shape[1:])}")
    if num_tokens:
        args = WriteKvArgs(
            k=k.data_ptr(),
            v=v.data_ptr(),
            k_cache=k_cache.data_ptr(),
            v_cache=v_cache.data_ptr(),
            slot_mapping=slot_mapping.data_ptr(),
            k_shift=None if k_shift is None else k_shift.data_ptr(),
            dtype=dtype_code(k.dtype),
            cache_dtype=dtype_code(k_cache.dtype),
            num_tokens=num_tokens,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            stride_kt=k.stride(0),
            stride_kh=k.stride(1),
            stride_vt=v.stride(0),
            stride_vh=v.stride(1),
            k_scale=k_scale,
            v_scale=v_scale,
        )
        tensors = (k, v, k_cache, v_cache, slot_mapping) + (() if k_shift is None else (k_shift,))
        launch("kvrail_write_kv", args, *tensors, work=2 * k.numel())
