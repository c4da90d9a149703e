"""GPU check: kernels vs references, int8 / fp8 linears vs bf16, engine-vs-HF parity,
throughput, fp8 KV, speculative decoding.

    PYTHONPATH=. python3 benchmarks/gpu_check.py [--quick] [--dry-run]

Sections run one after the other; each records its results or its error and the script
goes on. Models have random weights built from configurations (the device has no network)
and a word-level tokenizer covering every token id. Results go to `$OUT` (or
`benchmarks/results/`) as `gpu_check.json` and `gpu_check.md`. `--dry-run` runs every section
on CPU at toy sizes under TRITON_INTERPRET=1, to check the script itself.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import torch

QWEN3_0_6B = dict(
    architectures=["Qwen3ForCausalLM"],
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
LLAMA_3_2_1B = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
TINY = dict(
    architectures=["Qwen3ForCausalLM"],
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    max_position_embeddings=2048,
    initializer_range=0.3,  # peaky logits: few greedy near-ties
    tie_word_embeddings=True,
)


@dataclass(frozen=True)
class Scale:
    """Problem sizes of one run mode."""

    decode_batch: int
    decode_context: int
    prefill_query: int
    prefill_context: int
    rows: int  # tokens for the elementwise kernels
    parity_prompts: int
    parity_tokens: int
    num_seqs: int  # throughput workload
    max_len: int  # input and output lengths uniform in [min_len, max_len]
    min_len: int
    hf_batch: int
    hf_tokens: int
    step_batch: int  # decode step timing
    step_context: int
    model: dict
    linear_tokens: tuple[int, ...] = (1, 16, 256, 2048)  # quantized linear timing
    linear_check_tokens: tuple[int, ...] = (1, 7, 300)  # and checks at odd M


FULL = Scale(64, 16384, 2048, 4096, 8192, 8, 32, 256, 1024, 100, 32, 256, 256, 1024, QWEN3_0_6B)
QUICK = Scale(32, 8192, 1024, 2048, 4096, 4, 16, 64, 512, 100, 16, 64, 256, 512, QWEN3_0_6B)
DRY = Scale(2, 40, 20, 13, 6, 2, 4, 3, 12, 4, 2, 4, 2, 12, TINY, (1, 16), (1, 7, 33))


def timeit(fn: Callable[[], object], device: torch.device, reps: int = 20) -> float:
    """Median seconds per call (CUDA events via triton's do_bench on GPU)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=reps * 5, return_mode="median") / 1e3
    start = time.perf_counter()
    fn()  # CPU (dry run): timings only have to be positive
    return time.perf_counter() - start


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / timeit(lambda: dst.copy_(src), device)


def kv_bytes_per_token(model: dict, itemsize: int) -> int:
    """K and V of one token over all layers."""
    kv = model["num_key_value_heads"] * model["head_dim"] * itemsize
    return 2 * model["num_hidden_layers"] * kv


def decode_bandwidth_limit_s(
    weight_bytes: int, context_lens: list[int], model: dict, itemsize: int, bandwidth: float
) -> float:
    """Lower bound of one decode step: read every weight once and every context's KV once."""
    kv_bytes = sum(context_lens) * kv_bytes_per_token(model, itemsize)
    return (weight_bytes + kv_bytes) / bandwidth


def nano_vllm_workload(
    num_seqs: int, min_len: int, max_len: int, vocab: int, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench: random token prompts and output lengths, uniform in [min, max]."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(min(10000, vocab)) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num_seqs)
    ]
    return prompts, [rng.randint(min_len, max_len) for _ in range(num_seqs)]


def make_random_model(path: Path, model: dict, device: torch.device) -> Path:
    """Random-weight HF folder (bf16 safetensors) plus a word-level tokenizer, one word per id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    fields = {k: v for k, v in model.items() if k != "architectures"}
    model_type = "qwen3" if model["architectures"][0].startswith("Qwen3") else "llama"
    config = AutoConfig.for_model(
        model_type, architectures=model["architectures"], bos_token_id=0, eos_token_id=1, **fields
    )
    torch.manual_seed(0)
    with torch.device(device):
        hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if model is TINY:
        hf_model = hf_model.float()
    hf_model.save_pretrained(path)
    vocab = {f"w{i}": i for i in range(model["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="w0", eos_token="w1", unk_token="w2"
    ).save_pretrained(path)
    return path


def weight_bytes(llm) -> int:
    from benchmarks.latency import weight_bytes as model_weight_bytes

    return model_weight_bytes(llm.llm_engine.engine_core.model_runner.model)


def _rel_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).abs().max() / expected.float().abs().max())


def check_kernels(scale: Scale, device: torch.device, workdir: Path) -> dict:
    """Each kernel vs its reference in bf16 (fp32 on CPU) for both model shapes, and decode
    attention's achieved bandwidth against the device's copy bandwidth."""
    bandwidth = copy_bandwidth(device, 1 << (30 if device.type == "cuda" else 20))
    results: dict = {"copy_bandwidth_gbs": bandwidth / 1e9}
    models = {"qwen3-0.6b": QWEN3_0_6B, "llama-3.2-1b": LLAMA_3_2_1B}
    for name, model in models.items():
        results[name] = check_kernels_for(model if scale is not DRY else TINY, scale, device)
        decode = results[name]["decode_attention"]
        decode["fraction_of_copy"] = decode["bandwidth_gbs"] * 1e9 / bandwidth
    return results


def check_kernels_for(model: dict, scale: Scale, device: torch.device) -> dict:
    """Each kernel against its reference on `model`'s shapes."""
    from engine.kernels import decode_attention as da
    from engine.kernels import kv_cache_write as kw
    from engine.kernels import prefill_attention as pa
    from engine.kernels import rms_norm as rn
    from engine.kernels import rotary as ro
    from engine.kernels import silu_and_mul as sm
    from engine.models.llama import build_cos_sin_cache

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads, kv_heads, head_dim = (
        model[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim")
    )
    block_size, gen = 16, torch.Generator(device=device).manual_seed(0)
    results: dict = {}

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device).to(dtype)

    # Decode: equal long contexts, scattered blocks.
    batch, context = scale.decode_batch, scale.decode_context
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 1
    k_cache, v_cache = (
        randn(num_blocks, block_size, kv_heads, head_dim),
        randn(num_blocks, block_size, kv_heads, head_dim),
    )
    perm = torch.randperm(num_blocks - 1, device=device, generator=gen)
    block_table = perm.view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    seq_lens[0] = context - block_size // 2 - 1  # one context ending mid-block
    q = randn(batch, heads, head_dim)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    backend_splits = 4 if device.type == "cuda" else 2
    run = lambda: da.decode_attention(  # noqa: E731
        q,
        k_cache,
        v_cache,
        block_table,
        qsl,
        seq_lens,
        head_dim**-0.5,
        out,
        num_decodes=batch,
        num_splits=backend_splits,
        block_n=64 if device.type == "cuda" else 16,
    )
    run()
    expected = da.decode_attention_ref(q, k_cache, v_cache, block_table, seq_lens, head_dim**-0.5)
    seconds = timeit(run, device)
    kv_bytes = 2 * int(seq_lens.sum()) * kv_heads * head_dim * k_cache.element_size()
    results["decode_attention"] = dict(
        rel_err=_rel_err(out, expected),
        batch=batch,
        context=context,
        seconds=seconds,
        bandwidth_gbs=kv_bytes / seconds / 1e9,
    )

    # Prefill: chunked prefill over cached context, causal, GQA, and a fresh prompt.
    reqs = [(scale.prefill_context, scale.prefill_query), (0, scale.prefill_query // 2 + 3)]
    lens = torch.tensor([c + n for c, n in reqs], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, reqs[0][1], reqs[0][1] + reqs[1][1]], dtype=torch.int32, device=device)
    table = torch.arange(2 * blocks_per_seq, device=device, dtype=torch.int32).view(2, -1)
    table = table[:, : -(-int(lens.max()) // block_size)].contiguous()
    q = randn(int(qsl[-1]), heads, head_dim)
    out = torch.empty_like(q)
    tile = 64 if device.type == "cuda" else 16
    run = lambda: pa.prefill_attention(  # noqa: E731
        q,
        k_cache,
        v_cache,
        table,
        qsl,
        lens,
        head_dim**-0.5,
        out,
        num_prefills=2,
        max_query_len=reqs[0][1],
        block_m=tile,
        block_n=tile,
    )
    run()
    expected = pa.prefill_attention_ref(q, k_cache, v_cache, table, qsl, lens, head_dim**-0.5)
    seconds = timeit(run, device)
    flops = sum(4 * n * (c + n / 2) * heads * head_dim for c, n in reqs)
    results["prefill_attention"] = dict(
        rel_err=_rel_err(out, expected), seconds=seconds, tflops=flops / seconds / 1e12
    )

    rows, hidden = scale.rows, model["hidden_size"]
    slots = torch.randperm(num_blocks * block_size, device=device, generator=gen)[:rows]
    k, v = randn(rows, kv_heads, head_dim), randn(rows, kv_heads, head_dim)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kw.write_kv_cache_ref(k, v, ref_k, ref_v, slots)
    kw.write_kv_cache(k, v, k_cache, v_cache, slots)
    results["kv_cache_write"] = dict(
        exact=bool(torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)),
        seconds=timeit(lambda: kw.write_kv_cache(k, v, k_cache, v_cache, slots), device),
    )
    x, residual, weight = randn(rows, hidden), randn(rows, hidden), randn(hidden)
    got, expected = (
        rn.rms_norm(x, weight, 1e-6, residual),
        rn.rms_norm_ref(x, weight, 1e-6, residual),
    )
    results["rms_norm"] = dict(
        rel_err=_rel_err(got[0], expected[0]),
        seconds=timeit(lambda: rn.rms_norm(x, weight, 1e-6, residual), device),
    )
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    cache = build_cos_sin_cache(inv_freq, 4 * rows)
    positions = torch.randint(0, 4 * rows, (rows,), device=device, generator=gen)
    qr, kr = randn(rows, heads, head_dim), randn(rows, kv_heads, head_dim)
    expected_q, _ = ro.rotary_embedding_ref(positions, qr, kr, cache)
    ro.rotary_embedding(positions, qr, kr, cache)
    results["rotary"] = dict(
        rel_err=_rel_err(qr, expected_q),
        seconds=timeit(lambda: ro.rotary_embedding(positions, qr, kr, cache), device),
    )
    gate_up = randn(rows, 2 * model["intermediate_size"])
    results["silu_and_mul"] = dict(
        rel_err=_rel_err(sm.silu_and_mul(gate_up), sm.silu_and_mul_ref(gate_up)),
        seconds=timeit(lambda: sm.silu_and_mul(gate_up), device),
    )
    return results


def linear_shapes(model: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear layer of one decoder layer (fused qkv and gate/up)."""
    hidden, q = model["hidden_size"], model["num_attention_heads"] * model["head_dim"]
    kv = model["num_key_value_heads"] * model["head_dim"]
    return {
        "qkv_proj": (q + 2 * kv, hidden),
        "o_proj": (hidden, q),
        "gate_up_proj": (2 * model["intermediate_size"], hidden),
        "down_proj": (hidden, model["intermediate_size"]),
    }


def check_quantized(
    scale: Scale,
    device: torch.device,
    quantize: Callable[[torch.Tensor, str], tuple[torch.Tensor, torch.Tensor]],
    linear: Callable[..., torch.Tensor],
    reference: Callable[..., torch.Tensor],
    x_dtype: torch.dtype,
    bias_dtype: torch.dtype,
) -> dict:
    """A quantized linear against its reference (with a bias) at odd M on every linear layer
    of both models, and its time against bf16 F.linear without bias: TFLOP/s, weight read
    GB/s (what bounds small M) and speedup = bf16 time / quantized time."""
    import torch.nn.functional as F

    models = {"qwen3-0.6b": QWEN3_0_6B, "llama-3.2-1b": LLAMA_3_2_1B}
    if scale is DRY:
        models = {"tiny": TINY}
    gen = torch.Generator(device=device).manual_seed(0)
    results: dict = {}
    for name, model in models.items():
        for layer, (n, k) in linear_shapes(model).items():
            w = torch.randn(n, k, generator=gen, device=device) * k**-0.5
            w_q, w_scale = quantize(w, layer)
            bias = torch.randn(n, generator=gen, device=device).to(bias_dtype)
            row: dict = dict(n=n, k=k, rel_err={})
            for m in scale.linear_check_tokens:
                x = torch.randn(m, k, generator=gen, device=device).to(x_dtype)
                expected = reference(x, w_q, w_scale, bias)
                row["rel_err"][m] = _rel_err(linear(x, w_q, w_scale, bias), expected)
            w_bf16 = w.to(torch.bfloat16)
            for m in scale.linear_tokens:
                x = torch.randn(m, k, generator=gen, device=device)
                x_bf16, x_in = x.to(torch.bfloat16), x.to(x_dtype)
                bf16_s = timeit(lambda: F.linear(x_bf16, w_bf16), device)  # noqa: B023
                quant_s = timeit(lambda: linear(x_in, w_q, w_scale), device)  # noqa: B023
                flops = 2 * m * n * k
                row[f"m{m}"] = dict(
                    bf16_tflops=flops / bf16_s / 1e12,
                    tflops=flops / quant_s / 1e12,
                    bf16_weight_gbs=2 * n * k / bf16_s / 1e9,
                    weight_gbs=w_q.numel() * w_q.element_size() / quant_s / 1e9,
                    speedup=bf16_s / quant_s,
                )
            results[f"{name}/{layer}"] = row
    results["max_rel_err"] = max(err for row in results.values() for err in row["rel_err"].values())
    return results


def check_int8_linear(scale: Scale, device: torch.device, workdir: Path) -> dict:
    """W8A8 int8 (Triton) vs its reference and bf16 F.linear; also the per-token quantization
    kernel's q against the reference (GPU division and FMA may flip near-ties by 1)."""
    from engine.kernels import int8_gemm as i8
    from engine.kernels import int8_ref

    # The interpreter's bf16 is unusable (field notes): float32 activations on the dry run.
    x_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = check_quantized(
        scale,
        device,
        lambda w, layer: int8_ref.quantize_rows_int8(w),
        i8.int8_linear,
        int8_ref.int8_linear_ref,
        x_dtype,
        torch.float32,
    )
    hidden = (QWEN3_0_6B if scale is not DRY else TINY)["hidden_size"]
    x = torch.randn(max(scale.linear_tokens), hidden, device=device).to(x_dtype)
    (x_q, x_scale), (ref_q, ref_scale) = (
        i8.quantize_per_token_int8(x),
        int8_ref.quantize_rows_int8(x),
    )
    results["quantize"] = dict(
        tokens=x.shape[0],
        q_mismatches=int((x_q != ref_q).sum()),
        q_max_diff=int((x_q.int() - ref_q.int()).abs().max()),
        scale_rel_err=_rel_err(x_scale, ref_scale),
        seconds=timeit(lambda: i8.quantize_per_token_int8(x), device),
    )
    return results


def check_fp8_linear(scale: Scale, device: torch.device, workdir: Path) -> dict:
    """fp8 (torch._scaled_mm, row-wise scales) vs its reference and bf16 F.linear, where
    `fp8_supported` allows it. The dry run runs it anyway: _scaled_mm runs on CPU."""
    from engine.kernels import fp8_linear as f8

    supported, reason = f8.fp8_supported(device, torch.bfloat16)
    results: dict = dict(supported=supported, reason=reason)
    if supported or device.type == "cpu":
        dtype = torch.bfloat16
        results |= check_quantized(
            scale, device, f8.quantize_weight_fp8, f8.fp8_linear, f8.fp8_linear_ref, dtype, dtype
        )
    return results


def check_parity(scale: Scale, device: torch.device, workdir: Path) -> dict:
    """Greedy tokens of the engine (triton backend, fp32) vs HF `generate` on a tiny model."""
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams

    path = make_random_model(workdir / "tiny", TINY, device)
    prompts, _ = nano_vllm_workload(scale.parity_prompts, 4, 40, TINY["vocab_size"], seed=1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    hf.generation_config.eos_token_id = None
    expected = []
    for ids in prompts:
        out = hf.generate(
            torch.tensor([ids], device=device),
            max_new_tokens=scale.parity_tokens,
            min_new_tokens=scale.parity_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        expected.append(out[0, len(ids) :].tolist())
    llm = LLM(
        str(path),
        attention_backend="triton",
        dtype="float32",
        device=device.type,
        block_size=16,
        max_num_batched_tokens=64,
    )
    params = SamplingParams(temperature=0.0, max_tokens=scale.parity_tokens, ignore_eos=True)
    got = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    identical = sum(g == e for g, e in zip(got, expected, strict=True))
    return dict(prompts=len(prompts), identical=identical, passed=identical == len(prompts))


def check_fp8_kv(scale: Scale, device: torch.device, workdir: Path) -> dict:
    """kv_cache_dtype="fp8" (what TRITON_INTERPRET cannot check: its fp8 rounding is wrong):
    the write kernel's bytes against torch's conversion on random values, exact ties and
    out-of-range values; decode and prefill over an fp8 cache against their references (on
    the cache as stored, and on the bf16 cache it was quantized from); decode time against
    the bf16 cache; the engine's greedy tokens with fp8 against auto."""
    from engine import LLM, SamplingParams
    from engine.attention import FP8_DTYPE, FP8_MAX, quantize_kv
    from engine.kernels import decode_attention as da
    from engine.kernels import kv_cache_write as kw
    from engine.kernels import prefill_attention as pa

    model = scale.model if scale is not DRY else TINY
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads, kv_heads, head_dim = (
        model[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim")
    )
    block_size, gen = 16, torch.Generator(device=device).manual_seed(1)
    results: dict = {}

    # Write: half random (some beyond 448 after scaling), half exact midpoints of the grid.
    rows = scale.rows
    codes = torch.arange(256, dtype=torch.uint8)
    grid = codes[(codes & 0x7F) != 0x7F].view(FP8_DTYPE).float().unique()
    midpoints = ((grid[1:] + grid[:-1]) / 2).to(device)
    x = 300 * torch.randn(2 * rows * kv_heads * head_dim, generator=gen, device=device)
    x[: len(midpoints)] = midpoints
    x = x[torch.randperm(len(x), generator=gen, device=device)].view(2, rows, kv_heads, head_dim)
    num_blocks = -(-rows // block_size) + 1
    k_cache = torch.zeros(
        num_blocks, block_size, kv_heads, head_dim, dtype=FP8_DTYPE, device=device
    )
    v_cache = torch.zeros_like(k_cache)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * block_size, device=device, generator=gen)[:rows]
    k, v = (x[0] * 0.5).to(dtype), (x[1] * 2.0).to(dtype)  # power-of-two scales keep the ties
    mismatches = 0
    # Unshifted, then K stored less a per-channel shift (as calibration sets one).
    for k_shift in (None, torch.randn(kv_heads, head_dim, generator=gen, device=device)):
        kw.write_kv_cache_ref(k, v, ref_k, ref_v, slots, 0.5, 2.0, k_shift)
        kw.write_kv_cache(k, v, k_cache, v_cache, slots, 0.5, 2.0, k_shift)
        mismatches += int((k_cache.view(torch.uint8) != ref_k.view(torch.uint8)).sum())
        mismatches += int((v_cache.view(torch.uint8) != ref_v.view(torch.uint8)).sum())
    results["kv_cache_write"] = dict(exact=mismatches == 0, mismatched_bytes=mismatches)

    # Decode and prefill: a bf16 cache and its fp8 copy (scales 2 * amax / 448, as calibrated).
    batch, context = scale.decode_batch, scale.decode_context
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    k_scale = 2 * float(k_cache.abs().max()) / FP8_MAX
    v_scale = 2 * float(v_cache.abs().max()) / FP8_MAX
    k8, v8 = quantize_kv(k_cache, FP8_DTYPE, k_scale), quantize_kv(v_cache, FP8_DTYPE, v_scale)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    table = torch.randperm(num_blocks - 1, device=device, generator=gen)
    table = table.view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, head_dim, generator=gen, device=device).to(dtype)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    tile = 64 if device.type == "cuda" else 16

    def decode(kc: torch.Tensor, vc: torch.Tensor, **kv_scales: float) -> None:
        da.decode_attention(
            q, kc, vc, table, qsl, seq_lens, head_dim**-0.5, out, num_decodes=batch,
            num_splits=4 if device.type == "cuda" else 2, block_n=tile, **kv_scales,
        )  # fmt: skip

    decode(k8, v8, **scales)
    on_stored = da.decode_attention_ref(q, k8, v8, table, seq_lens, head_dim**-0.5, **scales)
    on_bf16 = da.decode_attention_ref(q, k_cache, v_cache, table, seq_lens, head_dim**-0.5)
    results["decode_attention"] = dict(
        rel_err=_rel_err(out, on_stored), rel_err_vs_bf16_cache=_rel_err(out, on_bf16)
    )
    fp8_seconds = timeit(lambda: decode(k8, v8, **scales), device)
    bf16_seconds = timeit(lambda: decode(k_cache, v_cache), device)
    kv_bytes = 2 * int(seq_lens.sum()) * kv_heads * head_dim
    results["decode_attention"].update(
        seconds=fp8_seconds,
        bf16_cache_seconds=bf16_seconds,
        speedup_vs_bf16_cache=bf16_seconds / fp8_seconds,
        bandwidth_gbs=kv_bytes / fp8_seconds / 1e9,
    )
    # Prefill over the first sequence's blocks (prefill_context + prefill_query fits in
    # decode_context at every scale).
    n = scale.prefill_query
    lens = torch.tensor([scale.prefill_context + n], dtype=torch.int32, device=device)
    prefill_table = table[:1, : -(-int(lens[0]) // block_size)].contiguous()
    qsl = torch.tensor([0, n], dtype=torch.int32, device=device)
    q = torch.randn(n, heads, head_dim, generator=gen, device=device).to(dtype)
    out = torch.empty_like(q)
    pa.prefill_attention(
        q, k8, v8, prefill_table, qsl, lens, head_dim**-0.5, out, num_prefills=1,
        max_query_len=n, block_m=tile, block_n=tile, **scales,
    )  # fmt: skip
    args = (q, k8, v8, prefill_table, qsl, lens, head_dim**-0.5)
    results["prefill_attention"] = dict(
        rel_err=_rel_err(out, pa.prefill_attention_ref(*args, **scales))
    )

    # Engine, tiny model in fp32: the triton backend's greedy tokens with an fp8 cache, and with
    # a bf16 one (the interpreter's fp32 -> bf16 stores do not round to nearest even either),
    # against the torch backend's (same quantization, torch's conversions), and against auto.
    path = workdir / "tiny-fp8"
    make_random_model(path, TINY, device)
    prompts, _ = nano_vllm_workload(scale.parity_prompts, 4, 40, TINY["vocab_size"], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=scale.parity_tokens, ignore_eos=True)
    tokens, blocks = {}, {}
    configs = [*itertools.product(("triton", "torch"), ("fp8", "bfloat16")), ("triton", "auto")]
    for backend, kv_cache_dtype in configs:
        llm = LLM(
            str(path), attention_backend=backend, dtype="float32", device=device.type,
            block_size=16, max_num_batched_tokens=64, kv_cache_dtype=kv_cache_dtype,
        )  # fmt: skip
        outputs = llm.generate(prompts, params)
        tokens[backend, kv_cache_dtype] = [r.outputs[0].token_ids for r in outputs]
        kv_cache_manager = llm.llm_engine.engine_core.scheduler.kv_cache_manager
        blocks[backend, kv_cache_dtype] = kv_cache_manager.block_pool.num_blocks
        assert kv_cache_manager.get_num_blocks_in_use() == 0
        del llm, kv_cache_manager
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def num_identical(ours: tuple[str, str], other: tuple[str, str]) -> int:
        return sum(a == b for a, b in zip(tokens[ours], tokens[other], strict=True))

    results["engine"] = dict(
        prompts=len(prompts),
        identical_to_torch_backend=num_identical(("triton", "fp8"), ("torch", "fp8")),
        identical_to_auto=num_identical(("triton", "fp8"), ("triton", "auto")),
        bf16_identical_to_torch_backend=num_identical(
            ("triton", "bfloat16"), ("torch", "bfloat16")
        ),
        blocks_auto=blocks["triton", "auto"],
        blocks_fp8=blocks["triton", "fp8"],
        blocks_bf16=blocks["triton", "bfloat16"],
    )
    results["engine"]["passed"] = results["engine"]["identical_to_torch_backend"] == len(prompts)
    results["engine"]["bf16_passed"] = results["engine"]["bf16_identical_to_torch_backend"] == len(
        prompts
    )
    return results


QUANTIZED_CONFIGS = {
    "default": {},
    "int8": {"quantization": "int8"},
    "fp8": {"quantization": "fp8"},
    "fp8_kv": {"kv_cache_dtype": "fp8"},
}


def check_quantized_engine(scale: Scale, device: torch.device, workdir: Path) -> dict:
    """The engine with int8 and fp8 weights and with an fp8 KV cache, against its default on
    a quarter of the throughput workload (outputs up to 64 tokens): output tok/s, weight
    bytes, and how many of 8 prompts keep the default's first 16 greedy tokens (random
    weights: near-ties make some differ). A configuration the GPU cannot run records why."""
    from engine import LLM, SamplingParams

    path = make_random_model(workdir / "model", scale.model, device)
    prompts, output_lens = nano_vllm_workload(
        max(scale.num_seqs // 4, 2), scale.min_len, scale.max_len, scale.model["vocab_size"]
    )
    params = [SamplingParams(temperature=0.0, max_tokens=min(n, 64), ignore_eos=True)
              for n in output_lens]  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results: dict = {}
    for name, options in QUANTIZED_CONFIGS.items():
        try:
            llm = LLM(
                str(path),
                attention_backend="triton" if device.type == "cuda" else "torch",
                device=device.type,
                max_num_seqs=256,
                max_model_len=2 * scale.max_len + 16,
                **options,
            )
        except ValueError as e:  # refused at startup: fp8 on a GPU without it, or a CPU
            results[name] = dict(skipped=str(e))
            continue
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts[:8], greedy)]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
        results[name] = dict(
            output_tok_s=num_output / seconds, weight_bytes=weight_bytes(llm), tokens=tokens
        )
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = results["default"]
    for r in results.values():
        if "tokens" in r:
            pairs = zip(r["tokens"], base["tokens"], strict=True)
            r["same_16_tokens"] = sum(a == b for a, b in pairs)
            r["tok_s_vs_default"] = r["output_tok_s"] / base["output_tok_s"]
            r["weight_bytes_vs_default"] = r["weight_bytes"] / base["weight_bytes"]
    for r in results.values():
        r.pop("tokens", None)
    return results


def check_throughput(scale: Scale, device: torch.device, workdir: Path) -> dict:
    """nano-vllm's offline workload on the engine, HF `generate` on a seeded subset, and
    decode step time at a large batch against its bandwidth limit."""
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams

    model = scale.model
    path = make_random_model(workdir / "model", model, device)
    prompts, output_lens = nano_vllm_workload(
        scale.num_seqs, scale.min_len, scale.max_len, model["vocab_size"]
    )
    llm = LLM(
        str(path),
        attention_backend="triton" if device.type == "cuda" else "torch",
        device=device.type,
        max_num_seqs=256,
        max_num_batched_tokens=16384,
        max_model_len=2 * scale.max_len + 16,
    )
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    results = dict(
        num_seqs=scale.num_seqs,
        output_tokens=num_output,
        seconds=seconds,
        output_tok_s=num_output / seconds,
    )
    results["decode_step"] = decode_step_time(llm, scale, device)
    del llm
    if device.type == "cuda":
        torch.cuda.empty_cache()

    hf_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=hf_dtype).to(device).eval()
    hf.generation_config.eos_token_id = None
    batch = [p[: scale.max_len // 2] for p in prompts[: scale.hf_batch]]
    width = max(len(p) for p in batch)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
    start = time.perf_counter()
    hf.generate(
        input_ids,
        attention_mask=mask,
        max_new_tokens=scale.hf_tokens,
        min_new_tokens=scale.hf_tokens,
        do_sample=True,
        temperature=0.6,
        pad_token_id=0,
    )
    hf_seconds = time.perf_counter() - start
    results["hf_output_tok_s"] = len(batch) * scale.hf_tokens / hf_seconds
    results["hf_batch"] = len(batch)
    results["speedup_vs_hf"] = results["output_tok_s"] / results["hf_output_tok_s"]
    return results


def decode_step_time(llm, scale: Scale, device: torch.device) -> dict:
    """Median time of pure decode steps with `step_batch` sequences of `step_context` tokens."""
    from engine import SamplingParams

    engine = llm.llm_engine
    rng = random.Random(2)
    vocab = scale.model["vocab_size"]
    for i in range(scale.step_batch):
        prompt = [rng.randrange(min(10000, vocab)) for _ in range(scale.step_context)]
        engine.add_request(f"step-{i}", prompt, SamplingParams(max_tokens=64, ignore_eos=True))
    produced: dict[str, int] = {}
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        # Once every request has its first token, steps are pure decodes of the whole batch.
        decoding = len(produced) == scale.step_batch and all(produced.values())
        for out in outputs:
            produced[out.request_id] = produced.get(out.request_id, 0) + len(
                out.outputs[0].token_ids
            )
        if decoding and len(outputs) == scale.step_batch:
            times.append(elapsed)
    step = sorted(times)[len(times) // 2] if times else float("nan")
    itemsize = 2 if device.type == "cuda" else 4
    bandwidth = copy_bandwidth(device, 1 << (30 if device.type == "cuda" else 20))
    context = [scale.step_context + 32] * scale.step_batch  # mid-run context
    limit = decode_bandwidth_limit_s(weight_bytes(llm), context, scale.model, itemsize, bandwidth)
    return dict(
        batch=scale.step_batch,
        context=scale.step_context,
        steps_timed=len(times),
        step_ms=step * 1e3,
        limit_ms=limit * 1e3,
        ratio_to_limit=step / limit,
    )


def check_spec_decode(scale: Scale, device: torch.device, workdir: Path) -> dict:
    """Speculative decoding through the triton backend (verify steps run eagerly on CUDA): a
    random model drafting for itself (`draft_model` with its own path: every draft right in
    greedy decoding, so acceptance near 1 measures the verify step's cost, not a proposer),
    single stream and batched, against the same engine without drafts; greedy tokens must
    be equal."""
    from engine import LLM, SamplingParams

    path = make_random_model(workdir / "model", scale.model, device)
    prompts, _ = nano_vllm_workload(8, scale.min_len, scale.min_len + 8, scale.model["vocab_size"])
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 4}
    results: dict = {}
    tokens = {}
    for name, options in {"plain": {}, "self_draft_k4": {"speculative_config": spec}}.items():
        llm = LLM(str(path), attention_backend="triton" if device.type == "cuda" else "torch",
                  device=device.type, max_model_len=scale.min_len + 96, **options)  # fmt: skip
        llm.generate(prompts[:1], params)  # warm-up
        row: dict = {}
        for mode, batch in (("single", prompts[:1]), ("batch8", prompts)):
            start = time.perf_counter()
            outputs = llm.generate(batch, params)
            seconds = time.perf_counter() - start
            row[f"{mode}_output_tok_s"] = (
                sum(len(o.outputs[0].token_ids) for o in outputs) / seconds
            )
            tokens[name, mode] = [o.outputs[0].token_ids for o in outputs]
        stats = llm.llm_engine.get_stats()
        if stats.spec_decode_num_draft_tokens:
            row["acceptance"] = (
                stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens
            )
        results[name] = row
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for mode in ("single", "batch8"):
        key = f"{mode}_output_tok_s"
        results[f"{mode}_speedup"] = results["self_draft_k4"][key] / results["plain"][key]
        pairs = zip(tokens["plain", mode], tokens["self_draft_k4", mode], strict=True)
        results[f"{mode}_same_tokens"] = sum(a == b for a, b in pairs)
    results["passed"] = results["single_same_tokens"] == 1 and results["batch8_same_tokens"] >= 7
    return results


SECTIONS = {
    "kernels": check_kernels,
    "int8_linear": check_int8_linear,
    "fp8_linear": check_fp8_linear,
    "parity": check_parity,
    "throughput": check_throughput,
    "fp8_kv": check_fp8_kv,
    "quantized_engine": check_quantized_engine,
    "spec_decode": check_spec_decode,
}
TARGETS = [
    (
        "decode attention / copy bandwidth (Qwen3-0.6B shapes)",
        ("kernels", "qwen3-0.6b", "decode_attention", "fraction_of_copy"),
        ">=",
        0.7,
    ),
    ("greedy parity vs HF", ("parity", "passed"), "==", True),
    ("output tok/s", ("throughput", "output_tok_s"), ">=", 20000),
    ("speedup vs HF generate", ("throughput", "speedup_vs_hf"), ">=", 25),
    ("decode step / bandwidth limit", ("throughput", "decode_step", "ratio_to_limit"), "<=", 2.0),
    ("fp8 KV write == torch's conversion", ("fp8_kv", "kv_cache_write", "exact"), "==", True),
    ("fp8 KV decode vs reference", ("fp8_kv", "decode_attention", "rel_err"), "<=", 1e-2),
    ("fp8 KV greedy tokens, triton == torch backend", ("fp8_kv", "engine", "passed"), "==", True),
    (
        "bf16 KV under fp32, triton == torch backend",
        ("fp8_kv", "engine", "bf16_passed"),
        "==",
        True,
    ),
    (
        "int8 engine weight bytes / bf16",
        ("quantized_engine", "int8", "weight_bytes_vs_default"),
        "<=",
        0.55,
    ),
    (
        "int8 engine output tok/s / bf16",
        ("quantized_engine", "int8", "tok_s_vs_default"),
        ">=",
        1.0,
    ),
    ("spec decode greedy tokens == plain (self-draft)", ("spec_decode", "passed"), "==", True),
]


def evaluate_targets(results: dict) -> list[dict]:
    """Each target with the measured value (None when its section failed) and a verdict."""
    rows = []
    for name, path, op, target in TARGETS:
        value = results
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        ok = None
        if value is not None:
            ok = {">=": value >= target, "<=": value <= target, "==": value == target}[op]
        rows.append(dict(target=name, value=value, goal=f"{op} {target}", ok=ok))
    return rows


def markdown_report(results: dict, targets: list[dict]) -> str:
    lines = ["# kvrail GPU check", "", f"device: {results['device']}", ""]
    lines += ["| target | value | goal | ok |", "|---|---|---|---|"]
    for t in targets:
        value = f"{t['value']:.4g}" if isinstance(t["value"], float) else t["value"]
        lines.append(f"| {t['target']} | {value} | {t['goal']} | {t['ok']} |")
    for section in SECTIONS:
        lines += ["", f"## {section}", "", "```", json.dumps(results.get(section), indent=1), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes and workload")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on CPU (interpreter)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated")
    args = parser.parse_args(argv)
    scale = DRY if args.dry_run else QUICK if args.quick else FULL
    device = torch.device("cpu" if args.dry_run else "cuda")
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
        torch=torch.__version__,
        mode="dry-run" if args.dry_run else "quick" if args.quick else "full",
        scale=asdict(scale),
    )
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.sections.split(","):
            start = time.perf_counter()
            try:
                results[name] = SECTIONS[name](scale, device, Path(workdir))
            except Exception as exc:  # one failing section must not hide the others
                results[name] = dict(
                    error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(limit=8)
                )
            results[name]["section_seconds"] = time.perf_counter() - start
            print(f"[gpu_check] {name}: {json.dumps(results[name])[:2000]}", flush=True)
    targets = evaluate_targets(results)
    results["targets"] = targets
    (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    report = markdown_report(results, targets)
    (out_dir / "gpu_check.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
