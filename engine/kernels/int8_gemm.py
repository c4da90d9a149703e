"""W8A8 int8 linear for CUDA: `x @ w^T` with int8 weights and int8 activations.

Weights are quantized once, symmetric per output channel (`w ~= w_q * w_scale[:, None]`);
activations each call, symmetric per token (`x ~= x_q * x_scale[:, None]`) by
`_quantize_per_token_kernel`. `_int8_gemm_kernel` multiplies the int8 tiles on the int8
tensor cores with int32 accumulation (exact for K < 133,000: |sum| <= K * 127^2 < 2^31) and
applies both scales and the bias once per output in the epilogue.

Weight layout: `w_q` keeps nn.Linear's `[N, K]` with K contiguous, and the kernel reads its
`[BLOCK_K, BLOCK_N]` tiles as a transposed view. That is the layout the int8 MMA instructions
take for both operands (mma.sync s8 and Hopper's wgmma need K-major 8-bit operands; only
16-bit types can be transposed on the way into the tensor cores), so no repacking at load
and no transpose in the kernel.

Rounding: q = round-half-to-even(x * (127 / max|x|)), the reciprocal an IEEE division, then
clamped to [-127, 127], as the CPU kernel (`cpu_linear.c`, `nearbyintf`) does; an all-zero
row gets scale 0 and q 0. The PyTorch reference of both is `engine.kernels.int8_ref`.
Triton has no rounding float-to-int cast in the interpreter
(`libdevice.rint` is unsupported there), so the kernel rounds with the 1.5 * 2^23 trick: for
|q| < 2^22, `(q + 1.5 * 2^23) - 1.5 * 2^23` is q rounded half to even by the fp32 adds. It
is launched with `enable_fp_fusion=False`, so the GPU does not contract the multiply and the
add into an fma (which would round the exact product instead of the fp32 one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_ROUND_MAGIC = 12582912.0  # 1.5 * 2^23
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _quantize_per_token_kernel(
    X,
    X_q,
    X_scale,
    stride_x,
    stride_xq,
    K,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for start_k in range(0, K, BLOCK_K):
        mask_k = start_k + offs_k < K
        x = tl.load(X + row * stride_x + start_k + offs_k, mask=mask_k, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    row_max = tl.max(amax, 0)
    # IEEE divisions (`/` is approximate on the GPU) so the GPU, the CPU kernel and the
    # reference agree on q; an all-zero row divides by 1 and multiplies by 0.
    safe_max = tl.where(row_max > 0.0, row_max, 1.0)
    inv_scale = tl.where(row_max > 0.0, tl.math.div_rn(127.0, safe_max), 0.0)
    # The row was just read: the second pass mostly hits L2.
    for start_k in range(0, K, BLOCK_K):
        mask_k = start_k + offs_k < K
        x = tl.load(X + row * stride_x + start_k + offs_k, mask=mask_k, other=0.0)
        q = x.to(tl.float32) * inv_scale
        q = (q + _ROUND_MAGIC) - _ROUND_MAGIC
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(X_q + row * stride_xq + start_k + offs_k, q.to(tl.int8), mask=mask_k)
    tl.store(X_scale + row, tl.math.div_rn(row_max, 127.0))


@triton.jit
def _int8_gemm_kernel(
    X_q,
    W_q,
    X_scale,
    W_scale,
    Bias,
    Out,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped ordering (Triton's matmul tutorial): consecutive programs walk GROUP_M row
    # tiles down one column of tiles, so the weight tiles they share stay in L2.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m

    # int64 rows: M * N of an lm_head-sized output passes 2^31.
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = X_q + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = W_q + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for start_k in range(0, K, BLOCK_K):
        mask_k = offs_k < K - start_k
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0)
        acc = tl.dot(x, w, acc, out_dtype=tl.int32)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    x_scale = tl.load(X_scale + offs_m, mask=mask_m, other=0.0)
    w_scale = tl.load(W_scale + offs_n, mask=mask_n, other=0.0)
    out = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        out += tl.load(Bias + offs_n, mask=mask_n, other=0.0)[None, :]
    out_ptrs = Out + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@dataclass(frozen=True)
class Int8GemmConfig:
    """Tiles and launch parameters of `_int8_gemm_kernel`."""

    block_m: int
    block_n: int
    block_k: int  # int8: 128 bytes = one cache line per row of a tile
    group_m: int  # row tiles per group of the program ordering
    num_warps: int
    num_stages: int  # software pipelining depth of the K loop (ignored by the interpreter)


def int8_gemm_config(num_tokens: int) -> Int8GemmConfig:
    """Tiles for an M-token GEMM. UNTUNED (no GPU was available when written): shapes follow
    the usual int8 GEMM heuristics; `benchmarks/gpu_check.py` (section `int8_linear`)
    times them against bf16 F.linear, and this table is where to put measured choices.

    - M <= 16 (decode): GEMV-like. One 16-row tile (tl.dot's minimum) covers all tokens, the
      weights are streamed once, so narrow N tiles give more programs to spread the weight
      read over the SMs, and long K tiles keep each load wide.
    - M <= 64, M <= 256: taller tiles as the weights get reused across more rows.
    - M > 256 (prefill): 128 x 128 output tiles, compute-bound, 8 warps.
    """
    if num_tokens <= 16:
        return Int8GemmConfig(16, 32, 256, 1, 4, 4)
    if num_tokens <= 64:
        return Int8GemmConfig(64, 64, 128, 8, 4, 4)
    if num_tokens <= 256:
        return Int8GemmConfig(64, 128, 128, 8, 4, 3)
    return Int8GemmConfig(128, 128, 128, 8, 8, 3)


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[M, K]` (float16/bfloat16/float32, K contiguous) -> (x_q `[M, K]` int8, x_scale `[M]`
    float32) with x ~= x_q * x_scale[:, None]; the Triton kernel."""
    num_tokens, in_features = x.shape
    x_q = torch.empty((num_tokens, in_features), dtype=torch.int8, device=x.device)
    x_scale = torch.empty(num_tokens, dtype=torch.float32, device=x.device)
    if num_tokens:
        _quantize_per_token_kernel[(num_tokens,)](
            x,
            x_q,
            x_scale,
            x.stride(0),
            x_q.stride(0),
            in_features,
            BLOCK_K=min(triton.next_power_of_2(in_features), 4096),
            enable_fp_fusion=False,
        )
    return x_q, x_scale


def _check_inputs(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(
            f"x must be [M, K] with K contiguous and dtype in {ACTIVATION_DTYPES}, "
            f"got {tuple(x.shape)} {x.dtype} strides {x.stride()}"
        )
    if w_q.dim() != 2 or w_q.dtype != torch.int8 or w_q.shape[1] != x.shape[1]:
        raise ValueError(f"w_q must be int8 [N, {x.shape[1]}], got {tuple(w_q.shape)} {w_q.dtype}")
    num_rows = w_q.shape[0]
    for name, t in (("w_scale", w_scale), ("bias", bias)):
        if t is not None and (t.shape != (num_rows,) or t.dtype != torch.float32):
            raise ValueError(f"{name} must be float32 [{num_rows}], got {tuple(t.shape)} {t.dtype}")
    devices = {t.device for t in (x, w_q, w_scale, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"x, w_q, w_scale and bias must be on one device, got {devices}")


def int8_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: Int8GemmConfig | None = None,
) -> torch.Tensor:
    """W8A8 `x @ w^T + bias`: x `[M, K]` float16/bfloat16/float32 (K contiguous); w_q `[N, K]`
    int8 (any strides; K-contiguous is the fast layout), w_scale `[N]` float32, bias `[N]`
    float32 or None. Returns `[M, N]` in x's dtype. `config` overrides `int8_gemm_config(M)`."""
    _check_inputs(x, w_q, w_scale, bias)
    num_tokens = x.shape[0]
    num_rows, in_features = w_q.shape
    out = torch.empty((num_tokens, num_rows), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    x_q, x_scale = quantize_per_token_int8(x)
    cfg = config or int8_gemm_config(num_tokens)
    grid = (triton.cdiv(num_tokens, cfg.block_m) * triton.cdiv(num_rows, cfg.block_n),)
    _int8_gemm_kernel[grid](
        x_q,
        w_q,
        x_scale,
        w_scale,
        w_scale if bias is None else bias,  # never read without HAS_BIAS
        out,
        num_tokens,
        num_rows,
        in_features,
        x_q.stride(0),
        x_q.stride(1),
        w_q.stride(0),
        w_q.stride(1),
        out.stride(0),
        out.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
