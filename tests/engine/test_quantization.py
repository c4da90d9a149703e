"""`LLM(quantization="int8")`: SmoothQuant's folding is exact, W8A8 stays close to the float
model and keeps its greedy tokens where they have a margin, quantized weights are cached,
and options that cannot run are refused at startup."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import LLM, SamplingParams, quantization
from engine.models.layers import Linear
from tests.engine.tiny_models import make_chain_model, make_tiny_model

ARCHS = {
    "llama": {},
    "qwen2": {},  # qkv bias: smoothing o_proj scales v's bias too
    "qwen3": {},  # q/k norms
    "mistral": {"num_key_value_heads": 1},  # one kv head for every query head
}
PROMPT = list(range(1000, 1064))


def _llm(model, **kwargs) -> LLM:
    return LLM(str(model), dtype="float32", block_size=8, **kwargs)


def _prefill_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    runner = llm.llm_engine.engine_core.model_runner
    with torch.inference_mode():
        hidden_states, _ = runner._prefill_forward(token_ids, runner.dtype)
        return runner.model.compute_logits(hidden_states)


def _assert_pool_free(llm: LLM) -> None:
    assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.get_num_blocks_in_use() == 0


@pytest.mark.parametrize("arch", list(ARCHS))
def test_smoothing_keeps_the_float_model_exact(tmp_path, arch):
    llm = _llm(make_tiny_model(tmp_path / arch, arch, **ARCHS[arch]))
    model = llm.llm_engine.engine_core.model_runner.model
    expected = _prefill_logits(llm, PROMPT)
    act_amax: dict[Linear, torch.Tensor] = {}

    def record(layer, inputs):
        act_amax[layer] = inputs[0].abs().amax(dim=0).float()

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, Linear)]
    _prefill_logits(llm, PROMPT)
    for hook in hooks:
        hook.remove()
    embedding = model.model.embed_tokens.weight.detach().clone()
    quantization.smooth(model, act_amax)
    # Tied: the head's rows are scaled now; quantization reads them back through
    # embed_col_scale. Undo that here to look at the layers alone.
    assert torch.allclose(model.lm_head.weight * model.lm_head.embed_col_scale, embedding)
    model.model.embed_tokens.weight = torch.nn.Parameter(embedding)
    torch.testing.assert_close(_prefill_logits(llm, PROMPT), expected, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_int8_logits_stay_close_to_float(tmp_path, arch):
    """Every layer in W8A8 against the float model, over one 64-token prefill. Measured on
    these (chaotic, random-weight) models: 5.6-13% relative error in the logits; a wrong scale,
    offset or smoothing factor anywhere gives errors of order 100%."""
    model = make_tiny_model(tmp_path / arch, arch, **ARCHS[arch])
    expected = _prefill_logits(_llm(model), PROMPT)
    llm = _llm(model, quantization="int8")
    logits = _prefill_logits(llm, PROMPT)
    assert (logits - expected).norm() / expected.norm() < 0.25
    assert llm.llm_engine.engine_core.model_runner.model.lm_head.weight is None


@pytest.mark.parametrize("arch", list(ARCHS))
def test_int8_greedy_tokens_match_float(tmp_path, arch):
    """The first 8 greedy tokens of every prompt match the float model's (16 generated).
    Tolerance: on random models W8A8 moves logits by more than the gap between the top two
    (see `make_chain_model`), so these models have a wide margin by construction; every
    layer still shifts their logits by about 1%, and a broken layer (a wrong scale of 10x)
    turns the chain off."""
    model = make_chain_model(tmp_path / arch, arch)
    prompts = [[1, 9225, 28, 30], list(range(100, 140)), [42], list(range(500, 517)), [7] * 9]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = {}
    for method in (None, "int8"):
        llm = _llm(model, quantization=method)
        outputs[method] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        _assert_pool_free(llm)
    for exact, quantized in zip(outputs[None], outputs["int8"], strict=True):
        assert len(set(exact)) == 16, "the chain visits a new token each step"
        assert quantized[:8] == exact[:8]


def test_quantized_weights_are_cached(tmp_path, monkeypatch, caplog):
    # The tiny model first: it copies SmolLM2's tokenizer from the real cache, where a cache
    # of its own would convert the GGUF again (20 s).
    model = make_tiny_model(tmp_path / "llama", "llama")
    monkeypatch.setenv("KVRAIL_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real = quantization.quantize_model
    monkeypatch.setattr(
        quantization, "quantize_model", lambda *a: calls.append(1) or real(*a)
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = _llm(model, quantization="int8")
    tokens = first.generate([PROMPT], params)[0].outputs[0].token_ids
    assert len(calls) == 1
    with caplog.at_level(logging.INFO, logger="kvrail.loader"):
        second = _llm(model, quantization="int8")
    assert len(calls) == 1, "the second engine loads the cached quantized weights"
    assert str(tmp_path / "cache" / "quantized") in caplog.text
    assert second.generate([PROMPT], params)[0].outputs[0].token_ids == tokens
    _assert_pool_free(second)


def test_cache_key_follows_source_method_and_calibration(tmp_path, monkeypatch):
    model = make_tiny_model(tmp_path / "llama", "llama", num_hidden_layers=1)
    monkeypatch.setenv("KVRAIL_CACHE_DIR", str(tmp_path / "cache"))
    key = quantization.cache_dir(model, "int8", [1, 2, 3])
    assert key == quantization.cache_dir(model, "int8", [1, 2, 3])
    assert key != quantization.cache_dir(model, "fp8", [1, 2, 3])
    assert key != quantization.cache_dir(model, "int8", [1, 2, 4])
    (model / "model.safetensors").touch()  # rewritten weights are quantized again
    assert key != quantization.cache_dir(model, "int8", [1, 2, 3])


def test_options_that_cannot_run_are_refused_at_startup(tmp_path):
    model = make_tiny_model(tmp_path / "llama", "llama", num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"quantization must be None or one of \('int8', 'fp8'\)"):
        _llm(model, quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        _llm(model, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match=r"compute capability 8\.9.*use quantization='int8'"):
        _llm(model, quantization="fp8")


@pytest.mark.parametrize("method", [None, "int8"])
def test_cpu_graphs_replay_what_eager_steps_compute(tmp_path, method):
    """Decode steps of up to 8 requests replay CPU graphs; the tokens must equal eager runs'."""
    model = make_tiny_model(tmp_path / "qwen3", "qwen3")
    prompts = [[1, 2, 3], list(range(40, 61)), [9] * 17]  # batches of 3, then 2, then 1
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 8, 4)]
    outputs = {}
    for eager in (True, False):
        llm = _llm(model, quantization=method, enforce_eager=eager)
        graphs = llm.llm_engine.engine_core.model_runner.decode_graphs
        assert (graphs is None) == eager
        outputs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        _assert_pool_free(llm)
    assert outputs[False] == outputs[True]
