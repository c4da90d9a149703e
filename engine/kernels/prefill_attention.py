"""Paged attention for prefill: variable-length queries per sequence over the paged cache.

The step's new K/V are written to the cache first, so every key, cached or new, is read
through the block table: chunked prefill and prefix-cache hits need no copy. Query `i` of a
request with `c` cached tokens sits at position `c + i` and attends to keys `0..c + i`
(causal within the new tokens, full over the cached context). GQA: query head `h` reads KV
head `h // (num_heads // num_kv_heads)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention import dequantize_kv

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_attention_kernel(
    Q,
    K_cache,
    V_cache,
    Out,
    Block_table,
    Query_start_loc,
    Seq_lens,
    Req_indices,
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    HAS_REQ_INDICES: tl.constexpr,
    QUERY_GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_KV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    head = tl.program_id(2)
    req = pid_s
    if HAS_REQ_INDICES:
        req = tl.load(Req_indices + pid_s)
    q_start = tl.load(Query_start_loc + req)
    q_len = tl.load(Query_start_loc + req + 1) - q_start
    # The grid covers the longest query of the batch; shorter ones leave programs idle.
    if pid_m * BLOCK_M >= q_len:
        return
    seq_len = tl.load(Seq_lens + req)
    context_len = seq_len - q_len
    kv_head = head // QUERY_GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + (q_start + offs_m[:, None]) * stride_qt + head * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    # The dots run in q's dtype; a narrower cache (fp8, or bf16 under an fp32 q) is upcast to
    # it (exact: e4m3 values are bf16 values), fp8's scales folded into qk_scale and the final
    # normalization.
    q_pos = context_len + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys past the tile's last query position are masked for every row: stop there.
    kv_end = tl.minimum(seq_len, context_len + (pid_m + 1) * BLOCK_M)
    for start_n in range(0, kv_end, BLOCK_N):
        pos = start_n + offs_n
        mask_n = pos < kv_end
        block_ids = tl.load(Block_table + req * stride_bt + pos // PAGE_SIZE, mask=mask_n, other=0)
        block_ids = block_ids.to(tl.int64)
        page_offs = pos % PAGE_SIZE
        mask_kv = mask_n[:, None] & mask_d[None, :]
        k_ptrs = K_cache + block_ids * stride_kb + page_offs * stride_ks + kv_head * stride_kh
        k = tl.load(k_ptrs[:, None] + offs_d[None, :], mask=mask_kv, other=0.0)
        if UPCAST_KV:
            k = k.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        causal = mask_n[None, :] & (pos[None, :] <= q_pos[:, None])
        qk = tl.where(causal, qk, float("-inf"))
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

    out = acc / l_i[:, None] * v_scale
    tl.store(
        Out + (q_start + offs_m[:, None]) * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_prefills: int,
    max_query_len: int,
    req_indices: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Causal paged attention for the requests `req_indices[:num_prefills]`; fills `out`.

    q, out `[T, num_heads, head_dim]` (request r's queries are rows
    `query_start_loc[r]:query_start_loc[r + 1]`); seq_lens `[R]` counts cached plus new
    tokens, all already in the cache. `max_query_len` bounds the query tiles launched. An
    fp8 cache (q and out in the model dtype) is read as stored * `k_scale` (`v_scale`).
    """
    if num_prefills == 0 or max_query_len == 0:
        return
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    has_req_indices = req_indices is not None
    grid = (triton.cdiv(max_query_len, block_m), num_prefills, num_heads)
    _prefill_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_table,
        query_start_loc,
        seq_lens,
        req_indices if has_req_indices else seq_lens,
        scale * k_scale * _LOG2E,
        v_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_table.stride(0),
        HAS_REQ_INDICES=has_req_indices,
        QUERY_GROUP=num_heads // num_kv_heads,
        PAGE_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_KV=k_cache.dtype != q.dtype,
    )


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """PyTorch reference of `prefill_attention` over every request, in fp32 over the
    dequantized cache."""
    num_heads = q.shape[1]
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        q_len = qsl[r + 1] - qsl[r]
        if q_len == 0:
            continue
        blocks = block_table[r, : -(-seq_len // block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        k = dequantize_kv(k, torch.float32, k_scale)
        v = dequantize_kv(v, torch.float32, v_scale)
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[qsl[r] : qsl[r + 1]].float(), k) * scale
        q_pos = seq_len - q_len + torch.arange(q_len, device=q.device)
        causal = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        out[qsl[r] : qsl[r + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out
