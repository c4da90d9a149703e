"""Attention backends behind one interface, and the per-step forward context.

The model runner builds one `CommonAttentionMetadata` per step, hands it to the backend's
`build` (all per-step precomputation happens there, once), and runs the model inside
`set_forward_context(metadata)`; each attention layer reads the metadata back with
`get_forward_context()` and calls `backend.forward`.

The KV cache is stored in the model dtype; with `kv_cache_dtype="bfloat16"` under a float32
model, in bf16 (half the bytes decode attention reads, each value rounded once, the arithmetic
still fp32); or, with `kv_cache_dtype="fp8"`, in float8 e4m3
with one static scale per layer for K and one for V (`quantize_kv` / `dequantize_kv`), and K
stored less its per-channel mean (`k_shift`). e4m3 keeps 3 mantissa bits of each value, so its
error grows with the value; post-rotary keys carry a large component that is the same at every
position (SmolLM2: the channel means take a layer's max |k| from 10-22 down to 7-16), and a
constant subtracted from every key shifts each query's scores by one constant, which softmax
ignores. Measured on SmolLM2-135M (`benchmarks/quality.py`, fp32): perplexity x1.0141 with
fp8 K and V, x1.0065 with K shifted.
"""

from __future__ import annotations

import contextlib
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

# vLLM's "fp8" (KV cache and weights): e4m3 (no infinities; NaN only as 0x7f/0xff), largest
# finite 448.
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max


def quantize_kv(
    x: torch.Tensor, cache_dtype: torch.dtype, scale: float, shift: torch.Tensor | None = None
) -> torch.Tensor:
    """What a cache of `cache_dtype` stores for `x` `[T, num_kv_heads, head_dim]`.

    fp8: round_to_e4m3(clamp((x - shift) / scale, -448, 448)), computed in fp32 so bf16 inputs
    are rounded once; `shift` is fp32 `[num_kv_heads, head_dim]` (K's, or None: zero); the
    clamp saturates out-of-range values (an unclamped conversion may give NaN). Any other
    cache dtype stores `x` rounded to it (its scale and shift are unused).
    """
    if cache_dtype != FP8_DTYPE:
        return x.to(cache_dtype)
    x = x.float() if shift is None else x.float() - shift
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(stored: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cache contents as `dtype` values: `stored * scale` for fp8, a plain cast otherwise."""
    if stored.dtype != FP8_DTYPE:
        return stored.to(dtype)
    return stored.to(dtype) * scale


@dataclass
class CommonAttentionMetadata:
    """Backend-independent description of one step's flat batch."""

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative query lengths (on device)
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32, same on CPU
    seq_lens: torch.Tensor  # [num_reqs] int32, context length after this step (on device)
    seq_lens_cpu: torch.Tensor  # [num_reqs] int32, num_computed_tokens + num_scheduled_tokens
    block_table: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int32, on device
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, block_id * block_size + offset
    num_reqs: int
    num_actual_tokens: int  # sum of query lengths; inputs may be padded beyond it
    max_query_len: int
    block_size: int


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape and size of one model's paged KV cache: per layer a (k_cache, v_cache) pair."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # what the cache stores: the model dtype, or FP8_DTYPE (1 byte)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes one block id costs across all layers, K and V together."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize

    def allocate(
        self, num_blocks: int, block_size: int, device: torch.device | str
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zero-filled caches for every layer.

        Zeros matter: attention gathers whole blocks and masks the unused slots, and a NaN
        left in a masked slot by `torch.empty` would still poison the softmax.
        """
        shape = self.kv_cache_shape(num_blocks, block_size)
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=device),
                torch.zeros(shape, dtype=self.dtype, device=device),
            )
            for _ in range(self.num_layers)
        ]


class AttentionBackend(ABC):
    """Paged causal attention over a flat batch of requests.

    KV cache layout per layer: `k_cache`, `v_cache`, each
    `[num_blocks, block_size, num_kv_heads, head_dim]`, in the model dtype or in FP8_DTYPE.
    """

    name: str

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any:
        """Precompute everything the step's layers share (indices, masks, groups), once."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: Any,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        k_shift: torch.Tensor | None = None,  # [num_kv_heads, head_dim] fp32, fp8 caches only
    ) -> torch.Tensor:
        """Write the step's k/v into the caches, then attend; returns [T, num_heads, head_dim].

        Mutates `k_cache`/`v_cache`: all new tokens of the batch are written (through
        `slot_mapping`) before any request reads, so a block shared in this step is complete.
        Each request's new queries attend causally to its whole context through its block
        table. Rows past `num_actual_tokens` (padding) come back as zeros.

        `scale` multiplies q.k. With an fp8 cache, `k_scale` and `v_scale` are the layer's
        quantization scales and `k_shift` the keys' per-channel mean: the cache stores
        `quantize_kv(k, FP8_DTYPE, k_scale, k_shift)` and every key attended to, the step's own
        included, is the stored value times `k_scale` (V likewise, unshifted): each query's
        scores all move by q . k_shift, which softmax ignores. With a cache in the model dtype
        the scales are 1.0 and the shift None.
        """


def get_attn_backend(name: str) -> AttentionBackend:
    """Backend instance by name."""
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ValueError(
                "attention backend 'triton' needs the triton package (it comes with CUDA "
                "torch); on the CPU use 'cpu' or 'torch'"
            )
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "cpu":
        from engine.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: 'torch', 'triton', 'cpu'")


def default_attn_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """`auto`: Triton kernels on CUDA; on the CPU the C kernels when the dtype and head size
    are supported and a C compiler is there to build them; the plain torch backend otherwise."""
    if device.type == "cuda":
        return "triton"
    from engine.kernels import cpu_attention, cpu_build

    supported = (
        device.type == "cpu"
        and dtype in cpu_attention.SUPPORTED_DTYPES
        and cpu_attention.supports_head_dim(head_dim)
    )
    return "cpu" if supported and cpu_build.compiler() is not None else "torch"


@dataclass
class ForwardContext:
    attn_metadata: Any  # what the backend's `build` returned for this step


_forward_context: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[ForwardContext]:
    """Make `attn_metadata` visible to every attention layer for one model forward."""
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(attn_metadata=attn_metadata)
    try:
        yield _forward_context
    finally:
        _forward_context = previous


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("no forward context: run the model inside set_forward_context(...)")
    return _forward_context
