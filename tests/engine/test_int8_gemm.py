"""W8A8 int8 linear (Triton, under TRITON_INTERPRET=1) against its PyTorch reference.

Activations are float16 and float32 only: bfloat16 is unusable in the interpreter (see
docs/field notes); `benchmarks/gpu_check.py` checks bfloat16 on a GPU.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.int8_gemm import Int8GemmConfig, int8_linear, quantize_per_token_int8
from engine.kernels.int8_ref import int8_linear_ref, quantize_rows_int8

DTYPES = [torch.float32, torch.float16]
# One ulp of the output dtype: the kernel and the reference do the same fp32 operations.
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.float16: dict(atol=1e-3, rtol=1e-3)}


def weights(num_rows: int, in_features: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(num_rows, in_features, generator=gen) * 0.05
    w_q, w_scale = quantize_rows_int8(w)
    bias = torch.randn(num_rows, generator=gen)
    return w, w_q, w_scale, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_features", [300, 5000])  # one K tile; several (BLOCK_K <= 4096)
def test_quantize_per_token(dtype, in_features):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(4, in_features, generator=gen) * 3).to(dtype)
    x[1] = 0.0
    # Row 2 has max 127, so x * 127 / max = x: exact halves are ties.
    x[2, :6] = torch.tensor([127.0, 2.5, -2.5, 1.5, 0.5, -0.5])
    x[2, 6:] = 0.25
    x_q, x_scale = quantize_per_token_int8(x)
    ref_q, ref_scale = quantize_rows_int8(x)
    # Same fp32 operations and IEEE divisions in both: bit-exact, ties included.
    assert torch.equal(x_q, ref_q) and torch.equal(x_scale, ref_scale)
    assert x_q[2, :6].tolist() == [127, 2, -2, 2, 0, 0], "ties round half to even"
    assert x_scale[1] == 0 and not x_q[1].any(), "an all-zero row: scale 0, q 0"
    assert x_q.abs().amax(dim=1).tolist() == [127, 0, 127, 127]
    err = (x_q.float() * x_scale[:, None] - x.float()).abs()
    assert (err <= x_scale[:, None] * 0.5001).all(), "round to nearest: error <= scale / 2"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])  # each M bucket of int8_gemm_config
def test_int8_linear(num_tokens, has_bias, dtype):
    w, w_q, w_scale, bias = weights(37, 300)  # N, K odd and not multiples of any tile
    bias = bias if has_bias else None
    x = torch.randn(num_tokens, 300, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = int8_linear(x, w_q, w_scale, bias)
    expected = int8_linear_ref(x, w_q, w_scale, bias)
    assert out.dtype == dtype and out.shape == (num_tokens, 37)
    torch.testing.assert_close(out, expected, **TOL[dtype])
    # And W8A8 stays close to the float layer (a few percent of the output range).
    exact = F.linear(x.float(), w, bias)
    assert (out.float() - exact).abs().max() < 0.03 * exact.abs().max()


def test_int8_linear_tiles_and_strides():
    """Small tiles: 5 row tiles in groups of 2 (a partial last group), 3 column tiles, 4 K
    steps with a partial last one; x a row slice, w_q a transposed view, a zero token."""
    _, w_q, w_scale, bias = weights(45, 100, seed=3)
    w_q_t = w_q.t().contiguous().t()  # [N, K] with N contiguous
    base = torch.randn(70, 128, generator=torch.Generator().manual_seed(4))
    x = base[:, 10:110]
    x[5] = 0.0
    config = Int8GemmConfig(
        block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=1
    )
    out = int8_linear(x, w_q_t, w_scale, bias, config=config)
    torch.testing.assert_close(out, int8_linear_ref(x, w_q, w_scale, bias), **TOL[torch.float32])
    assert torch.equal(out[5], bias), "a zero token gives exactly the bias"
    assert int8_linear(x[:0], w_q, w_scale).shape == (0, 45)


def test_int8_linear_rejects_bad_inputs():
    _, w_q, w_scale, bias = weights(8, 32)
    x = torch.randn(3, 32)
    with pytest.raises(ValueError, match="w_q"):
        int8_linear(x, w_q.float(), w_scale)
    with pytest.raises(ValueError, match="w_q"):
        int8_linear(x[:, :16], w_q, w_scale)
    with pytest.raises(ValueError, match="w_scale"):
        int8_linear(x, w_q, w_scale.half())
    with pytest.raises(ValueError, match="bias"):
        int8_linear(x, w_q, w_scale, bias[:4])
    with pytest.raises(ValueError, match="x must be"):
        int8_linear(x.t().contiguous().t(), w_q, w_scale)
    with pytest.raises(ValueError, match="x must be"):
        int8_linear(x.double(), w_q, w_scale)


def test_gpu_check_dry_run_quantized_sections(tmp_path, monkeypatch):
    """The int8_linear and fp8_linear sections of `benchmarks/gpu_check.py` on CPU at toy sizes
    (fp8 runs there although `fp8_supported` refuses the CPU)."""
    from benchmarks import gpu_check

    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.main(["--dry-run", "--sections", "int8_linear,fp8_linear"]) == 0
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    int8, fp8 = results["int8_linear"], results["fp8_linear"]
    assert "error" not in int8 and "error" not in fp8, (int8.get("error"), fp8.get("error"))
    assert int8["max_rel_err"] < 1e-5 and int8["quantize"]["q_mismatches"] == 0
    assert not fp8["supported"] and "CUDA GPU" in fp8["reason"]
    assert fp8["max_rel_err"] < 1e-2
    for section in (int8, fp8):
        for layer in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            row = section[f"tiny/{layer}"]
            assert set(row["rel_err"]) == {"1", "7", "33"}
            assert row["m1"]["speedup"] > 0 and row["m16"]["tflops"] > 0
