"""Decode-step graphs: captured once per batch-size bucket, replayed every all-decode step.

A decode step runs a few hundred small kernels. On CUDA, launching them one by one is a CPU
cost that bounds decode throughput; on the CPU, each is a Python call and an OpenMP fork and
join (measured on a 2-vCPU AVX2 EPYC in fp32, one request of SmolLM2-135M,
`benchmarks.profile_step --num-requests 1 --attention-backends cpu` with and without
`--enforce-eager`: 52.9 ms per 1-token step eagerly, 18.8 of them in Python, against 24.8 ms
with the graph, 1.2 in Python). Replaying a graph, a CUDA graph
or a `engine.kernels.cpu_runtime.CpuGraph`, runs them all in one call. Graphs read fixed
addresses, so each step's inputs are copied into persistent buffers; a batch is padded up to
its bucket with rows that write no KV (slot -1) and attend to nothing (seq_len 0). Steps with
a prefill run eagerly.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod

import torch

from engine.attention import AttentionBackend, CommonAttentionMetadata, set_forward_context

logger = logging.getLogger("kvrail.decode_graphs")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's buckets: 1, 2, 4, then every multiple of 8, up to `max_num_seqs`."""
    sizes = [1, 2, 4, *range(8, max_num_seqs + 8, 8)]
    return sorted({min(s, max_num_seqs) for s in sizes})


class DecodeGraphs(ABC):
    """Decode-step graphs of `model` for every bucket size; see the module docstring."""

    kind: str

    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: AttentionBackend,
        sizes: list[int],
        max_num_blocks_per_req: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.block_size = block_size
        self.sizes = sizes
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(
            (n, max_num_blocks_per_req), dtype=torch.int32, device=device
        )
        self.outputs: dict[int, torch.Tensor] = {}

    def _metadata(self, size: int) -> CommonAttentionMetadata:
        """A bucket's metadata over the persistent buffers (on the CPU, the `*_cpu` fields are
        the same buffers, so the step's values reach the backend through them)."""
        on_cpu = self.seq_lens.device.type == "cpu"
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            query_start_loc_cpu=(
                self.query_start_loc[: size + 1]
                if on_cpu
                else torch.arange(size + 1, dtype=torch.int32)
            ),
            seq_lens=self.seq_lens[:size],
            # unread by the triton backend; read on the CPU
            seq_lens_cpu=self.seq_lens[:size] if on_cpu else torch.ones(size, dtype=torch.int32),
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            num_reqs=size,
            num_actual_tokens=size,
            max_query_len=1,
            max_seq_len=self.block_table.shape[1] * self.block_size,
            block_size=self.block_size,
        )

    @abstractmethod
    def _capture(self, size: int) -> None:
        """Capture bucket `size` into `self.outputs[size]` and the kind's graph."""

    @abstractmethod
    def _replay(self, size: int) -> None: ...

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first.

        Mutates the KV caches only through padding rows (slot -1): nothing is written.
        """
        start = time.perf_counter()
        for size in reversed(self.sizes):
            self._capture(size)
        logger.info(
            "captured %d decode %s graphs (batch %d..%d) in %.1f s",
            len(self.sizes),
            self.kind,
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
        self._replay(size)
        return self.outputs[size][:n]


class CudaDecodeGraphs(DecodeGraphs):
    kind = "CUDA"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None  # smaller buckets reuse the largest one's memory pool

    def _forward(self, size: int) -> torch.Tensor:
        with set_forward_context(self.attn_backend.build(self._metadata(size))):
            return self.model(self.input_ids[:size], self.positions[:size])

    def _capture(self, size: int) -> None:
        self._forward(size)  # warm-up: Triton compiles and autotunes outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[size] = self._forward(size)
        self.pool = graph.pool()
        self.graphs[size] = graph
        torch.cuda.synchronize()

    def _replay(self, size: int) -> None:
        self.graphs[size].replay()


class CpuDecodeGraphs(DecodeGraphs):
    """CPU graphs record the C kernels of one forward (`cpu_runtime.capture`); the attention
    metadata is built before the capture, from the persistent buffers, and stays valid. Every
    bucket's activations come from one shared pool (the largest bucket's size: about 360 KB a
    row for SmolLM2-135M)."""

    kind = "CPU"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from engine.kernels.cpu_runtime import CpuGraph, CpuGraphPool

        self.graphs: dict[int, CpuGraph] = {}
        self.pool = CpuGraphPool()

    def _capture(self, size: int) -> None:
        from engine.kernels.cpu_runtime import capture

        metadata = self.attn_backend.build(self._metadata(size))
        with set_forward_context(metadata), capture(self.pool) as graph:
            self.outputs[size] = self.model(self.input_ids[:size], self.positions[:size])
        graph.keep.append(metadata)
        self.graphs[size] = graph

    def _replay(self, size: int) -> None:
        self.graphs[size].replay()
