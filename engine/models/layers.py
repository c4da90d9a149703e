"""Layers the models share: linear layers with a pluggable weight format, the embedding, and
the family of kernels their small ops run on.

A `Linear` holds its weight in whatever form its `LinearMethod` chose (vLLM's design): the
method creates the parameters the checkpoint loads into, turns them into its runtime format
once loaded (`process_weights`: quantize, pack), and multiplies (`apply`). The unquantized
method lives here; quantized ones are in `engine/quantization.py`. A linear layer may carry
the activation that follows it (the MLP's SiLU-and-multiply), so kernels that can fuse it
into their epilogue do.

`ModelKernels` is the set of small-op kernels of one family: Triton on CUDA (`triton`
attention backend), C on the CPU (`cpu` backend), or none: plain torch (`torch` backend),
which is also the reference path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# A step-size limit that no step reaches: the C kernels serve every batch size.
ALL_TOKENS = 1 << 30
# Logits of at least this many bytes are written around the caches by the C kernels
# (`cpu_linear.c`, STREAM_OUT, whose figures say where it pays): several times a core's L2
# (1-2 MiB), they leave it before the sampler reads them anyway; at 1-32 rows of SmolLM2's
# logits (at most 6 MB in fp32) streaming measured 0.95-1.04x the time, no clear gain.
STREAM_LOGITS_MIN_BYTES = 8 << 20


def cpu_float_kernel_max_tokens(dtype: torch.dtype) -> int:
    """Steps of at most this many tokens use C kernels for unquantized linear layers on the
    CPU (so that a decode graph can record them); larger ones use torch's matmul (oneDNN),
    which reaches the compute peak there. Measured on a 2-vCPU AVX2 EPYC in fp32, the 121
    linear layers of a SmolLM2-135M pass (`python -m benchmarks.linear_kernels`), C float /
    oneDNN: 0.76 at M = 1, 0.52 at 2, 0.72 at 4, 1.29 at 8, 1.95 at 16, 2.48 at 32. In bf16
    on a CPU with AVX512-BF16 the weights are packed for `linear_bf16_packed` (`packs_bf16`),
    which serves every step, so decode graphs take every batch size: with AVX512-BF16 alone
    (vdpbf16ps), on 2 vCPUs of a Zen 4 EPYC, every layer's weights of its own, read from DRAM
    as in the engine (`python -m benchmarks.linear_kernels --per-layer-weights`,
    results/linear_kernels-zen4-packed.md), packed / oneDNN 0.55 at M = 1, 0.45-0.56 at
    2-64, 0.79 at 128, 0.93 at 256, 0.76 at 2048; on the tile unit (AMX-BF16), on 2 vCPUs of
    an AMX Xeon (results/linear_kernels-amx-packed.md), 0.52 at M = 1-5, 0.55-0.62 at 16-64,
    0.82 at 128, 0.91 at 256, 1.47 at 2048; yet in the engine's 2048-token prompt steps the
    linears with the SiLU-and-multiply took 216 ms against oneDNN's 397 (`cpu_linear.c`), and
    the full workload in bf16 (`python -m benchmarks.throughput --configs int8 --baseline-ref
    37cbec7 --baseline-configs default --peers none`, results/throughput-full-amx-packed.md)
    33.5 -> 26.6 s."""
    from engine.kernels.cpu_build import cpu_bf16_unit

    return ALL_TOKENS if dtype == torch.bfloat16 and cpu_bf16_unit() is not None else 8


def packs_bf16(dtype: torch.dtype) -> bool:
    """Whether unquantized weights are packed for the C packed-bf16 kernel on the CPU: where
    it serves every step (`cpu_float_kernel_max_tokens`)."""
    return cpu_float_kernel_max_tokens(dtype) == ALL_TOKENS


@dataclass(frozen=True)
class ModelKernels:
    """One family's kernels for the model's small ops (same contracts as the Triton ones)."""

    name: str  # "triton" or "cpu"
    rms_norm: Callable
    rotary_embedding: Callable
    silu_and_mul: Callable


def model_kernels(attn_backend_name: str) -> ModelKernels | None:
    """The kernel family that goes with an attention backend; None for plain torch."""
    if attn_backend_name == "triton":
        from engine.kernels.rms_norm import rms_norm
        from engine.kernels.rotary import rotary_embedding
        from engine.kernels.silu_and_mul import silu_and_mul

        return ModelKernels("triton", rms_norm, rotary_embedding, silu_and_mul)
    if attn_backend_name == "cpu":
        from engine.kernels import cpu_ops

        return ModelKernels("cpu", cpu_ops.rms_norm, cpu_ops.rotary_embedding, cpu_ops.silu_and_mul)
    return None


ACTIVATIONS = (None, "silu_and_mul")


class LinearMethod:
    """How a `Linear` stores and multiplies its weight; one instance serves every layer."""

    name = "unquantized"
    # The dtype the checkpoint is loaded in (None: the model's dtype).
    load_dtype: torch.dtype | None = None

    def __init__(self, kernels: ModelKernels | None, dtype: torch.dtype) -> None:
        self.kernels = kernels
        self.dtype = dtype  # of the activations
        self.on_cpu = kernels is not None and kernels.name == "cpu"  # the C kernels
        self.cpu_float_max_tokens = cpu_float_kernel_max_tokens(dtype)
        self.packs_bf16 = self.on_cpu and packs_bf16(dtype)

    @property
    def cpu_graph_max_tokens(self) -> int:
        """Steps of at most this many tokens run only C kernels on the CPU (a CPU graph can
        record them); above it, torch's matmul."""
        return self.cpu_float_max_tokens

    def process_weights(self, layer: Linear) -> None:
        """Called once the checkpoint is loaded: bring the weight into its runtime form."""
        if layer.bias is not None:
            layer.bias_f32 = layer.bias.detach().float().contiguous()
        if self.packs_bf16:
            from engine.kernels.cpu_linear import pack_bf16

            layer.packed = pack_bf16(
                layer.weight.detach(), layer.bias_f32, layer.activation == "silu_and_mul"
            )
            layer.weight = None  # the packed copy holds the same values

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x `[T, in_features]` -> `[T, out_features]` (after the layer's activation)."""
        if self.packs_bf16:
            from engine.kernels.cpu_linear import linear_bf16_packed

            out_dtype = torch.float32 if layer.computes_logits else x.dtype
            return linear_bf16_packed(
                x, layer.packed, out_dtype, layer.streams_out(x.shape[0], out_dtype)
            )
        if self.on_cpu and x.shape[0] <= self.cpu_float_max_tokens:
            from engine.kernels.cpu_linear import linear_float

            return linear_float(
                x,
                layer.weight,
                layer.bias_f32,
                layer.activation == "silu_and_mul",
                torch.float32 if layer.computes_logits else None,
            )
        return self.activate(layer, F.linear(x, layer.weight, layer.bias))

    def embed(self, layer: Linear, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows of a tied LM head whose weight this method packed, in `dtype`."""
        from engine.kernels.cpu_ops import embedding_packed

        return embedding_packed(
            input_ids, layer.packed.packed, layer.out_features, layer.in_features, dtype
        )

    def activate(self, layer: Linear, y: torch.Tensor) -> torch.Tensor:
        if layer.activation is None:
            return y
        if self.kernels is not None:
            return self.kernels.silu_and_mul(y)
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up


class Linear(nn.Module):
    """y = activation(x W^T + b); `weight` `[out_features, in_features]` as loaded."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        method: LinearMethod,
        activation: str | None = None,
        computes_logits: bool = False,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.method = method
        self.activation = activation
        # The LM head. Where the C float kernel multiplies, its fp32 sums come out unrounded:
        # bf16 logits keep 8 bits (a step of 0.125 near 25), so the top two candidates often
        # tie and the argmax takes the lower id: SmolLM2's answer to the README's first
        # question began with "L" (25.369 in fp32) instead of "The" (25.421), both 25.375 in
        # bf16, once small steps moved to the AMX tiles (the C float kernel's then). And large
        # outputs are streamed (`streams_out`).
        self.computes_logits = computes_logits
        dtype = method.load_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.bias_f32: torch.Tensor | None = None  # the bias in fp32, for C epilogues

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def streams_out(self, num_tokens: int, out_dtype: torch.dtype) -> bool:
        """Whether a C kernel writes this call's output around the caches: logits of at least
        `STREAM_LOGITS_MIN_BYTES`, which the sampler reads once, after the whole product."""
        num_bytes = num_tokens * self.out_features * out_dtype.itemsize
        return self.computes_logits and num_bytes >= STREAM_LOGITS_MIN_BYTES

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"method={self.method.name}, activation={self.activation}"
        )


class VocabEmbedding(nn.Module):
    """Token embedding. Tied to the LM head (`tie_to`), it shares the head's weight, and once
    the head's method has taken that weight (quantized, packed), rows come from the head's
    form."""

    def __init__(self, vocab_size: int, hidden_size: int, kernels: ModelKernels | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.kernels = kernels
        self.tied_head: Linear | None = None

    def tie_to(self, head: Linear) -> None:
        self.weight = head.weight
        # A reference, not a submodule: the head belongs to the model (one state_dict entry).
        object.__setattr__(self, "tied_head", head)

    def forward(self, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`[T]` ids -> `[T, hidden]` in `dtype` (the model's activation dtype)."""
        head = self.tied_head
        if head is not None and head.weight is None:  # quantized or packed: the head's rows
            return head.method.embed(head, input_ids, dtype)
        if self.kernels is not None and self.kernels.name == "cpu":
            from engine.kernels.cpu_ops import embedding

            return embedding(input_ids, self.weight, dtype)
        return F.embedding(input_ids, self.weight).to(dtype)
