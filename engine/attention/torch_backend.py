"""The `torch` attention backend: paged attention with plain torch ops, on any device.

Requests are split into groups, each served by one `scaled_dot_product_attention` call over a
padded rectangle of queries, so `forward` has no per-sequence Python loop:
- decodes (query_len == 1), bucketed by context length so short contexts are not padded to
  the longest one, against keys gathered through the block table under a mask;
- fresh prefills (nothing computed before this step, the common prefill), bucketed by prompt
  length. Their keys are the step's own k/v at the same padded rows, so nothing is gathered
  from the cache and no mask is built: with right padding, `is_causal` is exact for every
  real row, and the kernel skips the upper triangle instead of computing and masking it;
- prefills over earlier context (chunked prefill, prefix-cache hits), gathered and masked
  like decodes.

With an fp8 cache (or a bf16 one under a float32 model), keys and values are dequantized
(widened) after the gather, and a fresh prefill
attends to its own k/v as stored (quantized, then dequantized): every backend attends to
the same values whether a key came from the cache or from the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import (
    FP8_DTYPE,
    AttentionBackend,
    CommonAttentionMetadata,
    dequantize_kv,
    quantize_kv,
)


@dataclass
class AttentionGroup:
    """Requests that share one padded SDPA call."""

    query_index: torch.Tensor  # [S, Q] int64, flat row of each padded query (pads repeat a row)
    valid_index: torch.Tensor  # [N] int64, which of the S * Q padded rows are real tokens
    token_index: torch.Tensor  # [N] int64, the flat row each real token writes its output to
    # Fresh prefills: None for both; keys are the step's k/v at `query_index`, causal.
    block_table: torch.Tensor | None  # [S, B] block ids covering each request's context
    attn_mask: torch.Tensor | None  # [S, 1, Q, B * block_size] bool, True = may attend


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    num_actual_tokens: int
    groups: list[AttentionGroup]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        qsl, query_lens = query_lens_of(common)
        is_decode = query_lens == 1
        groups = [
            build_group(common, req_index, qsl, query_lens)
            for req_index in _decode_buckets(common, is_decode.nonzero().squeeze(1))
        ]
        groups += prefill_groups(common, qsl, query_lens)
        return TorchAttentionMetadata(
            slot_mapping=common.slot_mapping[: common.num_actual_tokens].long(),
            num_actual_tokens=common.num_actual_tokens,
            groups=groups,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        k_shift: torch.Tensor | None = None,
    ) -> torch.Tensor:
        k, v = write_kv(k, v, k_cache, v_cache, metadata, k_scale, v_scale, k_shift)
        out = torch.zeros_like(q)
        attend_groups(q, k, v, k_cache, v_cache, metadata.groups, scale, out, k_scale, v_scale)
        return out


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: TorchAttentionMetadata,
    k_scale: float,
    v_scale: float,
    k_shift: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the step's new k/v at their slots; returns them as stored (the caches' dtype).
    The whole batch is written before anyone reads: a later request may read a block
    written in this step."""
    num_tokens = metadata.num_actual_tokens
    stored = []
    for x, cache, x_scale, x_shift in ((k, k_cache, k_scale, k_shift), (v, v_cache, v_scale, None)):
        x = quantize_kv(x[:num_tokens], cache.dtype, x_scale, x_shift)
        flat = cache.view(-1, *cache.shape[2:])
        if cache.dtype == FP8_DTYPE:  # torch has no index_copy_ for fp8: copy the bytes
            flat.view(torch.uint8).index_copy_(0, metadata.slot_mapping, x.view(torch.uint8))
        else:
            flat.index_copy_(0, metadata.slot_mapping, x)
        stored.append(x)
    return stored[0], stored[1]


