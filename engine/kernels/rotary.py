"""Neox-style rotary embedding applied in place to q and k, cos/sin read by position.

`cos_sin_cache` `[max_position, rotary_dim]` holds `cos(pos * inv_freq)` in its first half
and `sin(pos * inv_freq)` in its second (`rotary_dim == head_dim`): each token reads one row,
so nothing per step is computed beyond the positions themselves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(
    X,
    token,
    stride_t,
    stride_h,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    ptrs = X + token * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (x1 * cos - x2 * sin).to(X.dtype.element_ty), mask=mask)
    tl.store(ptrs + HALF, (x2 * cos + x1 * sin).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    Positions,
    Q,
    K,
    Cos_sin_cache,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0)
    pos = tl.load(Positions + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(Cos_sin_cache + pos * stride_cache + offs_d, mask=mask_d, other=0.0)
    sin = tl.load(Cos_sin_cache + pos * stride_cache + HALF + offs_d, mask=mask_d, other=0.0)
    cos = cos.to(tl.float32)[None, :]
    sin = sin.to(tl.float32)[None, :]
    _rotate(Q, token, stride_qt, stride_qh, cos, sin, NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF)
    _rotate(K, token, stride_kt, stride_kh, cos, sin, NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[T, num_heads, head_dim]` and k `[T, num_kv_heads, head_dim]` in place.

    Returns (q, k), the same tensors. The last dimension of each must be contiguous.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    assert cos_sin_cache.shape[-1] == head_dim, "partial rotary is not supported"
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            positions,
            q,
            k,
            cos_sin_cache,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos_sin_cache.stride(0),
            NUM_Q_HEADS=num_q_heads,
            NUM_K_HEADS=k.shape[1],
            HALF=half,
            BLOCK_QH=triton.next_power_of_2(num_q_heads),
            BLOCK_KH=triton.next_power_of_2(k.shape[1]),
            BLOCK_HALF=triton.next_power_of_2(half),
        )
    return q, k


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of `rotary_embedding`, out of place, computed in fp32."""
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
