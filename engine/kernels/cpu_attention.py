"""Paged attention on the CPU: C team kernels for decodes and for prompts, and launchers.

Both read K and V straight from the paged cache through the block table, with the Triton
kernels' contracts, whose PyTorch references they are tested against (`decode_attention_ref`,
`prefill_attention_ref`). The torch path gathers every context into a padded copy per layer
and runs SDPA over it: for decodes about three passes over the context (measured: 11.4 ms
per layer for 48 sequences of 432 tokens on 2 AVX2 cores, against 3-4 ms in
`cpu_decode_attention.c`); for prompts, see `cpu_prefill_attention.c`.
"""

from __future__ import annotations

import ctypes

import torch

from engine.config import MAX_NUM_SPECULATIVE_TOKENS
from engine.kernels.cpu_runtime import dtype_code, launch

# q / out dtypes; the cache holds the same dtype, bf16 under an fp32 q, or fp8 e4m3 (with scales)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)

# Requests of up to this many query tokens take the decode kernel: every speculative verify
# step (1 + drafts), so that it scores each position bit for bit as a plain decode step would
# (greedy speculation then changes no token, in bf16 too). The decode kernel reads the context
# once per query (from L2 after the first); the prompt kernel, once per 16 queries.
MAX_DECODE_QUERY_LEN = 1 + MAX_NUM_SPECULATIVE_TOKENS


def supports_head_dim(head_dim: int) -> bool:
    """The prompt kernel works on whole vectors of 16 floats."""
    return head_dim % 16 == 0 and head_dim <= 256


_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class AttentionArgs(ctypes.Structure):  # struct kvrail_attention_args (cpu_common.h)
    _fields_ = [
        *[
            (n, _P)
            for n in (
                "q",
                "k_cache",
                "v_cache",
                "block_table",
                "query_start_loc",
                "seq_lens",
                "req_indices",
                "out",
            )
        ],
        *[
            (n, _I64)
            for n in (
                "q_dtype",
                "cache_dtype",
                "num_requests",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "block_size",
                "stride_q",
                "stride_bt",
            )
        ],
        *[(n, _F) for n in ("scale", "k_scale", "v_scale")],
    ]


def attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    req_indices: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> AttentionArgs:
    """Check what both kernels read and build their arguments."""
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    for t in (q[0:1], out, k_cache, v_cache, block_table, query_start_loc, seq_lens, req_indices):
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("the CPU attention kernels take contiguous CPU tensors")
    if q.dtype not in SUPPORTED_DTYPES or out.dtype != q.dtype:
        raise ValueError(f"q and out must share one dtype of {SUPPORTED_DTYPES}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (
        q.dtype,
        torch.bfloat16,
        torch.float8_e4m3fn,
    ):
        raise ValueError("the caches hold q's dtype, bfloat16 or float8_e4m3fn")
    for t in (block_table, query_start_loc, seq_lens, req_indices):
        if t.dtype != torch.int32:
            raise ValueError("block_table, query_start_loc, seq_lens and req_indices are int32")
    return AttentionArgs(
        q=q.data_ptr(),
        k_cache=k_cache.data_ptr(),
        v_cache=v_cache.data_ptr(),
        block_table=block_table.data_ptr(),
        query_start_loc=query_start_loc.data_ptr(),
        seq_lens=seq_lens.data_ptr(),
        req_indices=req_indices.data_ptr(),
        out=out.data_ptr(),
        q_dtype=dtype_code(q.dtype),
        cache_dtype=dtype_code(k_cache.dtype),
        num_requests=req_indices.numel(),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        stride_q=q.stride(0),
        stride_bt=block_table.stride(0),
        scale=scale,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    req_indices: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Attend each query token of requests `req_indices` (rows `query_start_loc[r]` ..
    `query_start_loc[r + 1]`: one for a decode, a few for a speculative verify step) to its
    paged context: query i of q_len sits at position `seq_lens[r] - q_len + i` and sees the
    context up to it, computed exactly as that token's own decode step would compute it.

    With one query per request, the Triton `decode_attention`'s contract: q, out
    `[T, num_heads, head_dim]` (float32 or bfloat16; out contiguous; q's heads and head_dim
    contiguous, its token stride free); k_cache, v_cache
    `[num_blocks, block_size, num_kv_heads, head_dim]` in q's dtype or fp8 e4m3 (which holds
    x / k_scale, x / v_scale); block_table `[R, max_blocks]`, query_start_loc `[R + 1]`,
    seq_lens `[R]` and req_indices `[n]`, all int32. Writes the selected requests' rows of
    `out`, nothing else. Meant for requests of at most MAX_DECODE_QUERY_LEN queries: each
    query reads its context on its own.
    """
    args = attention_args(q, k_cache, v_cache, block_table, query_start_loc, seq_lens,
                          req_indices, scale, out, k_scale, v_scale)  # fmt: skip
    launch("kvrail_decode_attention", args, q, k_cache, v_cache, block_table, query_start_loc,
           seq_lens, req_indices, out)  # fmt: skip


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    req_indices: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Causal attention of requests `req_indices`' queries (rows `query_start_loc[r]` ..
    `query_start_loc[r + 1]`) to their first `seq_lens[r]` cached tokens, this step's
    included: the Triton `prefill_attention`'s contract, tensors as `paged_decode_attention`
    takes them (head_dim a multiple of 16, at most 256). Writes those requests' rows of `out`,
    nothing else."""
    if not supports_head_dim(q.shape[2]):
        raise ValueError(f"the prompt kernel takes head_dim 16, 32, ..., 256, got {q.shape[2]}")
    args = attention_args(q, k_cache, v_cache, block_table, query_start_loc, seq_lens,
                          req_indices, scale, out, k_scale, v_scale)  # fmt: skip
    launch("kvrail_prefill_attention", args, q, k_cache, v_cache, block_table,
           query_start_loc, seq_lens, req_indices, out)  # fmt: skip
