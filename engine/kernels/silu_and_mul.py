"""SiLU-and-multiply over the fused gate/up projection: `silu(x[:, :I]) * x[:, I:]`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    X,
    Out,
    stride_x,
    stride_o,
    N,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    gate = tl.load(X + row * stride_x + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    # Round silu(gate) to the output dtype before the multiply, as `F.silu(gate) * up` does.
    silu = (gate * tl.sigmoid(gate)).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + offs_n, (silu * up).to(Out.dtype.element_ty), mask=mask_n)


def silu_and_mul(x: torch.Tensor, block_n: int = 1024) -> torch.Tensor:
    """x `[T, 2 * I]` -> `[T, I]`; the last dimension of `x` must be contiguous."""
    num_tokens, width = x.shape
    assert x.stride(-1) == 1 and width % 2 == 0
    out = torch.empty((num_tokens, width // 2), dtype=x.dtype, device=x.device)
    if num_tokens:
        block_n = min(block_n, triton.next_power_of_2(width // 2))
        grid = (num_tokens, triton.cdiv(width // 2, block_n))
        _silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), width // 2, BLOCK_N=block_n)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of `silu_and_mul`."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
