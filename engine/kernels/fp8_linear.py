"""FP8 (e4m3) W8A8 linear on CUDA through `torch._scaled_mm` with row-wise scales.

Weights are quantized once per output channel, activations per token at each call (in
PyTorch: Triton's fp32 -> fp8 conversion is wrong under TRITON_INTERPRET, so a Triton
quantizer could not be tested here), both with scale = max|row| / 448; `_scaled_mm`
multiplies the fp8 operands and applies scale_a `[M, 1]`, scale_b `[1, N]` and the bias in
its epilogue.

What `_scaled_mm` needs for row-wise scaling (the checks of `_scaled_mm_out_cuda` in recent
PyTorch sources; torch 2.13 on CPU accepts any shape and output dtype):
- a CUDA GPU of compute capability 8.9 (Ada) or 9.0 and newer (Hopper, Blackwell); ROCm GPUs
  use float8_e4m3fnuz and are not supported here;
- K and N multiples of 16 (M is free); mat1 row-major and mat2 column-major, so the weight
  stays `[N, K]` row-major and is passed as its transpose `w_fp8.t()`;
- fp32 scales, with a unit last stride;
- the output dtype depends on the kernel PyTorch dispatches to: CUTLASS (sm89, sm90 with
  cuBLAS < 12.9, sm100+) writes bfloat16 only (float16 too in the newest sources); cuBLAS
  >= 12.9 on sm90 also float32. The bias must be in the output dtype, and float32 output
  takes none. cuBLAS refused row-wise scales on sm120 (GeForce Blackwell, pytorch/pytorch#192707).
These depend on the build and the GPU as much as on the capability, so `fp8_supported` runs
a tiny `fp8_linear` on the device and checks it against the reference.

Shapes that are not multiples of 16 are refused at load (`quantize_weight_fp8` names the
layer) rather than padded: padding K costs a copy of x per call, padding N a strided output,
and the layer dimensions of the models kvrail runs (SmolLM2, Llama 3.x, Qwen3) are multiples
of 64.
"""

from __future__ import annotations

import torch

from engine.attention import FP8_DTYPE, FP8_MAX

MULTIPLE = 16  # _scaled_mm: K and N multiples of 16


def quantize_rows_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric e4m3 per row: t `[R, C]` -> (q `[R, C]` float8_e4m3fn, scale `[R]` float32),
    t ~= q * scale[:, None]; rounds to nearest even. An all-zero row gets scale 0 and q 0."""
    t = t.float()
    scale = t.abs().amax(dim=1) / FP8_MAX
    q = t / torch.where(scale > 0, scale, 1.0)[:, None]
    return q.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_weight_fp8(weight: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """weight `[N, K]` of layer `name` -> (w_fp8 `[N, K]` float8_e4m3fn row-major, w_scale `[N]`
    float32) for `fp8_linear`; raises ValueError naming the layer unless N and K are
    multiples of 16."""
    num_rows, in_features = weight.shape
    if num_rows % MULTIPLE or in_features % MULTIPLE:
        raise ValueError(
            f"quantization='fp8' needs the weight dimensions of every linear layer to be "
            f"multiples of {MULTIPLE} (torch._scaled_mm); layer {name} is "
            f"[{num_rows}, {in_features}]"
        )
    return quantize_rows_fp8(weight)


def fp8_linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ w^T + bias` in fp8: x `[M, K]` (bfloat16 or float16; see `fp8_supported`),
    w_fp8 `[N, K]` float8_e4m3fn row-major and w_scale `[N]` float32 from
    `quantize_weight_fp8`, bias `[N]` in x's dtype or None. Returns `[M, N]` in x's dtype."""
    if x.dim() != 2 or w_fp8.dtype != FP8_DTYPE or w_fp8.shape[1] != x.shape[1]:
        raise ValueError(
            f"x must be [M, K] and w_fp8 float8_e4m3fn [N, K], got x {tuple(x.shape)} "
            f"and w_fp8 {tuple(w_fp8.shape)} {w_fp8.dtype}"
        )
    if w_scale.dtype != torch.float32 or w_scale.shape != w_fp8.shape[:1]:
        raise ValueError(f"w_scale must be float32 [{w_fp8.shape[0]}], got {w_scale.dtype}")
    if bias is not None and bias.dtype != x.dtype:
        raise ValueError(f"bias must be in x's dtype {x.dtype}, got {bias.dtype}")
    x_fp8, x_scale = quantize_rows_fp8(x)
    # use_fast_accum stays off: Hopper's fast fp8 accumulation keeps fewer bits (untimed).
    return torch._scaled_mm(
        x_fp8,
        w_fp8.t(),
        scale_a=x_scale[:, None],
        scale_b=w_scale[None, :],
        bias=bias,
        out_dtype=x.dtype,
    )


def fp8_linear_ref(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch reference of `fp8_linear`: the same quantized activations, dequantized and
    multiplied in float32."""
    x_fp8, x_scale = quantize_rows_fp8(x)
    out = (x_fp8.float() * x_scale[:, None]) @ (w_fp8.float() * w_scale[:, None]).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def fp8_supported(
    device: torch.device | str, dtype: torch.dtype = torch.bfloat16
) -> tuple[bool, str]:
    """Whether `fp8_linear` runs on `device` with `dtype` activations, and why (not); for the
    engine to refuse quantization='fp8' at startup. On a CUDA device that passes the static
    checks it runs a 16 x 32 x 16 `fp8_linear` with a bias and checks the result."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, (
            f"quantization='fp8' needs a CUDA GPU of compute capability 8.9 or newer "
            f"(torch._scaled_mm), got device {device.type!r}"
        )
    if torch.version.hip:
        return False, "quantization='fp8' is not supported on ROCm (float8_e4m3fnuz)"
    name = torch.cuda.get_device_name(device)
    major, minor = torch.cuda.get_device_capability(device)
    gpu = f"{name} (compute capability {major}.{minor})"
    if (major, minor) < (8, 9):
        return False, f"quantization='fp8' needs compute capability 8.9 or newer; {gpu}"
    if dtype not in (torch.bfloat16, torch.float16):
        return False, f"quantization='fp8' needs dtype bfloat16 or float16, got {dtype}"
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(16, 32, device=device, generator=gen).to(dtype)
    w_fp8, w_scale = quantize_rows_fp8(torch.randn(16, 32, device=device, generator=gen))
    bias = torch.randn(16, device=device, generator=gen).to(dtype)
    try:
        out = fp8_linear(x, w_fp8, w_scale, bias)
    except (RuntimeError, ValueError) as exc:
        return False, f"torch._scaled_mm with row-wise scales and {dtype} fails on {gpu}: {exc}"
    expected = fp8_linear_ref(x, w_fp8, w_scale, bias).float()
    if not torch.allclose(out.float(), expected, atol=0.05, rtol=0.02):
        return False, f"torch._scaled_mm with row-wise scales gives wrong results on {gpu}"
    return True, gpu
