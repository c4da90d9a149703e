"""Paged attention for decode: one query token per sequence over its whole cached context.

Split-KV (flash-decoding): each `(sequence, kv_head, split)` program attends the group's query
heads to one contiguous slice of the context and writes a partial output with its
log-sum-exp; a second kernel merges the splits. The number of splits depends only on the
batch shape, never on the context lengths, so the launch is the same every step of a
CUDA-graph bucket; each program derives its slice from the sequence length it reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention import dequantize_kv

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_attention_split_kernel(
    Q,
    K_cache,
    V_cache,
    Block_table,
    Query_start_loc,
    Seq_lens,
    Req_indices,
    Out_partial,
    Lse_partial,
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_os,
    stride_oh,
    stride_ok,
    stride_ls,
    stride_lh,
    HAS_REQ_INDICES: tl.constexpr,
    QUERY_GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_KV: tl.constexpr,
):
    pid_s = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = pid_s
    if HAS_REQ_INDICES:
        req = tl.load(Req_indices + pid_s)
    token = tl.load(Query_start_loc + req)
    seq_len = tl.load(Seq_lens + req)
    # Slices are whole BLOCK_N tiles, so only the sequence's last tile needs a mask.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < QUERY_GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * QUERY_GROUP + offs_g
    q = tl.load(
        Q + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )
    # The dots run in q's dtype; a narrower cache (fp8, or bf16 under an fp32 q) is upcast to
    # it (exact: e4m3 values are bf16 values), fp8's scales folded into qk_scale and the final
    # normalization.

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        pos = start_n + offs_n
        mask_n = pos < end
        block_ids = tl.load(Block_table + req * stride_bt + pos // PAGE_SIZE, mask=mask_n, other=0)
        block_ids = block_ids.to(tl.int64)
        page_offs = pos % PAGE_SIZE
        mask_kv = mask_n[:, None] & mask_d[None, :]
        k_ptrs = K_cache + block_ids * stride_kb + page_offs * stride_ks + kv_head * stride_kh
        k = tl.load(k_ptrs[:, None] + offs_d[None, :], mask=mask_kv, other=0.0)
        if UPCAST_KV:
            k = k.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = V_cache + block_ids * stride_vb + page_offs * stride_vs + kv_head * stride_vh
        v = tl.load(v_ptrs[:, None] + offs_d[None, :], mask=mask_kv, other=0.0)
        if UPCAST_KV:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty slice (short context, or a padded row with seq_len 0) leaves lse = -inf and
    # contributes nothing to the merge.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None] * v_scale
    lse = m_i + tl.log2(l_safe)
    out_ptrs = Out_partial + pid_s * stride_os + heads[:, None] * stride_oh + split * stride_ok
    tl.store(out_ptrs + offs_d[None, :], out, mask=mask_g[:, None] & mask_d[None, :])
    tl.store(Lse_partial + pid_s * stride_ls + heads * stride_lh + split, lse, mask=mask_g)


@triton.jit
def _decode_attention_reduce_kernel(
    Out_partial,
    Lse_partial,
    Out,
    Query_start_loc,
    Req_indices,
    stride_os,
    stride_oh,
    stride_ok,
    stride_ls,
    stride_lh,
    stride_t,
    stride_h,
    HAS_REQ_INDICES: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_s = tl.program_id(0)
    head = tl.program_id(1)
    req = pid_s
    if HAS_REQ_INDICES:
        req = tl.load(Req_indices + pid_s)
    token = tl.load(Query_start_loc + req)
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    mask_k = offs_k < NUM_SPLITS
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(
        Lse_partial + pid_s * stride_ls + head * stride_lh + offs_k,
        mask=mask_k,
        other=float("-inf"),
    )
    lse_max = tl.max(lse, 0)
    # All splits empty (a padded row): weights 0, output 0 instead of NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    out = tl.load(
        Out_partial
        + pid_s * stride_os
        + head * stride_oh
        + offs_k[:, None] * stride_ok
        + offs_d[None, :],
        mask=mask_k[:, None] & mask_d[None, :],
        other=0.0,
    )
    total = tl.sum(weights, 0)
    out = tl.sum(out * weights[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        Out + token * stride_t + head * stride_h + offs_d, out.to(Out.dtype.element_ty), mask=mask_d
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_decodes: int,
    req_indices: torch.Tensor | None = None,
    num_splits: int = 1,
    block_n: int = 64,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Attend each decode request's single query token to its paged context; fills `out`.

    q, out `[T, num_heads, head_dim]`; k_cache, v_cache `[num_blocks, block_size, num_kv_heads,
    head_dim]`; block_table `[R, max_blocks]`; query_start_loc `[R + 1]`, seq_lens `[R]`
    (context length including the query token). Requests `req_indices[:num_decodes]` (or the
    first `num_decodes` requests when None) are processed; each writes row
    `query_start_loc[req]` of `out`. A request with seq_len 0 writes zeros. An fp8 cache
    (q and out in the model dtype) is read as stored * `k_scale` (`v_scale` for V).
    """
    if num_decodes == 0:
        return
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    partial = torch.empty(
        (num_decodes, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
    )
    lse = torch.empty((num_decodes, num_heads, num_splits), dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    has_req_indices = req_indices is not None
    _decode_attention_split_kernel[(num_decodes, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_table,
        query_start_loc,
        seq_lens,
        req_indices if has_req_indices else seq_lens,
        partial,
        lse,
        scale * k_scale * _LOG2E,
        v_scale,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_table.stride(0),
        *partial.stride()[:3],
        *lse.stride()[:2],
        HAS_REQ_INDICES=has_req_indices,
        QUERY_GROUP=num_heads // num_kv_heads,
        PAGE_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        # tl.dot needs at least 16 rows: the group's heads are padded up to that.
        BLOCK_G=max(16, triton.next_power_of_2(num_heads // num_kv_heads)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_KV=k_cache.dtype != q.dtype,
    )
    _decode_attention_reduce_kernel[(num_decodes, num_heads)](
        partial,
        lse,
        out,
        query_start_loc,
        req_indices if has_req_indices else seq_lens,
        *partial.stride()[:3],
        *lse.stride()[:2],
        out.stride(0),
        out.stride(1),
        HAS_REQ_INDICES=has_req_indices,
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        BLOCK_K=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d,
    )


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """PyTorch reference: q `[S, num_heads, head_dim]`, one query per sequence, in fp32 over
    the dequantized cache."""
    num_heads = q.shape[1]
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for s, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        blocks = block_table[s, : -(-seq_len // block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        k = dequantize_kv(k, torch.float32, k_scale)
        v = dequantize_kv(v, torch.float32, v_scale)
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,khd->hk", q[s].float(), k) * scale
        out[s] = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
    return out
