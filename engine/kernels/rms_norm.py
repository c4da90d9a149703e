"""RMSNorm fused with the residual add: one read of x (and residual), one write of each output.

Rounds as HF does: the sum and the normalized value are rounded to the input dtype before
the weight multiply, so bf16 results match the unfused module bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    X,
    Residual,
    Weight,
    Out,
    Residual_out,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    x = tl.load(X + row * stride_x + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        x = (x + r).to(Out.dtype.element_ty)
        tl.store(Residual_out + row * stride_ro + offs_n, x, mask=mask_n)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    w = tl.load(Weight + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    y = (x * rstd).to(Out.dtype.element_ty).to(tl.float32) * w
    tl.store(Out + row * stride_o + offs_n, y.to(Out.dtype.element_ty), mask=mask_n)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension; with `residual`, normalize `x + residual` and also
    return that sum (the next layer's residual). Inputs are not modified."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    has_residual = residual is not None
    r2 = residual.reshape(-1, shape[-1]) if has_residual else x2
    residual_out = torch.empty_like(out) if has_residual else out
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out,
            residual_out,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            residual_out.stride(0),
            shape[-1],
            eps,
            HAS_RESIDUAL=has_residual,
            BLOCK_N=triton.next_power_of_2(shape[-1]),
        )
    if has_residual:
        return out.view(shape), residual_out.view(shape)
    return out.view(shape)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference (HF's LlamaRMSNorm, with the residual add in front)."""
    if residual is not None:
        x = x + residual
        residual = x
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * x32.to(x.dtype)
    return out if residual is None else (out, residual)