def attend_groups(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    groups: list[AttentionGroup],
    scale: float,
    out: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> None:
    """One padded SDPA call per group, over the step's own k/v (fresh prefills) or over keys
    gathered through its block table; writes the real tokens' rows of `out`.

    `k`, `v` are the step's tokens as stored (`write_kv`'s result), dequantized like the
    cache's."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    for group in groups:
        num_seqs, max_query_len = group.query_index.shape
        rows = group.query_index.flatten()
        query = q.index_select(0, rows).view(num_seqs, max_query_len, num_heads, head_dim)
        if group.block_table is None:
            key = k.index_select(0, rows).view(num_seqs, max_query_len, num_kv_heads, head_dim)
            value = v.index_select(0, rows).view_as(key)
        else:
            context_len = group.block_table.shape[1] * block_size
            flat_blocks = group.block_table.flatten()
            key = k_cache.index_select(0, flat_blocks).view(
                num_seqs, context_len, num_kv_heads, head_dim
            )
            value = v_cache.index_select(0, flat_blocks).view_as(key)
        attn = F.scaled_dot_product_attention(
            query.transpose(1, 2),
            dequantize_kv(key, q.dtype, k_scale).transpose(1, 2),
            dequantize_kv(value, q.dtype, v_scale).transpose(1, 2),
            attn_mask=group.attn_mask,
            is_causal=group.block_table is None,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        attn = attn.transpose(1, 2).reshape(num_seqs * max_query_len, num_heads, head_dim)
        out.index_copy_(0, group.token_index, attn.index_select(0, group.valid_index))


def query_lens_of(common: CommonAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(query_start_loc [R + 1] int64, query_lens [R] int64) on the CPU."""
    qsl = common.query_start_loc_cpu[: common.num_reqs + 1].long()
    return qsl, qsl[1:] - qsl[:-1]


def _decode_buckets(
    common: CommonAttentionMetadata, decode_index: torch.Tensor
) -> list[torch.Tensor]:
    """Decode request indices bucketed by power-of-two block counts: at most 2x padding
    within a bucket, a handful of buckets per step."""
    if not decode_index.numel():
        return []
    num_blocks = (common.seq_lens_cpu[decode_index].long() + common.block_size - 1) // (
        common.block_size
    )
    bucket = torch.ceil(torch.log2(num_blocks.double())).long()
    return [decode_index[bucket == b] for b in torch.unique(bucket).tolist()]


def prefill_groups(
    common: CommonAttentionMetadata, query_start_loc: torch.Tensor, query_lens: torch.Tensor
) -> list[AttentionGroup]:
    """The step's prefills (query_len > 1): fresh ones bucketed by half-octaves of their
    length (each bucket pads to its own longest, under 2x the area of any member), then
    those over earlier context together, masked."""
    is_prefill = query_lens > 1
    is_fresh = common.seq_lens_cpu[: common.num_reqs].long() == query_lens
    fresh_index = (is_prefill & is_fresh).nonzero().squeeze(1)
    groups = []
    if fresh_index.numel():
        bucket = torch.ceil(2 * torch.log2(query_lens[fresh_index].double())).long()
        for b in torch.unique(bucket).tolist():
            groups.append(
                build_group(common, fresh_index[bucket == b], query_start_loc, query_lens, True)
            )
    context_index = (is_prefill & ~is_fresh).nonzero().squeeze(1)
    if context_index.numel():
        groups.append(build_group(common, context_index, query_start_loc, query_lens))
    return groups


def build_group(
    common: CommonAttentionMetadata,
    req_index: torch.Tensor,
    query_start_loc: torch.Tensor,
    query_lens: torch.Tensor,
    is_fresh_prefill: bool = False,
) -> AttentionGroup:
    """One padded group of requests `req_index`; a fresh-prefill group needs no block table
    or mask (its keys are its own queries' k/v, attended with `is_causal`)."""
    device = common.block_table.device
    query_lens = query_lens[req_index]
    max_query_len = int(query_lens.max())
    offsets = torch.arange(max_query_len)
    valid = offsets[None, :] < query_lens[:, None]
    # Pads repeat the request's last token; their outputs are dropped, never scattered.
    query_index = query_start_loc[req_index][:, None] + torch.minimum(
        offsets[None, :], query_lens[:, None] - 1
    )
    valid_index = valid.flatten().nonzero().squeeze(1)
    block_table = attn_mask = None
    if not is_fresh_prefill:
        seq_lens = common.seq_lens_cpu[req_index].long()
        num_computed_tokens = seq_lens - query_lens
        num_blocks = -(-int(seq_lens.max()) // common.block_size)
        key_pos = torch.arange(num_blocks * common.block_size)
        # Pad rows (offset >= query_len) see the whole context, so no row is fully masked.
        mask = (key_pos[None, None, :] < seq_lens[:, None, None]) & (
            key_pos[None, None, :] <= (num_computed_tokens[:, None] + offsets[None, :])[:, :, None]
        )
        attn_mask = mask[:, None].to(device)
        # Table entries past a request's last block are never attended to, only gathered:
        # clamp so padding values such as -1 still index a real block.
        block_table = common.block_table.index_select(0, req_index.to(device))[:, :num_blocks]
        block_table = block_table.long().clamp_(min=0)
    return AttentionGroup(
        query_index=query_index.to(device),
        valid_index=valid_index.to(device),
        token_index=query_index.flatten()[valid_index].to(device),
        block_table=block_table,
        attn_mask=attn_mask,
    )
