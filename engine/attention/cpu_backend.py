"""The `cpu` attention backend: the KV write, decode attention and prompt attention in C.

On the CPU, attention is bound by reading the context. The torch backend gathers each
context into a padded copy per layer and runs SDPA over it; here one call of each C kernel
(`engine/kernels/cpu_attention.py`) serves all of the step's decode requests, and one all of
its prompts (fresh or chunked over cached context), each reading the paged cache in place,
with no padding and no bucketing. With an fp8 cache the kernels decode the e4m3 bytes
themselves, and a bf16 cache under a float32 model they widen; q and the output stay in the
model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend, CommonAttentionMetadata
from engine.kernels import cpu_attention, cpu_runtime
from engine.kernels.cpu_ops import write_kv_cache


@dataclass
class CpuAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    num_actual_tokens: int
    # [num_decodes] int32, requests with query_len <= MAX_DECODE_QUERY_LEN (decodes, verify steps)
    decode_req_indices: torch.Tensor
    prefill_req_indices: torch.Tensor  # [num_prefills] int32, the others
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int32


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        cpu_runtime.library()  # build now: a missing compiler fails at startup

    def build(self, common: CommonAttentionMetadata) -> CpuAttentionMetadata:
        qsl = common.query_start_loc_cpu[: common.num_reqs + 1]
        query_lens = qsl[1:] - qsl[:-1]
        is_decode = query_lens <= cpu_attention.MAX_DECODE_QUERY_LEN
        return CpuAttentionMetadata(
            slot_mapping=common.slot_mapping[: common.num_actual_tokens].long(),
            num_actual_tokens=common.num_actual_tokens,
            decode_req_indices=is_decode.nonzero().squeeze(1).int(),
            prefill_req_indices=(~is_decode).nonzero().squeeze(1).int(),
            query_start_loc=qsl.contiguous(),
            seq_lens=common.seq_lens_cpu[: common.num_reqs].contiguous(),
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
        k_shift: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_tokens = metadata.num_actual_tokens
        write_kv_cache(
            k[:num_tokens], v[:num_tokens], k_cache, v_cache, metadata.slot_mapping,
            k_scale, v_scale, k_shift,
        )  # fmt: skip
        # Every real row is written by one of the kernels; padding rows are zeros.
        out = cpu_runtime.empty(q.shape, q.dtype)
        if num_tokens < q.shape[0]:
            out[num_tokens:].zero_()
        args = (k_cache, v_cache, metadata.block_table, metadata.query_start_loc,
                metadata.seq_lens)  # fmt: skip
        for kernel, req_indices in (
            (cpu_attention.paged_decode_attention, metadata.decode_req_indices),
            (cpu_attention.paged_prefill_attention, metadata.prefill_req_indices),
        ):
            if req_indices.numel():
                kernel(q, *args, req_indices, scale, out, k_scale, v_scale)
        return out
