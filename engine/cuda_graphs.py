"""CUDA graphs for decode steps: captured once per batch-size bucket, replayed every step.

A decode step launches a few hundred small kernels; replaying them as one graph removes the
per-launch CPU cost that otherwise bounds decode throughput. Graphs read fixed addresses, so
each step's inputs are copied into persistent buffers; a batch is padded up to its bucket
with rows that write no KV (slot -1) and attend to nothing (seq_len 0). Prefill stays eager.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.attention import AttentionBackend, CommonAttentionMetadata, set_forward_context

logger = logging.getLogger("kvrail.cuda_graphs")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's buckets: 1, 2, 4, then every multiple of 8, up to `max_num_seqs`."""
    sizes = [1, 2, 4, *range(8, max_num_seqs + 8, 8)]
    return sorted({min(s, max_num_seqs) for s in sizes})


class DecodeCudaGraphs:
    """Decode-step graphs of `model` for every bucket size; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: AttentionBackend,
        max_num_seqs: int,
        max_num_blocks_per_req: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.block_size = block_size
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(
            (n, max_num_blocks_per_req), dtype=torch.int32, device=device
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _metadata(self, size: int) -> CommonAttentionMetadata:
        qsl_cpu = torch.arange(size + 1, dtype=torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            query_start_loc_cpu=qsl_cpu,
            seq_lens=self.seq_lens[:size],
            seq_lens_cpu=torch.ones(size, dtype=torch.int32),  # unread by the triton backend
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            num_reqs=size,
            num_actual_tokens=size,
            max_query_len=1,
            max_seq_len=self.block_table.shape[1] * self.block_size,
            block_size=self.block_size,
        )

    def _forward(self, size: int) -> torch.Tensor:
        with set_forward_context(self.attn_backend.build(self._metadata(size))):
            return self.model(self.input_ids[:size], self.positions[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller ones reuse its memory pool.

        Mutates the KV caches only through padding rows (slot -1): nothing is written.
        """
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: Triton compiles and autotunes outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode CUDA graphs (batch %d..%d) in %.1f s",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - start,
        )

    def can_run(self, common: CommonAttentionMetadata) -> bool:
        return common.max_query_len == 1 and common.num_reqs <= self.sizes[-1]

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, common: CommonAttentionMetadata
    ) -> torch.Tensor:
        """Replay the smallest bucket that fits this all-decode step; `[num_reqs, hidden]`.

        Inputs are device tensors of the step; copies into the buffers are device-side.
        """
        n = common.num_reqs
        size = next(s for s in self.sizes if s >= n)
        width = common.block_table.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(common.slot_mapping[:n], non_blocking=True)
        self.seq_lens[:n].copy_(common.seq_lens, non_blocking=True)
        # Entries past `width` are stale but never read: each row reads cdiv(seq_len, bs).
        self.block_table[:n, :width].copy_(common.block_table, non_blocking=True)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].zero_()
        self.graphs[size].replay()
        return self.outputs[size][:n]
