"""Builders for small random-weight models that share SmolLM2's tokenizer (not a test file).

Weights are drawn with a large `initializer_range` and the final norm is scaled up, so logits
are peaky: greedy decoding then has few near-ties (measured: top-1/top-2 gaps above 4e-4 on
16 chat prompts x 32 tokens, no prompt collapsing to one repeated token), and engine-vs-HF
token comparisons are meaningful rather than flaky.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from engine.attention import CommonAttentionMetadata, get_attn_backend, set_forward_context
from engine.loader import resolve_model
from engine.models.llama import LlamaForCausalLM

CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
}

TINY_DEFAULTS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=49152,  # SmolLM2's, so its tokenizer and chat template fit
    max_position_embeddings=2048,
    initializer_range=0.3,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
# Kvrail has no sliding-window attention; the tiny Mistral attends fully, like the others.
ARCH_DEFAULTS: dict[str, dict[str, object]] = {"mistral": {"sliding_window": None}}
FINAL_NORM_SCALE = 4.0
BLOCK_SIZE = 8


def smollm2_dir() -> Path:
    """The converted SmolLM2 folder (weights and tokenizer); converted once, then cached."""
    return resolve_model(None)


def make_tiny_model(path: Path, arch: str, seed: int = 0, **overrides: object) -> Path:
    """Save a random-weight `arch` model (fp32 safetensors) plus SmolLM2's tokenizer to `path`."""
    config = CONFIG_CLASSES[arch](**{**TINY_DEFAULTS, **ARCH_DEFAULTS.get(arch, {}), **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # HF initializes norms to ones and biases to zeros: randomize them so a misplaced
        # norm weight or bias shard changes the logits.
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.normal_(1.0 if "norm" in name else 0.0, 0.1)
        # A larger final norm scales every logit: wider top-1/top-2 gaps, fewer greedy ties.
        model.model.norm.weight.mul_(FINAL_NORM_SCALE)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(smollm2_dir()).save_pretrained(path)
    return path


def run_model_steps(
    model: LlamaForCausalLM, token_ids: list[list[int]], schedule: list[list[int]]
) -> list[torch.Tensor]:
    """Run `schedule` (per step, tokens scheduled per request; 0 = idle) on the engine model.

    Returns each request's logits for every token it was fed, in order.
    """
    backend = get_attn_backend("torch")
    spec = model.get_kv_cache_spec()
    max_blocks = max(-(-len(t) // BLOCK_SIZE) for t in token_ids)
    num_blocks = len(token_ids) * max_blocks + 1
    model.bind_kv_cache(spec.allocate(num_blocks, BLOCK_SIZE, "cpu"))
    # Scattered, interleaved block ids: nothing may rely on a request's blocks being adjacent.
    block_table = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(0))
    block_table = block_table[: len(token_ids) * max_blocks].view(max_blocks, -1).T.int()
    num_computed = [0] * len(token_ids)
    logits: list[list[torch.Tensor]] = [[] for _ in token_ids]
    for step in schedule:
        reqs = [r for r, n in enumerate(step) if n]
        positions = torch.cat(
            [torch.arange(num_computed[r], num_computed[r] + step[r]) for r in reqs]
        )
        input_ids = torch.cat(
            [torch.tensor(token_ids[r])[num_computed[r] :][: step[r]] for r in reqs]
        )
        slot_mapping = torch.cat(
            [
                block_table[r].long()[positions_r // BLOCK_SIZE] * BLOCK_SIZE
                + positions_r % BLOCK_SIZE
                for r in reqs
                for positions_r in [torch.arange(num_computed[r], num_computed[r] + step[r])]
            ]
        )
        query_lens = torch.tensor([step[r] for r in reqs], dtype=torch.int32)
        seq_lens = torch.tensor([num_computed[r] + step[r] for r in reqs], dtype=torch.int32)
        query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int32), query_lens.cumsum(0)])
        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc.int(),
            query_start_loc_cpu=query_start_loc.int(),
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens,
            block_table=block_table[reqs],
            slot_mapping=slot_mapping,
            num_reqs=len(reqs),
            num_actual_tokens=len(input_ids),
            max_query_len=int(query_lens.max()),
            block_size=BLOCK_SIZE,
        )
        with torch.inference_mode(), set_forward_context(backend.build(common)):
            step_logits = model.compute_logits(model(input_ids, positions))
        for r, chunk in zip(reqs, step_logits.split(query_lens.tolist()), strict=True):
            logits[r].append(chunk)
            num_computed[r] += step[r]
    return [torch.cat(chunks) for chunks in logits]


def make_chain_model(
    path: Path, arch: str, seed: int = 0, layer_scale: float = 0.01, cycle_length: int = 0
) -> Path:
    """A tiny model whose greedy choices have wide margins, for comparing quantized runs.

    Random models put the top two of 49152 logits within a few percent of each other, and
    W8A8 moves logits by about that much (measured: 3.7-9% of their spread on the models of
    `make_tiny_model`), so greedy tokens of an exact and a quantized run part within a few
    steps whatever the implementation. Here the LM head is the embedding with its rows
    permuted, and attention and MLP outputs are scaled by `layer_scale`: the last hidden state
    is close to the current token's embedding, whose dot product with itself stands far above
    every other row's, so the next token is perm^-1(current) by a wide margin, while every
    layer still moves the logits (by about `layer_scale`; 0.03 already lets context override
    the chain).

    With `cycle_length`, the permutation is made of cycles of that many tokens, so greedy
    text repeats itself with that period: what n-gram speculation feeds on.
    """
    make_tiny_model(path, arch, seed=seed, tie_word_embeddings=False)
    weights = load_file(path / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    perm = torch.randperm(embed.shape[0], generator=torch.Generator().manual_seed(seed))
    if cycle_length:
        # Each run of `cycle_length` shuffled tokens maps to its next, the last to the first.
        cycles = perm[: len(perm) // cycle_length * cycle_length].view(-1, cycle_length)
        perm = perm.clone()
        perm[cycles] = cycles.roll(1, dims=1)
    weights["lm_head.weight"] = embed[perm].contiguous()
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * layer_scale
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path
