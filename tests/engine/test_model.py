from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from engine.attention import get_attn_backend
from engine.loader import load_model
from engine.models.layers import LinearMethod
from tests.engine.tiny_models import make_tiny_model, run_model_steps

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CASES = {
    "llama": ("llama", {}),
    "llama3-rope-untied": ("llama", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": False}),
    "qwen2-untied": ("qwen2", {"tie_word_embeddings": False}),
    "qwen3": ("qwen3", {}),
    "qwen3-bias": ("qwen3", {"attention_bias": True}),
    "mistral": ("mistral", {"num_key_value_heads": 1}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(tmp_path, case):
    arch, overrides = CASES[case]
    model_dir = make_tiny_model(tmp_path / case, arch, **overrides)
    model, config = load_model(
        model_dir,
        torch.float32,
        torch.device("cpu"),
        get_attn_backend("torch"),
        LinearMethod(None, torch.float32),
    )
    gen = torch.Generator().manual_seed(1)
    token_ids = [
        torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (25, 11)
    ]
    # Request 0: a 21-token prompt in three chunks (chunked prefill over cached context,
    # chunks ending mid-block), then decodes; request 1 prefills, then decodes alongside.
    schedule = [[8, 0], [5, 7], [8, 1], [1, 1], [1, 1], [1, 1], [1, 0]]
    engine_logits = run_model_steps(model, token_ids, schedule)

    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for ids, logits in zip(token_ids, engine_logits, strict=True):
        with torch.inference_mode():
            expected = hf_model(torch.tensor([ids])).logits[0]
        assert logits.dtype == torch.float32 and logits.shape == expected.shape
        # fp32 both, summed in different orders (oneDNN picks its kernels per CPU): measured
        # up to 1.06e-4 on an AMX Xeon, on logits of std > 1; a wrong op is off by 1e-2 or more.
        torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)
        assert logits.std() > 1.0, "tiny models must have peaky logits"


def test_fused_weights_and_tying(tmp_path):
    model_dir = make_tiny_model(tmp_path / "qwen2", "qwen2")
    model, _ = load_model(
        model_dir,
        torch.float32,
        torch.device("cpu"),
        get_attn_backend("torch"),
        LinearMethod(None, torch.float32),
    )
    weights = load_file(model_dir / "model.safetensors")
    attn = model.model.layers[1].self_attn
    torch.testing.assert_close(
        attn.qkv_proj.bias[attn.q_size :][: attn.kv_size],
        weights["model.layers.1.self_attn.k_proj.bias"],
        rtol=0,
        atol=0,
    )
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert "lm_head.weight" not in weights


@pytest.mark.skipif(
    not torch.cpu._is_avx512_bf16_supported(), reason="the packed bf16 kernel needs AVX512-BF16"
)
@pytest.mark.parametrize("case", ["llama", "qwen3-bias"])
def test_packed_bf16_weights_as_accurate_as_torch_matmul(tmp_path, monkeypatch, case):
    """bf16 weights packed for the C kernel (what a CPU with AVX512-BF16 runs, AMX or not),
    against the same model multiplied by torch's matmul, both against HF in fp32: a tied
    embedding reads the packed head's rows, and the packed model is off by no more than the
    other (measured on the tiny llama: mean |error| 0.26 and 0.27 on logits of std 9.6,
    greedy agreement 0.84 both; a wrong weight or bias puts it near the logits' std)."""
    import engine.models.layers as layers
    from engine.models.layers import model_kernels

    arch, overrides = CASES[case]
    model_dir = make_tiny_model(tmp_path / case, arch, **overrides)
    gen = torch.Generator().manual_seed(1)
    token_ids = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (25, 11)]
    schedule = [[8, 0], [5, 7], [8, 1], [1, 1], [1, 1], [1, 1], [1, 0]]
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.cat([hf_model(torch.tensor([ids])).logits[0] for ids in token_ids])
    errors, agreement = {}, {}
    for packed in (True, False):
        monkeypatch.setattr(layers, "packs_bf16", lambda dtype, packed=packed: packed)
        method = LinearMethod(model_kernels("cpu"), torch.bfloat16)
        method.cpu_float_max_tokens = 0  # unpacked: torch's matmul at every size
        model, _ = load_model(
            model_dir, torch.bfloat16, torch.device("cpu"), get_attn_backend("torch"), method
        )
        model.process_weights()
        layer = model.model.layers[0].mlp.gate_up_proj
        assert (layer.weight is None) == packed and (model.lm_head.weight is None) == packed
        tied = model.tie_word_embeddings
        assert (model.model.embed_tokens.weight is None) == (packed and tied)
        logits = torch.cat(run_model_steps(model, token_ids, schedule)).float()
        errors[packed] = (logits - expected).abs().mean().item()
        agreement[packed] = (logits.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert errors[True] <= 1.25 * errors[False] and errors[True] < 0.1 * expected.std().item()
    assert agreement[True] >= agreement[False] - 0.1


def test_load_weights_rejects_missing_and_unexpected(tmp_path):
    model_dir = make_tiny_model(tmp_path / "llama", "llama", num_hidden_layers=2)
    model, _ = load_model(
        model_dir,
        torch.float32,
        torch.device("cpu"),
        get_attn_backend("torch"),
        LinearMethod(None, torch.float32),
    )
    weights = load_file(model_dir / "model.safetensors")
    partial = {k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.mlp\.gate_up_proj\.weight\[up\]"):
        model.load_weights(partial.items())
    with pytest.raises(ValueError, match="unexpected weight"):
        model.load_weights(
            [*weights.items(), ("model.layers.0.self_attn.x_proj.weight", torch.zeros(1))]
        )
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.norm.weight", torch.zeros(3))])
