"""The `triton` attention backend: paged attention with the kernels in `engine/kernels/`.

Per layer and step: one KV-cache write for all new tokens, then the decode kernel
(split-KV) for requests with one query token and the prefill kernel for the others
(fresh prompts, chunked prefill over cached context, prefix-cache hits). For an all-decode
batch `build` only wraps the common tensors, so a CUDA graph captured on persistent input
buffers replays with whatever those buffers hold.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend, CommonAttentionMetadata
from engine.kernels.decode_attention import decode_attention
from engine.kernels.kv_cache_write import write_kv_cache
from engine.kernels.prefill_attention import prefill_attention

# Decode splits are sized so the split kernel launches about this many programs per SM.
_PROGRAMS_PER_SM = 4
_MAX_KV_SPLITS = 16


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64; negative = padding, not written
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    num_decodes: int
    decode_req_indices: torch.Tensor | None  # None: requests 0..num_decodes-1
    num_prefills: int
    prefill_req_indices: torch.Tensor | None
    max_prefill_query_len: int


class TritonAttentionBackend(AttentionBackend):
    """`num_kv_splits` fixes the decode split count (tests); None picks it from the batch."""

    name = "triton"

    def __init__(self, num_kv_splits: int | None = None) -> None:
        self.num_kv_splits = num_kv_splits

    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        qsl = common.query_start_loc_cpu[: common.num_reqs + 1]
        query_lens = qsl[1:] - qsl[:-1]
        is_decode = query_lens == 1
        num_decodes = int(is_decode.sum())
        metadata = TritonAttentionMetadata(
            slot_mapping=common.slot_mapping[: common.num_actual_tokens],
            num_actual_tokens=common.num_actual_tokens,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            num_decodes=num_decodes,
            decode_req_indices=None,
            num_prefills=int((query_lens > 1).sum()),
            prefill_req_indices=None,
            max_prefill_query_len=int(query_lens.max()) if common.num_reqs else 0,
        )
        if num_decodes == common.num_reqs:
            return metadata
        device = common.block_table.device
        metadata.decode_req_indices = _indices(is_decode, device)
        metadata.prefill_req_indices = _indices(query_lens > 1, device)
        return metadata

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        k_shift: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_tokens = metadata.num_actual_tokens
        # The whole batch is written first: a later request may read a block written now.
        write_kv_cache(
            k[:num_tokens],
            v[:num_tokens],
            k_cache,
            v_cache,
            metadata.slot_mapping,
            k_scale,
            v_scale,
            k_shift,
        )
        out = torch.empty_like(q)
        out[num_tokens:].zero_()
        common = (metadata.block_table, metadata.query_start_loc, metadata.seq_lens, scale, out)
        decode_attention(
            q,
            k_cache,
            v_cache,
            *common,
            num_decodes=metadata.num_decodes,
            req_indices=metadata.decode_req_indices,
            num_splits=self.num_kv_splits
            or _num_kv_splits(metadata.num_decodes, k_cache.shape[2], q.device),
            block_n=64 if q.is_cuda else 16,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        prefill_attention(
            q,
            k_cache,
            v_cache,
            *common,
            num_prefills=metadata.num_prefills,
            max_query_len=metadata.max_prefill_query_len,
            req_indices=metadata.prefill_req_indices,
            block_m=64 if q.is_cuda else 16,
            block_n=64 if q.is_cuda else 16,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        return out


def _indices(mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    index = mask.nonzero().squeeze(1).to(torch.int32)
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


def _num_kv_splits(num_decodes: int, num_kv_heads: int, device: torch.device) -> int:
    """Enough splits to fill the device, from the batch shape alone (CUDA-graph safe)."""
    if num_decodes == 0 or device.type != "cuda":
        return 1
    target = _PROGRAMS_PER_SM * _num_sms(device.index or 0)
    splits = 1
    while splits < _MAX_KV_SPLITS and num_decodes * num_kv_heads * splits < target:
        splits *= 2
    return splits


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
