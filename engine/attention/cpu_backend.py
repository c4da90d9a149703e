"""The `cpu` attention backend: the torch backend with decode attention in a C kernel.

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

from engine.attention import FP8_DTYPE, CommonAttentionMetadata
from engine.attention.torch_backend import (
    TorchAttentionBackend,
    TorchAttentionMetadata,
    attend_groups,
    prefill_groups,
    query_lens_of,
    write_kv,
)
from engine.kernels import cpu_decode_attention


@dataclass
class CpuAttentionMetadata(TorchAttentionMetadata):
    """The torch metadata (its groups hold only prefills) plus the step's decodes."""

    decode_req_indices: torch.Tensor  # [num_decodes] int32, requests with query_len == 1
    max_decode_seq_len: int  # longest context among them
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int32


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        cpu_decode_attention.load()  # build now: a missing compiler fails at startup

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
            max_decode_seq_len=int(seq_lens[decode_index].max()) if decode_index.numel() else 0,
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
        k, v = write_kv(k, v, k_cache, v_cache, metadata, k_scale, v_scale)
        dtype = q.dtype if k_cache.dtype == FP8_DTYPE else k_cache.dtype
        out = torch.zeros(q.shape, dtype=dtype)
        attend_groups(q, k, v, k_cache, v_cache, metadata.groups, scale, out, k_scale, v_scale)
        if metadata.decode_req_indices.numel():
            # Named for torch.profiler, which sees no op inside a ctypes call.
            with torch.profiler.record_function("kvrail::cpu_decode_attention"):
                cpu_decode_attention.paged_decode_attention(
                    q.to(dtype).contiguous(),
                    k_cache,
                    v_cache,
                    metadata.block_table,
                    metadata.query_start_loc,
                    metadata.seq_lens,
                    metadata.decode_req_indices,
                    metadata.max_decode_seq_len,
                    scale,
                    out,
                    k_scale,
                    v_scale,
                )
        return out.to(q.dtype)
