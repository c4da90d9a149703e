"""W8A8's PyTorch reference, shared by the CPU kernel (`cpu_linear`) and the CUDA kernel
(`int8_gemm`): symmetric per-row int8 quantization, and the linear layer it defines.

Rounding: q = round-half-to-even(x * (127 / max|x|)), the reciprocal an IEEE division,
clamped to [-127, 127], as both kernels compute it; an all-zero row gets scale 0 and q 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def quantize_rows_int8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t `[R, C]` -> (q `[R, C]` int8, scale `[R]` float32), t ~= q * scale[:, None]: the
    weight quantizer (w `[N, K]` -> w_q, w_scale) and the per-token activation quantizer."""
    t = t.float()
    row_max = t.abs().amax(dim=1)
    # Tensor / tensor: an IEEE division (`127.0 / t` would be a reciprocal times 127).
    inv_scale = torch.where(row_max > 0, torch.full_like(row_max, 127.0) / row_max, 0.0)
    q = (t * inv_scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, row_max / torch.full_like(row_max, 127.0)


def int8_linear_ref(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """x `[M, K]` -> `[M, N]` in x's dtype: per-token int8 activations, exact integer sums
    (float64, |sum| < 2^53), then the scales and bias in float32. With `silu_mul`, w's rows are
    [gate; up] and the result is silu(gate) * up."""
    x_q, x_scale = quantize_rows_int8(x)
    sums = (x_q.double() @ w_q.double().T).float()
    out = sums * x_scale[:, None] * w_scale[None, :]
    if bias is not None:
        out = out + bias[None, :]
    if silu_mul:
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out.to(x.dtype)
