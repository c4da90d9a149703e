"""The `cpu` attention backend: the torch backend with the KV write and decode attention in C.

Decode tokens are most of a serving step, and on the CPU their attention is bound by reading
the context: the torch backend gathers each context into a padded copy per layer before SDPA
reads it again. Here all decode requests of the step go to one call of the paged C kernel
(`engine.kernels.cpu_decode_attention`), which reads each block once, in place, with no
padding and no bucketing; prefill and chunked-prefill requests keep the torch path (SDPA is
efficient there: many queries share each gathered key). With an fp8 cache the kernel
decodes the e4m3 bytes itself; q and the output stay in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import CommonAttentionMetadata, quantize_kv
from engine.attention.torch_backend import (
    TorchAttentionBackend,
    TorchAttentionMetadata,
    attend_groups,
    prefill_groups,
    query_lens_of,
)
from engine.kernels import cpu_decode_attention, cpu_runtime
from engine.kernels.cpu_ops import write_kv_cache


@dataclass
class CpuAttentionMetadata(TorchAttentionMetadata):
    """The torch metadata (its groups hold only prefills) plus the step's decodes."""

    decode_req_indices: torch.Tensor  # [num_decodes] int32, requests with query_len == 1
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int32


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        cpu_runtime.library()  # build now: a missing compiler fails at startup

    def build(self, common: CommonAttentionMetadata) -> CpuAttentionMetadata:
        qsl, query_lens = query_lens_of(common)
        is_decode = query_lens == 1
        decode_index = is_decode.nonzero().squeeze(1)
        seq_lens = common.seq_lens_cpu[: common.num_reqs]
        return CpuAttentionMetadata(
            slot_mapping=common.slot_mapping[: common.num_actual_tokens].long(),
            num_actual_tokens=common.num_actual_tokens,
            groups=prefill_groups(common, qsl, query_lens),
            decode_req_indices=decode_index.int(),
            query_start_loc=common.query_start_loc_cpu[: common.num_reqs + 1].contiguous(),
            seq_lens=seq_lens.contiguous(),
            block_table=common.block_table[: common.num_reqs].contiguous(),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: CpuAttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        num_tokens = metadata.num_actual_tokens
        write_kv_cache(
            k[:num_tokens], v[:num_tokens], k_cache, v_cache, metadata.slot_mapping,
            k_scale, v_scale,
        )  # fmt: skip
        # Every real row is written, by a prefill group or by the decode kernel.
        out = torch.empty(q.shape, dtype=q.dtype)
        if num_tokens < q.shape[0]:
            out[num_tokens:].zero_()
        if metadata.groups:
            # Prefills attend to their own k/v as the cache stores them, as decodes do.
            k = quantize_kv(k[:num_tokens], k_cache.dtype, k_scale)
            v = quantize_kv(v[:num_tokens], v_cache.dtype, v_scale)
            attend_groups(q, k, v, k_cache, v_cache, metadata.groups, scale, out, k_scale, v_scale)
        if metadata.decode_req_indices.numel():
            cpu_decode_attention.paged_decode_attention(
                q,
                k_cache,
                v_cache,
                metadata.block_table,
                metadata.query_start_loc,
                metadata.seq_lens,
                metadata.decode_req_indices,
                scale,
                out,
                k_scale,
                v_scale,
            )
        return out
