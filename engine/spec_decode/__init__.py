"""Speculative decoding: proposers of draft tokens and their lossless verification.

The scheduler treats drafts as more tokens a request lacks; the model runner verifies them
in the target's step (`rejection_sampler`) and asks a proposer for the next ones: the
`ngram` prompt lookup or a `draft_model`.
"""

from __future__ import annotations

import torch


def auto_disable_by_batch_size(
    device: torch.device, dtype: torch.dtype, quantization: str | None
) -> int | None:
    """`disable_by_batch_size="auto"`: the batch size from which verifying drafts costs more
    than the accepted ones save, on the kind of machine where that crossover was measured;
    None (never off) elsewhere.

    A verify step multiplies 1 + k rows a request where a decode step multiplies one, so it is
    nearly free while the linear layers stream their weights and costs in proportion once they
    are compute-bound. In bf16 on a CPU with AVX512-BF16 and no AMX (the vector unit's
    vdpbf16ps), on 2 vCPUs of a Zen 4 EPYC, ngram with k = 5 and no threshold
    (`python -m benchmarks.spec_decode --num-prompts 1 --batch-requests N` with
    `"disable_by_batch_size": null`, 2026-12-06, results/spec_decode-zen4-crossover-b*.md):
    spec / base 1.35x at 4 requests, 1.04x at 8, 0.85x at 16, 0.76x at 32, with mean
    acceptance lengths of 3.2-3.5; again with the packed bf16 kernel (`linear_bf16_packed`,
    results/spec_decode-zen4-packed-crossover-b*.md): 1.02x at 8, 0.87x at 16, 0.83x at 32.
    In bf16 on the tile unit of a CPU with AMX-BF16, on 2 vCPUs of an AMX Xeon (2026-12-06,
    the packed kernel on the tiles; the same commands, and the batch row of
    results/spec_decode-amx-packed.md for 32): 1.31x at 8, 1.04x at 16, 0.98x at 24, 0.95x at
    32 (1.04-1.15x at 32 while oneDNN multiplied larger steps' rows, eagerly), so 16.
    Measured elsewhere, where no threshold helped: the AVX2 EPYC in fp32 1.07x at 32
    requests, 1.02x at 64, 0.92x at 128 (64 as the threshold: 0.94x); not measured with int8
    weights or on CUDA.
    """
    from engine.kernels.cpu_build import cpu_bf16_unit

    if device.type != "cpu" or dtype != torch.bfloat16 or quantization is not None:
        return None
    return {"vector": 8, "amx": 16}.get(cpu_bf16_unit())
