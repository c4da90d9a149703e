"""Scatter a step's new K and V into the paged KV cache through `slot_mapping`.

Cache layout per layer: `[num_blocks, block_size, num_kv_heads, head_dim]`; token `t` goes to
block `slot_mapping[t] // block_size`, offset `slot_mapping[t] % block_size`. A negative slot
(a padded row of a CUDA-graph batch) writes nothing.

An fp8 cache stores `round_to_e4m3(clamp((x - shift) / scale, -448, 448))` (`quantize_kv`); the
rounding is the GPU's fp32 -> e4m3 conversion (round to nearest even, compute capability
>= 8.9). TRITON_INTERPRET=1 (triton 3.9) emulates that conversion wrongly: ties round away
from zero, and a rounding carry out of the mantissa is lost (125.6 is stored as 64, not 128),
so under the interpreter only values already on the e4m3 grid are stored exactly; its fp32 ->
bf16 conversion (a bf16 cache under a float32 model) does not round to nearest even either.
`benchmarks/gpu_check.py` compares arbitrary values with torch's conversions on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention import FP8_DTYPE, FP8_MAX, quantize_kv


@triton.jit
def _write_kv_cache_kernel(
    K,
    V,
    K_cache,
    V_cache,
    Slot_mapping,
    K_shift,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    PAGE_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
    HAS_K_SHIFT: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(Slot_mapping + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if KV_FP8:  # division rounded as torch's (a plain `/` is approximate on the GPU)
        k = k.to(tl.float32)
        if HAS_K_SHIFT:
            k -= tl.load(K_shift + offs_h[:, None] * HEAD_DIM + offs_d[None, :], mask=mask)
        k = tl.clamp(tl.div_rn(k, k_scale), -FP8_MAX, FP8_MAX)
        v = tl.clamp(tl.div_rn(v.to(tl.float32), v_scale), -FP8_MAX, FP8_MAX)
    k_ptrs = K_cache + block * stride_kcb + offset * stride_kcs
    v_ptrs = V_cache + block * stride_vcb + offset * stride_vcs
    tl.store(
        k_ptrs + offs_h[:, None] * stride_kch + offs_d[None, :],
        k.to(K_cache.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_ptrs + offs_h[:, None] * stride_vch + offs_d[None, :],
        v.to(V_cache.dtype.element_ty),
        mask=mask,
    )


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
    """Write `k`, `v` `[T, num_kv_heads, head_dim]` into the caches (mutated in place).

    `slot_mapping` `[T]` int: `block_id * block_size + offset`; negative entries are skipped.
    An fp8 cache stores `quantize_kv(k, FP8_DTYPE, k_scale, k_shift)` (v likewise, unshifted);
    `k_shift` is contiguous fp32 `[num_kv_heads, head_dim]` or None.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    for t in (k, v, k_cache, v_cache):
        assert t.stride(-1) == 1, "the head dimension must be contiguous"
    if k_shift is not None:
        assert k_shift.dtype == torch.float32 and k_shift.shape == k.shape[1:]
        assert k_shift.is_contiguous()
    _write_kv_cache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k if k_shift is None else k_shift,  # unread without a shift
        k_scale,
        v_scale,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        PAGE_SIZE=k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        KV_FP8=k_cache.dtype == FP8_DTYPE,
        HAS_K_SHIFT=k_shift is not None,
        FP8_MAX=FP8_MAX,
    )


def write_kv_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    k_shift: torch.Tensor | None = None,
) -> None:
    """PyTorch reference of `write_kv_cache`."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = quantize_kv(
        k[valid], k_cache.dtype, k_scale, k_shift
    )
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = quantize_kv(v[valid], v_cache.dtype, v_scale)
