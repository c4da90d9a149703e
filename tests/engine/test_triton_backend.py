"""The `triton` attention backend: same results as the `torch` backend and the reference,
and the same greedy tokens from the whole engine (fused layers included), on CPU under
TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.triton_backend import TritonAttentionBackend
from tests.engine.test_attention import (
    HEAD_DIM,
    MIXED_BATCH,
    expected_outputs,
    make_step,
    run_fp8_step,
)
from tests.engine.test_kernels import TOL
from tests.engine.tiny_models import make_tiny_model


@pytest.mark.parametrize(
    "block_size,num_heads,num_kv_heads,num_kv_splits", [(8, 4, 4, 1), (16, 8, 2, 3)]
)
def test_matches_reference_on_mixed_batch(block_size, num_heads, num_kv_heads, num_kv_splits):
    q, k, v, k_cache, v_cache, common, qs, contexts = make_step(
        MIXED_BATCH, num_heads, num_kv_heads, block_size, num_pad_tokens=3
    )
    backend = TritonAttentionBackend(num_kv_splits=num_kv_splits)
    metadata = backend.build(common)
    assert (metadata.num_decodes, metadata.num_prefills) == (5, 4)
    out = backend.forward(q, k, v, k_cache, v_cache, metadata, HEAD_DIM**-0.5)

    n = common.num_actual_tokens
    expected = expected_outputs(qs, contexts, HEAD_DIM**-0.5)
    torch.testing.assert_close(out[:n], expected, atol=1e-5, rtol=1e-5)
    assert not out[n:].any(), "padding rows must stay zero"
    flat_k = k_cache.view(-1, num_kv_heads, HEAD_DIM)
    torch.testing.assert_close(flat_k[common.slot_mapping], k[:n])


def test_padded_decode_batch_as_cuda_graphs_replay_it():
    # An all-decode batch padded to a graph bucket: pad rows have slot -1 and seq_len 0.
    reqs = [(20, 1), (7, 1)]
    q, k, v, k_cache, v_cache, common, qs, contexts = make_step(reqs, 4, 2, 8, num_pad_tokens=2)
    common.query_start_loc = common.query_start_loc_cpu = torch.arange(5, dtype=torch.int32)
    common.seq_lens = common.seq_lens_cpu = torch.cat([common.seq_lens, torch.zeros(2).int()])
    common.block_table = torch.cat([common.block_table, torch.zeros_like(common.block_table)])
    common.slot_mapping = torch.cat([common.slot_mapping, torch.tensor([-1, -1])])
    common.num_reqs = common.num_actual_tokens = 4
    backend = TritonAttentionBackend(num_kv_splits=2)
    metadata = backend.build(common)
    assert metadata.decode_req_indices is None and metadata.num_prefills == 0
    k_cache_before = k_cache.clone()
    out = backend.forward(q, k, v, k_cache, v_cache, metadata, 0.25)
    torch.testing.assert_close(out[:2], expected_outputs(qs, contexts, 0.25), atol=1e-5, rtol=1e-5)
    assert not out[2:].any(), "padded rows must come back as zeros"
    changed = (k_cache != k_cache_before).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == sorted({int(s) // 8 for s in common.slot_mapping[:2]})


# fp16, not bf16: the interpreter's bf16 tl.dot is wrong (the bf16 path is checked on a GPU).
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_cache_matches_reference_on_what_was_stored(dtype):
    """The interpreter stores some values wrongly (see kv_cache_write.py), but the attention
    kernels must read back exactly what the cache holds. Against the float cache: on a GPU,
    in benchmarks/gpu_check.py."""
    step = run_fp8_step(TritonAttentionBackend(num_kv_splits=2), dtype, k_offset=4.0)
    torch.testing.assert_close(step.out, step.on_stored, **TOL[dtype])
    assert not step.padding.any(), "padding rows must stay zero"


PROMPT_PREFIX = list(range(100, 119))  # 19 tokens: shared blocks end mid-block
PROMPTS = [
    [*PROMPT_PREFIX, 7, 8, 9],
    [42],
    [*PROMPT_PREFIX, 300],
    list(range(500, 509)),
]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    # Qwen3 has q/k norms, so the fused RMSNorm runs on 3-d inputs too.
    return make_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3", num_hidden_layers=2)


def test_engine_greedy_tokens_match_torch_backend(tiny_qwen3):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    # A small token budget chunks the prefills, so steps mix decodes with chunked prefills,
    # and the shared prefix hits the prefix cache.
    kwargs = dict(dtype="float32", block_size=8, max_num_batched_tokens=16)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_qwen3), attention_backend=backend, **kwargs)
        assert llm.llm_engine.engine_core.model_runner.attn_backend.name == backend
        results = llm.generate(PROMPTS, params)
        outputs[backend] = [r.outputs[0].token_ids for r in results]
        assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.get_num_blocks_in_use() == 0
        if backend == "triton":
            assert results[2].num_cached_tokens > 0, "the shared prefix must hit the cache"
    assert all(len(t) == 5 for t in outputs["torch"])
    assert outputs["triton"] == outputs["torch"]
