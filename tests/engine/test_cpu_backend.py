"""The `cpu` attention backend: its C decode and prompt kernels against the references the
Triton kernels share, the engine's tokens against the torch backend, and how `auto` picks it."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import FP8_DTYPE, default_attn_backend
from engine.kernels import cpu_build
from engine.kernels.cpu_attention import (
    MAX_DECODE_QUERY_LEN,
    paged_decode_attention,
    paged_prefill_attention,
)
from engine.kernels.decode_attention import decode_attention_ref
from engine.kernels.prefill_attention import prefill_attention_ref
from tests.engine.test_kernels import (
    E4M3_GRID,
    FP8_SCALES,
    HEAD_DIM,
    check_decode_writes_only_selected_rows,
    decode_inputs,
    paged_cache,
    prefill_inputs,
    to_fp8,
)
from tests.engine.tiny_models import make_tiny_model

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# (q and out, cache): the model dtype's own cache, and bf16 storage under a float32 model
DTYPE_PAIRS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
]


@pytest.mark.parametrize("dtype,cache_dtype", DTYPE_PAIRS)
# (32, 10, 2): a GQA group of 5, more query heads than the vector paths hold in registers.
@pytest.mark.parametrize(
    "block_size,num_heads,num_kv_heads", [(8, 4, 4), (16, 6, 2), (16, 9, 3), (32, 10, 2)]
)
# 64 and 128 have their own compiled instances; any other size takes the generic one.
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64, 128])
def test_kernel_matches_reference(
    dtype, cache_dtype, block_size, num_heads, num_kv_heads, head_dim
):
    q, k_cache, v_cache, block_table, query_start_loc, seq_lens = decode_inputs(
        block_size, num_heads, num_kv_heads, dtype, long_blocks=5, head_dim=head_dim
    )
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    expected = decode_attention_ref(q, k_cache, v_cache, block_table, seq_lens, 0.3)
    # Slots no context reaches may hold anything: NaN there must not leak into the output.
    used = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for blocks, seq_len in zip(block_table.tolist(), seq_lens.tolist(), strict=True):
        for t in range(seq_len):
            used[blocks[t // block_size], t % block_size] = True
    k_cache[~used], v_cache[~used] = float("nan"), float("nan")
    out = torch.full_like(q, float("nan"))
    every_request = torch.arange(len(seq_lens), dtype=torch.int32)
    paged_decode_attention(
        q, k_cache, v_cache, block_table, query_start_loc, seq_lens, every_request, 0.3, out
    )
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])
    assert not out[3].any(), "an empty context must give zeros, not NaN"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # q and out
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64, 128])
def test_kernel_reads_fp8_cache(dtype, head_dim):
    q, k_cache, v_cache, block_table, query_start_loc, seq_lens = decode_inputs(
        16, 6, 2, torch.float32, long_blocks=5, head_dim=head_dim
    )
    k_cache, v_cache = to_fp8(k_cache, v_cache)
    q = q.to(dtype)
    out = torch.full_like(q, float("nan"))
    every_request = torch.arange(len(seq_lens), dtype=torch.int32)
    paged_decode_attention(
        q, k_cache, v_cache, block_table, query_start_loc, seq_lens, every_request, 0.3, out,
        **FP8_SCALES,
    )  # fmt: skip
    expected = decode_attention_ref(q, k_cache, v_cache, block_table, seq_lens, 0.3, **FP8_SCALES)
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])
    assert not out[3].any(), "an empty context must give zeros, not NaN"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: AVX512-BF16's path
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])
def test_kernel_decodes_every_e4m3_value_exactly(dtype, head_dim):
    """A one-token context: softmax weight 1, so the output is the cached V row as the kernel
    decodes it, times v_scale (exact even in bf16: 0.75 times an e4m3 value has at most 5
    significant bits). Where the kernel multiplies bf16 pairs (a bf16 query, head size 64 or
    128, AVX512-BF16), the 14 subnormal values read as zero (cpu_common.h says why)."""
    num_heads = 256 // head_dim
    values = torch.cat([E4M3_GRID, torch.zeros(2)])  # the 254 finite values (incl. subnormals)
    v_cache = torch.zeros(1, 8, num_heads, head_dim, dtype=FP8_DTYPE)
    v_cache[0, 0] = values.view(num_heads, head_dim).to(FP8_DTYPE)
    k_cache = torch.zeros_like(v_cache)
    q = torch.randn(1, num_heads, head_dim, dtype=dtype)
    out = torch.empty_like(q)
    one = torch.zeros(1, dtype=torch.int32)
    paged_decode_attention(
        q, k_cache, v_cache, one.view(1, 1), torch.tensor([0, 1], dtype=torch.int32),
        one + 1, one, 1.0, out, k_scale=1.0, v_scale=0.75,
    )  # fmt: skip
    flushes = (
        dtype == torch.bfloat16 and head_dim in (64, 128)
        and {"avx512_bf16", "avx512bw"} <= cpu_build.cpu_flags()
    )  # fmt: skip
    expected = torch.where(values.abs() < 2**-6, 0.0, values) if flushes else values
    assert torch.equal(out.flatten().float(), 0.75 * expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])
@pytest.mark.parametrize("fp8", [False, True])
def test_kernel_scores_verify_steps_as_decode_steps(dtype, head_dim, fp8):
    """Requests of several queries (speculative verify steps: 1 + drafts; the most the decode
    kernel is meant for; a chunk over cached context): every query matches the causal
    reference and is bit for bit the output of its own one-query decode step, whatever else
    the call holds (1, 2 or 4 threads: items are single kv heads or whole queries)."""
    block_size, num_heads, num_kv_heads = 8, 6, 3
    query_lens = [5, 1, MAX_DECODE_QUERY_LEN, 3, 0]
    seq_lens = torch.tensor([21, 1, 9 + block_size, block_size, 4], dtype=torch.int32)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    k_cache, v_cache, block_table = paged_cache(
        seq_lens.tolist(), block_size, num_kv_heads, torch.float32, head_dim=head_dim
    )
    scales = FP8_SCALES if fp8 else {}
    k_cache, v_cache = to_fp8(k_cache, v_cache) if fp8 else (k_cache.to(dtype), v_cache.to(dtype))
    q = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype)
    every_request = torch.arange(len(query_lens), dtype=torch.int32)
    expected = prefill_attention_ref(
        q, k_cache, v_cache, block_table, query_start_loc, seq_lens, 0.3, **scales
    )
    # Each query as its own decode: context up to its position, one request per row.
    rows = [(r, i) for r, n in enumerate(query_lens) for i in range(n)]
    alone = torch.full_like(q, float("nan"))
    paged_decode_attention(
        q, k_cache, v_cache, block_table[[r for r, _ in rows]],
        torch.arange(len(rows) + 1, dtype=torch.int32),
        torch.tensor([seq_lens[r] - query_lens[r] + 1 + i for r, i in rows], dtype=torch.int32),
        torch.arange(len(rows), dtype=torch.int32), 0.3, alone, **scales,
    )  # fmt: skip
    previous = torch.get_num_threads()
    try:
        for num_threads in (1, 2, 4):
            torch.set_num_threads(num_threads)
            out = torch.full_like(q, float("nan"))
            paged_decode_attention(
                q, k_cache, v_cache, block_table, query_start_loc, seq_lens, every_request, 0.3,
                out, **scales,
            )  # fmt: skip
            torch.testing.assert_close(out.float(), expected, **TOL[dtype])
            assert torch.equal(out, alone), f"{num_threads} threads"
    finally:
        torch.set_num_threads(previous)


def test_kernel_writes_only_the_selected_requests_rows():
    check_decode_writes_only_selected_rows(paged_decode_attention)


@pytest.mark.parametrize("dtype,cache_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads", [(8, 4, 4), (16, 6, 2), (32, 9, 3)])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64, 128])
def test_prefill_kernel_matches_reference(
    dtype, cache_dtype, block_size, num_heads, num_kv_heads, head_dim
):
    """Fresh prompts longer than a tile of 16, chunks over cached context ending mid-block, an
    empty and a one-token query, a prefix hit on a block edge (`prefill_inputs`)."""
    q, k_cache, v_cache, block_table, query_start_loc, seq_lens = prefill_inputs(
        block_size, num_heads, num_kv_heads, dtype, head_dim=head_dim
    )
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    out = torch.full_like(q, float("nan"))
    every_request = torch.arange(len(seq_lens), dtype=torch.int32)
    paged_prefill_attention(
        q, k_cache, v_cache, block_table, query_start_loc, seq_lens, every_request, 0.3, out
    )
    expected = prefill_attention_ref(
        q, k_cache, v_cache, block_table, query_start_loc, seq_lens, 0.3
    )
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # q and out
def test_prefill_kernel_reads_fp8_cache_and_only_selected_rows(dtype):
    q, k_cache, v_cache, block_table, query_start_loc, seq_lens = prefill_inputs(
        16, 6, 2, torch.float32, head_dim=64
    )
    k_cache, v_cache = to_fp8(k_cache, v_cache)
    q = q.to(dtype)
    out = torch.zeros_like(q)
    selected = torch.tensor([0, 3], dtype=torch.int32)
    paged_prefill_attention(
        q, k_cache, v_cache, block_table, query_start_loc, seq_lens, selected, 0.3, out,
        **FP8_SCALES,
    )  # fmt: skip
    expected = prefill_attention_ref(
        q, k_cache, v_cache, block_table, query_start_loc, seq_lens, 0.3, **FP8_SCALES
    )
    rows = torch.zeros(q.shape[0], dtype=torch.bool)
    for r in selected.tolist():
        rows[query_start_loc[r] : query_start_loc[r + 1]] = True
    torch.testing.assert_close(out[rows].float(), expected[rows], **TOL[dtype])
    assert not out[~rows].any(), "rows of other requests must not be written"


def test_kernel_rejects_what_it_cannot_read():
    seq_lens = torch.tensor([5], dtype=torch.int32)
    k_cache, v_cache, block_table = paged_cache([5], 8, 2, torch.float32)
    q = torch.randn(1, 4, HEAD_DIM)
    args = (k_cache, v_cache, block_table, torch.tensor([0, 1], dtype=torch.int32), seq_lens)
    index = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="share one dtype"):
        paged_decode_attention(q.half(), *args, index, 1.0, torch.empty_like(q.half()))
    with pytest.raises(ValueError, match="contiguous"):
        paged_decode_attention(q.transpose(1, 2).contiguous().transpose(1, 2), *args, index,
                               1.0, torch.empty_like(q))  # fmt: skip
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, *args, index.long(), 1.0, torch.empty_like(q))
    with pytest.raises(ValueError, match="caches hold"):  # a bf16 q reads no fp32 cache
        paged_decode_attention(q.bfloat16(), *args, index, 1.0, torch.empty_like(q.bfloat16()))
    with pytest.raises(ValueError, match="caches hold"):
        paged_decode_attention(q, k_cache.bfloat16(), v_cache, *args[2:], index, 1.0,
                               torch.empty_like(q))  # fmt: skip
    # An fp8 cache takes q and out in the model dtype, both caches in fp8.
    k8, v8 = (c.to(FP8_DTYPE) for c in (k_cache, v_cache))
    fp8_args = (k8, v8, *args[2:])
    with pytest.raises(ValueError, match="share one dtype"):
        paged_decode_attention(q.to(FP8_DTYPE), *fp8_args, index, 1.0, torch.empty_like(q))
    with pytest.raises(ValueError, match="caches hold"):
        paged_decode_attention(q, k8, v_cache, *args[2:], index, 1.0, torch.empty_like(q))
    with pytest.raises(ValueError, match="share one dtype"):
        paged_decode_attention(q, *fp8_args, index, 1.0, torch.empty_like(q.bfloat16()))


def test_auto_picks_the_kernel_only_where_it_can_build(monkeypatch):
    cpu = torch.device("cpu")
    assert default_attn_backend(cpu, torch.float32, 64) == "cpu"
    assert default_attn_backend(cpu, torch.bfloat16, 128) == "cpu"
    assert default_attn_backend(cpu, torch.float16, 64) == "torch"
    assert default_attn_backend(cpu, torch.float32, 72) == "torch"  # not whole vectors of 16
    monkeypatch.setenv("CC", "no-such-compiler")
    assert default_attn_backend(cpu, torch.float32, 64) == "torch"


def test_engine_greedy_tokens_match_torch_backend(tmp_path):
    model = make_tiny_model(tmp_path / "llama", "llama", num_hidden_layers=2)
    prefix = list(range(100, 119))  # shared blocks end mid-block: prefix-cache hits
    prompts = [[*prefix, 7, 8, 9], [42], [*prefix, 300], list(range(500, 540))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # A small token budget chunks the prefills: steps mix decodes with chunked prefills.
    kwargs = dict(dtype="float32", block_size=8, max_num_batched_tokens=16)
    outputs = {}
    for backend in ("torch", "cpu"):
        llm = LLM(str(model), attention_backend=backend, **kwargs)
        assert llm.llm_engine.engine_core.model_runner.attn_backend.name == backend
        outputs[backend] = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
        assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.get_num_blocks_in_use() == 0
    assert all(len(t) == 12 for t in outputs["cpu"])
    assert outputs["cpu"] == outputs["torch"]
