"""FP8 linear: the reference on a hand-computed case, quantization error bounds, the support
check, and `fp8_linear` itself on CPU (torch 2.13's `_scaled_mm` runs there, emulated)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.fp8_linear import (
    FP8_DTYPE,
    fp8_linear,
    fp8_linear_ref,
    fp8_supported,
    quantize_rows_fp8,
    quantize_weight_fp8,
)


def test_fp8_linear_ref_hand_computed():
    # Rows whose ratios to their max are powers of two: exact in e4m3 after scaling to 448.
    x = torch.tensor([[448.0, -224.0, 112.0, 0.0], [3.0, 1.5, -0.75, 0.0], [0.0, 0.0, 0.0, 0.0]])
    w_fp8 = torch.tensor([[1.0, 2.0, 0.5, 3.0], [-1.0, 0.0, 0.0, 0.25]]).to(FP8_DTYPE)
    w_scale = torch.tensor([0.5, 2.0])
    bias = torch.tensor([1.0, -1.0])
    # Row 0: (448 - 448 + 56) * 0.5 = 28, -448 * 2 = -896; row 1: (3 + 3 - 0.375) * 0.5
    # = 2.8125, -3 * 2 = -6; row 2 (all zero): the bias.
    expected = torch.tensor([[29.0, -897.0], [3.8125, -7.0], [1.0, -1.0]])
    assert torch.equal(fp8_linear_ref(x, w_fp8, w_scale, bias), expected)
    x_fp8, x_scale = quantize_rows_fp8(x)
    assert torch.equal(x_scale, torch.tensor([448.0, 3.0, 0.0]) / 448)
    assert x_fp8[1].float().tolist() == [448.0, 224.0, -112.0, 0.0]


def test_quantize_rows_fp8_error_bounds():
    gen = torch.Generator().manual_seed(0)
    # Rows spanning many magnitudes, so small entries land in e4m3's subnormal range.
    t = torch.randn(6, 256, generator=gen) * torch.logspace(-4, 2, 256)[torch.randperm(256)]
    t[3] = 0.0
    q, scale = quantize_rows_fp8(t)
    assert q.dtype == FP8_DTYPE and scale.shape == (6,)
    assert scale[3] == 0 and not q[3].float().any(), "an all-zero row: scale 0, q 0"
    assert torch.equal(q.float().abs().amax(dim=1)[scale > 0], torch.full((5,), 448.0))
    err = (q.float() * scale[:, None] - t).abs()
    # Round to nearest with 3 mantissa bits: half a spacing, 2^-4 relative for normals and
    # 2^-10 * scale (half of the 2^-9 subnormal step) below 2^-6 * scale.
    bound = torch.maximum(t.abs() * 2**-4, scale[:, None] * 2**-10) * (1 + 1e-5)
    assert (err <= bound).all()
    assert (q.float().abs() < 2**-6).any(), "the test must reach the subnormals"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_fp8_linear_on_cpu(num_tokens, has_bias, dtype):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=gen) * 0.05
    w_fp8, w_scale = quantize_weight_fp8(w, "layers.0.mlp.down_proj")
    bias = torch.randn(48, generator=gen).to(dtype) if has_bias else None
    x = torch.randn(num_tokens, 64, generator=gen).to(dtype)
    out = fp8_linear(x, w_fp8, w_scale, bias)
    expected = fp8_linear_ref(x, w_fp8, w_scale, bias)
    assert out.dtype == dtype and out.shape == (num_tokens, 48)
    torch.testing.assert_close(out, expected, atol=1e-3, rtol=1.6e-2)
    exact = F.linear(x.float(), w, None if bias is None else bias.float())
    assert (out.float() - exact).abs().max() < 0.06 * exact.abs().max()


def test_fp8_rejects_bad_inputs():
    with pytest.raises(ValueError, match=r"layers\.3\.self_attn\.qkv_proj is \[40, 64\]"):
        quantize_weight_fp8(torch.randn(40, 64), "layers.3.self_attn.qkv_proj")
    w_fp8, w_scale = quantize_weight_fp8(torch.randn(16, 32), "w")
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bias"):
        fp8_linear(x, w_fp8, w_scale, torch.zeros(16))
    with pytest.raises(ValueError, match="w_fp8"):
        fp8_linear(x, w_fp8.float(), w_scale)
    with pytest.raises(ValueError, match="w_scale"):
        fp8_linear(x, w_fp8, w_scale.half())


def test_fp8_supported_refuses_without_a_capable_gpu(monkeypatch):
    ok, reason = fp8_supported("cpu")
    assert not ok and "CUDA GPU" in reason and "'cpu'" in reason
    # A CUDA device seen through a stubbed torch.cuda: the static checks need no GPU.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A10")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 6))
    ok, reason = fp8_supported("cuda")
    assert not ok and "8.9" in reason and "NVIDIA A10 (compute capability 8.6)" in reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    ok, reason = fp8_supported("cuda", torch.float32)
    assert not ok and "bfloat16" in reason
