"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) running on one flat token batch.

Inputs are `[T]` token ids and positions of all scheduled tokens of all requests, back to back;
attention reads the step's metadata from the forward context and the paged KV cache bound by
the model runner. q/k/v and gate/up are fused into one matmul each at load time. Linear
layers store and multiply their weights as their `LinearMethod` says (unquantized, or the
quantized methods of `engine/quantization.py`). With the `triton` attention backend, RMSNorm
(+ residual add), rotary embedding and SiLU-and-multiply run as fused Triton kernels, with
the `cpu` backend as C kernels (`engine/kernels/`, `ModelKernels`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.attention import AttentionBackend, KVCacheSpec, get_forward_context
from engine.models.layers import Linear, LinearMethod, ModelKernels, VocabEmbedding

# Applies rotary embedding to (q, k) for the step's positions; built once per step.
RopeFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def build_cos_sin_cache(
    inv_freq: torch.Tensor, max_position: int, scaling: float = 1.0
) -> torch.Tensor:
    """`[max_position, 2 * len(inv_freq)]` fp32: cos then sin of `position * inv_freq`."""
    positions = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
    freqs = positions[:, None] * inv_freq.float()[None, :]
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, kernels: ModelKernels | None) -> None:
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize `x`; with `residual`, first add it and also return the sum (next residual)."""
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        # fp32 statistics as HF does, so bf16 runs round the same way.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(x.dtype)
        return out if residual is None else (out, residual)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding; `inv_freq` comes from HF so every rope type HF knows matches."""

    def __init__(self, config: PretrainedConfig, kernels: ModelKernels | None) -> None:
        super().__init__()
        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            head_dim = head_dim_of(config)
            theta = config.rope_parameters["rope_theta"]
            inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
            attention_scaling = 1.0
        else:
            inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device="cpu")
        self.attention_scaling = attention_scaling
        # Kept fp32 whatever the model dtype: positions times frequencies need the precision.
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.kernels = kernels
        if kernels is not None:
            cache = build_cos_sin_cache(
                self.inv_freq, config.max_position_embeddings, attention_scaling
            )
            self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[T, head_dim]` for `positions [T]`, computed once per step for all layers."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeFn:
        """What every layer applies to its (q, k) this step; cos/sin are computed once."""
        if self.kernels is not None:
            rotary = self.kernels.rotary_embedding
            return lambda q, k: rotary(positions, q, k, self.cos_sin_cache)
        cos, sin = self(positions, dtype)
        return lambda q, k: (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[T, heads, head_dim]`, cos/sin `[T, head_dim]`."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        attn_backend: AttentionBackend,
        arch: ArchTraits,
        method: LinearMethod,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, arch.qkv_bias, method
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, arch.o_bias, method)
        kernels, eps = method.kernels, config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, kernels) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, kernels) if arch.qk_norm else None
        self.attn_backend = attn_backend
        # Bound by the model runner (bind_kv_cache); not parameters or buffers.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # An fp8 cache's per-layer scales and K's per-channel mean (fp32 [num_kv_heads,
        # head_dim]), calibrated by the model runner; 1.0 and None otherwise.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.k_shift: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor, rope: RopeFn) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj(hidden_states).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1
        )
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, k)
        metadata = get_forward_context().attn_metadata
        out = self.attn_backend.forward(
            q, k, v, self.k_cache, self.v_cache, metadata, self.scale,
            self.k_scale, self.v_scale, self.k_shift,
        )  # fmt: skip
        return self.o_proj(out.view(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, bias: bool, method: LinearMethod) -> None:
        super().__init__()
        hidden, intermediate = config.hidden_size, config.intermediate_size
        # SiLU-and-multiply belongs to gate_up: kernels that can fuse it into the matmul do.
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias, method, "silu_and_mul")
        self.down_proj = Linear(intermediate, hidden, bias, method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        attn_backend: AttentionBackend,
        arch: ArchTraits,
        method: LinearMethod,
    ) -> None:
        super().__init__()
        kernels, hidden, eps = method.kernels, config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, attn_backend, arch, method)
        self.mlp = LlamaMLP(config, arch.mlp_bias, method)
        self.input_layernorm = RMSNorm(hidden, eps, kernels)
        self.post_attention_layernorm = RMSNorm(hidden, eps, kernels)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeFn,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, rope)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        attn_backend: AttentionBackend,
        arch: ArchTraits,
        method: LinearMethod,
    ) -> None:
        super().__init__()
        kernels = method.kernels
        self.dtype = torch.get_default_dtype()  # activations; weights may be quantized
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, kernels)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attn_backend, arch, method)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.rotary_emb = RotaryEmbedding(config, kernels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids, self.dtype)
        rope = self.rotary_emb.for_step(positions, hidden_states.dtype)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, rope)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class ArchTraits:
    """What distinguishes the supported architectures inside the shared Llama skeleton."""

    def __init__(self, config: PretrainedConfig, architecture: str) -> None:
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_bias = {"Qwen2ForCausalLM": True, "MistralForCausalLM": False}.get(
            architecture, attention_bias
        )
        self.o_bias = attention_bias and architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM")
        self.mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.qk_norm = architecture == "Qwen3ForCausalLM"


SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# HF projection name -> (fused parameter, shard) inside the same module.
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
_SHARDS_OF = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, config: PretrainedConfig, attn_backend: AttentionBackend, method: LinearMethod
    ) -> None:
        super().__init__()
        architecture = (config.architectures or ["LlamaForCausalLM"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architecture!r}; supported: {SUPPORTED_ARCHITECTURES}"
            )
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only 'silu'")
        self.config = config
        self.model = LlamaModel(config, attn_backend, ArchTraits(config, architecture), method)
        self.lm_head = Linear(
            config.hidden_size, config.vocab_size, False, method, computes_logits=True
        )
        self.tie_word_embeddings = bool(config.tie_word_embeddings)
        if self.tie_word_embeddings:
            self.model.embed_tokens.tie_to(self.lm_head)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`input_ids`, `positions` `[T]` -> final hidden states `[T, hidden]`.

        Run inside `set_forward_context(...)`; writes this step's k/v into the bound caches.
        """
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[N, hidden]` (the rows to sample from) -> `[N, vocab]` logits in the model's dtype,
        or in float32 where the C float kernel computes them (`Linear.computes_logits`): the sampler
        takes float32 where it computes with them (as vLLM's does), and a greedy argmax needs
        no copy (128 x 49,152 bf16 logits to float32: 1.1 ms of a CPU decode step)."""
        return self.lm_head(hidden_states)

    def get_kv_cache_spec(self) -> KVCacheSpec:
        attn = self.model.layers[0].self_attn
        return KVCacheSpec(
            num_layers=len(self.model.layers),
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            dtype=self.model.dtype,
        )

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Point each layer at its `(k_cache, v_cache)`, allocated by the model runner.

        Each is `[num_blocks, block_size, num_kv_heads, head_dim]` and must start zeroed
        (see `KVCacheSpec.allocate`).
        """
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"need {len(self.model.layers)} layer caches, got {len(kv_caches)}")
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches, strict=True):
            attn = layer.self_attn
            if k_cache.shape[2:] != (attn.num_kv_heads, attn.head_dim):
                raise ValueError(f"kv cache shape {tuple(k_cache.shape)} does not fit the model")
            attn.k_cache, attn.v_cache = k_cache, v_cache

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters; raise if any is missing."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, str | None]] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (
                self.tie_word_embeddings and name == "lm_head.weight"
            ):
                continue
            param_name, shard = _fused_name(name)
            if param_name not in params:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            target = self._shard(params[param_name], shard)
            if target.shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add((param_name, shard))
        required = {
            (name, shard)
            for name in params
            for shard in _SHARDS_OF.get(name.split(".")[-2], (None,))
        }
        missing = sorted(f"{name}[{shard}]" if shard else name for name, shard in required - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s): {missing[:8]}")

    def process_weights(self) -> None:
        """Once every weight is loaded: each linear layer takes its runtime form."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.method.process_weights(module)
        if self.tie_word_embeddings and self.lm_head.weight is None:
            self.model.embed_tokens.weight = None  # the head's rows serve it (packed)

    def _shard(self, param: torch.Tensor, shard: str | None) -> torch.Tensor:
        """The slice of a (fused) parameter that one checkpoint tensor fills."""
        if shard is None:
            return param.data
        if shard in _SHARDS_OF["gate_up_proj"]:
            return param.data.chunk(2, dim=0)[_SHARDS_OF["gate_up_proj"].index(shard)]
        attn = self.model.layers[0].self_attn
        start = {"q": 0, "k": attn.q_size, "v": attn.q_size + attn.kv_size}[shard]
        size = attn.q_size if shard == "q" else attn.kv_size
        return param.data.narrow(0, start, size)


def _fused_name(name: str) -> tuple[str, str | None]:
    for hf_proj, (fused_proj, shard) in _FUSED_SHARDS.items():
        if f".{hf_proj}." in name:
            return name.replace(f".{hf_proj}.", f".{fused_proj}."), shard
    return name, None


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
