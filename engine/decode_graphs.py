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

With speculative decoding, steps verify up to k drafts a request: up to k + 1 query tokens
each. CPU graphs capture those steps too, as "verify" buckets of `size` requests and
`size * (k + 1)` token rows, whose attention runs the decode kernel over a few queries a
request (any query length up to k + 1, read from the buffers at replay); a step whose
requests have fewer tokens pads them with rows that belong to no request. CUDA graphs capture
decode steps only: verify steps run eagerly there (`DecodeGraphs.query_lens`).
"""

from __future__ import annotations

import bisect
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
    """Decode-step graphs of `model` for every bucket; see the module docstring.

    Buckets are (query_len, size): `size` requests of at most `query_len` tokens, for each
    size of `sizes` and each length of `query_lens` (1: decode; k + 1: verify) whose
    `size * query_len` rows do not pass `max_num_tokens`; verify buckets only up to the
    smallest size that holds `max_verify_reqs` requests (None: every size), as speculation
    stops at a batch size (`disable_by_batch_size`).
    """

    kind: str

    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: AttentionBackend,
        sizes: list[int],
        max_num_blocks_per_req: int,
        block_size: int,
        device: torch.device,
        query_lens: tuple[int, ...] = (1,),
        max_num_tokens: int = 1 << 30,
        max_verify_reqs: int | None = None,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.block_size = block_size
        verify_sizes = sizes  # sorted: up to the first that holds max_verify_reqs
        if max_verify_reqs is not None:
            verify_sizes = sizes[: bisect.bisect_left(sizes, max_verify_reqs) + 1]
        self.buckets = sorted(
            (q, size)
            for q in query_lens
            for size in (sizes if q == 1 else verify_sizes)
            if size * q <= max_num_tokens
        )
        num_reqs = max(size for _, size in self.buckets)
        num_tokens = max(q * size for q, size in self.buckets)
        self.input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(num_reqs, dtype=torch.int32, device=device)
        # Per query_len: decode buckets keep arange (a row a request), verify ones are
        # rewritten each replay.
        self.query_start_loc = {
            q: torch.arange(num_reqs + 1, dtype=torch.int32, device=device) * q for q in query_lens
        }
        self.block_table = torch.zeros(
            (num_reqs, max_num_blocks_per_req), dtype=torch.int32, device=device
        )
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}

    def _metadata(self, q: int, size: int) -> CommonAttentionMetadata:
        """A bucket's metadata over the persistent buffers (on the CPU, the `*_cpu` fields are
        the same buffers, so the step's values reach the backend through them)."""
        on_cpu = self.seq_lens.device.type == "cpu"
        qsl = self.query_start_loc[q][: size + 1]
        return CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=(qsl if on_cpu else torch.arange(size + 1, dtype=torch.int32) * q),
            seq_lens=self.seq_lens[:size],
            # unread by the triton backend; read on the CPU
            seq_lens_cpu=self.seq_lens[:size] if on_cpu else torch.ones(size, dtype=torch.int32),
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[: size * q],
            num_reqs=size,
            num_actual_tokens=size * q,
            max_query_len=q,
            block_size=self.block_size,
        )

    @abstractmethod
    def _capture(self, q: int, size: int) -> None:
        """Capture bucket (q, size) into `self.outputs[q, size]` and the kind's graph."""

    @abstractmethod
    def _replay(self, q: int, size: int) -> None: ...

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first.

        Mutates the KV caches only through padding rows (slot -1): nothing is written. A
        verify bucket is captured with each request's queries at positions 0..q-1 (a valid
        causal shape), its seq_lens reset after.
        """
        start = time.perf_counter()
        for q, size in reversed(self.buckets):
            self.seq_lens[:size].fill_(q if q > 1 else 0)
            self._capture(q, size)
        self.seq_lens.zero_()
        logger.info(
            "captured %d decode %s graphs (query_len, batch: %s) in %.1f s",
            len(self.buckets),
            self.kind,
            self.buckets,
            time.perf_counter() - start,
        )

    def _bucket(self, common: CommonAttentionMetadata) -> tuple[int, int] | None:
        """The smallest bucket that holds the step, decode ones first; None: run eagerly."""
        for q, size in self.buckets:
            if (
                common.max_query_len <= q
                and common.num_reqs <= size
                and common.num_actual_tokens <= q * size
                and (q == 1) == (common.max_query_len == 1)
            ):
                return q, size
        return None

    def can_run(self, common: CommonAttentionMetadata) -> bool:
        return self._bucket(common) is not None

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, common: CommonAttentionMetadata
    ) -> torch.Tensor:
        """Replay the smallest bucket that fits this step; `[num_actual_tokens, hidden]`.

        Inputs are device tensors of the step; copies into the buffers are device-side.
        """
        q, size = self._bucket(common)
        n, num_tokens = common.num_reqs, common.num_actual_tokens
        width = common.block_table.shape[1]
        self.input_ids[:num_tokens].copy_(input_ids, non_blocking=True)
        self.positions[:num_tokens].copy_(positions, non_blocking=True)
        self.slot_mapping[:num_tokens].copy_(common.slot_mapping[:num_tokens], non_blocking=True)
        self.seq_lens[:n].copy_(common.seq_lens, non_blocking=True)
        # Entries past `width` are stale but never read: each row reads cdiv(seq_len, bs).
        self.block_table[:n, :width].copy_(common.block_table, non_blocking=True)
        self.slot_mapping[num_tokens : q * size].fill_(-1)
        self.seq_lens[n:size].zero_()
        if q > 1:  # padding requests have no queries; padding rows belong to none
            qsl = self.query_start_loc[q]
            qsl[: n + 1].copy_(common.query_start_loc, non_blocking=True)
            qsl[n + 1 : size + 1].fill_(num_tokens)
        self._replay(q, size)
        return self.outputs[q, size][:num_tokens]


class CudaDecodeGraphs(DecodeGraphs):
    kind = "CUDA"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None  # smaller buckets reuse the largest one's memory pool

    def _forward(self, q: int, size: int) -> torch.Tensor:
        with set_forward_context(self.attn_backend.build(self._metadata(q, size))):
            return self.model(self.input_ids[: q * size], self.positions[: q * size])

    def _capture(self, q: int, size: int) -> None:
        self._forward(q, size)  # warm-up: Triton compiles and autotunes outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[q, size] = self._forward(q, size)
        self.pool = graph.pool()
        self.graphs[q, size] = graph
        torch.cuda.synchronize()

    def _replay(self, q: int, size: int) -> None:
        self.graphs[q, size].replay()


class CpuDecodeGraphs(DecodeGraphs):
    """CPU graphs record the C kernels of one forward (`cpu_runtime.capture`); the attention
    metadata is built before the capture, from the persistent buffers, and stays valid. Every
    bucket's activations come from one shared pool (the largest bucket's size: about 360 KB a
    row for SmolLM2-135M)."""

    kind = "CPU"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from engine.kernels.cpu_runtime import CpuGraph, CpuGraphPool

        self.graphs: dict[tuple[int, int], CpuGraph] = {}
        self.pool = CpuGraphPool()

    def _capture(self, q: int, size: int) -> None:
        from engine.kernels.cpu_runtime import capture

        metadata = self.attn_backend.build(self._metadata(q, size))
        with set_forward_context(metadata), capture(self.pool) as graph:
            self.outputs[q, size] = self.model(
                self.input_ids[: q * size], self.positions[: q * size]
            )
        graph.keep.append(metadata)
        self.graphs[q, size] = graph

    def _replay(self, q: int, size: int) -> None:
        self.graphs[q, size].replay()
