"""Quantized linear layers: W8A8 int8 with SmoothQuant, and the cache of quantized weights.

W8A8 (`quantization="int8"`): every linear layer (qkv, o, gate_up, down and the LM head) holds
symmetric per-output-channel int8 weights; activations are quantized per token when the layer
runs (scale = max|x| / 127), the product accumulates in int32 and both scales apply in the
epilogue. On the CPU that is `engine/kernels/cpu_linear.c` (AVX512-VNNI where present), on
CUDA a Triton GEMM (`engine/kernels/int8_gemm.py`).

Plain W8A8 raised SmolLM2-135M's perplexity on pydoc_data.topics by 4.4% (3.4% with the LM
head left in float): a few activation channels are far larger than the rest, and one scale
per token spends int8's range on them. SmoothQuant (Xiao et al., 2022) moves that range into
the weights: per input channel j of a layer, s_j = max|X_j|^a / max|W_j|^(1 - a) with a = 0.5;
the layer multiplies W by s and the op before it divides its output by s, exactly (an
RMSNorm's weight for qkv, gate_up and the LM head; v's rows of qkv for o_proj, repeated over
each GQA group; up's rows of gate_up for down_proj, since SiLU(gate) * up is linear in up).
Measured the same way: 1.011x with every layer in int8 (a = 0.3: 1.023x, a = 0.7: 1.021x).
max|X_j| comes from one forward over `engine.calibration`'s text in float32.

Weights are quantized from float32 at load (the method loads the checkpoint in float32, not
in the model dtype, so there is one rounding, not two) and the result is cached under
`KVRAIL_CACHE_DIR/quantized/`, keyed by the source files, the method and the calibration.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine import envs
from engine.kernels.int8_ref import quantize_rows_int8
from engine.models.layers import ALL_TOKENS, Linear, LinearMethod, ModelKernels

logger = logging.getLogger("kvrail.quantization")

SMOOTHQUANT_ALPHA = 0.5
FORMAT_VERSION = 1  # of the cached files; bump when what they hold changes


class QuantizedLinearMethod(LinearMethod):
    """Weights quantized per output channel from float32, activations per token. States of a
    layer: loaded (float32 `weight`), quantized (`weight_q` `[N, K]` and `weight_scale` `[N]`
    float32 buffers: portable, what the cache holds), processed (ready for the kernel)."""

    load_dtype = torch.float32
    weight_dtype: torch.dtype

    def __init__(
        self, kernels: ModelKernels | None, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__(kernels, dtype)
        self.device = device
        self.packs_bf16 = False  # weights take this method's own format

    def quantize_rows(self, weight: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def quantize(self, layer: Linear, name: str) -> None:
        weight_q, weight_scale = self.quantize_rows(layer.weight.detach(), name)
        self.prepare_quantized(layer)
        layer.weight_q.copy_(weight_q)
        layer.weight_scale.copy_(weight_scale)

    def prepare_quantized(self, layer: Linear) -> None:
        """Swap the float weight for (empty) quantized buffers, to be filled."""
        shape = (layer.out_features, layer.in_features)
        layer.weight = None
        weight_q = torch.empty(shape, dtype=self.weight_dtype, device=self.device)
        layer.register_buffer("weight_q", weight_q)
        layer.register_buffer(
            "weight_scale", torch.empty(shape[0], dtype=torch.float32, device=self.device)
        )

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.weight is not None:  # the calibration forward, before quantization
            y = torch.nn.functional.linear(x.float(), layer.weight, layer.bias).to(x.dtype)
            return self.activate(layer, y)
        return self.apply_quantized(layer, x)

    def apply_quantized(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def embed(self, layer: Linear, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows of a tied LM head, dequantized (and un-smoothed) in `dtype`."""
        col_scale = getattr(layer, "embed_col_scale", None)
        rows = layer.weight_q[input_ids].float() * layer.weight_scale[input_ids, None]
        return (rows if col_scale is None else rows * col_scale).to(dtype)


class Int8LinearMethod(QuantizedLinearMethod):
    """W8A8 int8 (module docstring); on the CPU the weights are packed for cpu_linear.c."""

    name = "int8"
    weight_dtype = torch.int8

    @property
    def cpu_graph_max_tokens(self) -> int:
        return ALL_TOKENS  # the C kernel serves every batch size

    def quantize_rows(self, weight: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_rows_int8(weight)

    def process_weights(self, layer: Linear) -> None:
        super().process_weights(layer)
        if self.device.type == "cpu":
            from engine.kernels.cpu_linear import pack_int8

            layer.packed = pack_int8(
                layer.weight_q, layer.weight_scale, layer.bias_f32, layer.activation is not None
            )
            layer.weight_q = None  # the packed copy holds the same bytes

    def apply_quantized(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            from engine.kernels.cpu_linear import linear_w8a8

            return linear_w8a8(x, layer.packed, layer.streams_out(x.shape[0], x.dtype))
        from engine.kernels.int8_gemm import int8_linear

        return self.activate(
            layer, int8_linear(x, layer.weight_q, layer.weight_scale, layer.bias_f32)
        )

    def embed(self, layer: Linear, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.device.type != "cpu":
            return super().embed(layer, input_ids, dtype)
        from engine.kernels.cpu_ops import embedding_packed

        return embedding_packed(
            input_ids,
            layer.packed.packed,
            layer.out_features,
            layer.in_features,
            dtype,
            layer.packed.scale,
            getattr(layer, "embed_col_scale", None),
        )


class Fp8LinearMethod(QuantizedLinearMethod):
    """fp8 e4m3 weights and per-token activations through `torch._scaled_mm` (CUDA GPUs with
    fp8, `engine/kernels/fp8_linear.py`); the bias is added in the activation dtype."""

    name = "fp8"
    weight_dtype = torch.float8_e4m3fn

    def quantize_rows(self, weight: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        from engine.kernels.fp8_linear import quantize_weight_fp8

        return quantize_weight_fp8(weight, name)

    def process_weights(self, layer: Linear) -> None:
        super().process_weights(layer)
        if layer.bias is not None:
            layer.bias_act = layer.bias.detach().to(self.dtype)

    def apply_quantized(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        from engine.kernels.fp8_linear import fp8_linear

        bias = layer.bias_act if layer.bias is not None else None
        return self.activate(layer, fp8_linear(x, layer.weight_q, layer.weight_scale, bias))


def get_linear_method(
    quantization: str | None,
    kernels: ModelKernels | None,
    device: torch.device,
    dtype: torch.dtype,
) -> LinearMethod:
    """The method for `EngineConfig.quantization`; raises ValueError, at startup, where it
    cannot run."""
    if quantization is None:
        return LinearMethod(kernels, dtype)
    if quantization == "int8":
        return Int8LinearMethod(kernels, device, dtype)
    from engine.kernels.fp8_linear import fp8_supported

    supported, reason = fp8_supported(device, dtype)
    if not supported:
        raise ValueError(f"{reason}; on this machine use quantization='int8'")
    return Fp8LinearMethod(kernels, device, dtype)


# SmoothQuant --------------------------------------------------------------------------------


def _smoothing(act_amax: torch.Tensor, weight_amax: torch.Tensor) -> torch.Tensor:
    """s_j = max|X_j|^a / max|W_j|^(1 - a), kept away from 0."""
    s = act_amax.clamp(min=1e-5) ** SMOOTHQUANT_ALPHA
    return (s / weight_amax.clamp(min=1e-5) ** (1 - SMOOTHQUANT_ALPHA)).clamp(min=1e-5)


def _into_norm(norm: torch.nn.Module, layer: Linear, act_amax: torch.Tensor) -> torch.Tensor:
    """Smooth `layer`, whose input is `norm`'s output, into `norm`'s weight."""
    s = _smoothing(act_amax, layer.weight.abs().amax(dim=0))
    norm.weight.div_(s.to(norm.weight.dtype))
    layer.weight.mul_(s)
    return s


def _into_v(attn: torch.nn.Module, act_amax: torch.Tensor) -> None:
    """Smooth o_proj into v's rows of qkv_proj. o_proj reads attention outputs: channel (head
    h, d) carries v's channel (h // group, d), so one factor per v channel, shared by its
    group."""
    group = attn.num_heads // attn.num_kv_heads
    o_proj, qkv = attn.o_proj, attn.qkv_proj

    def per_kv_channel(x: torch.Tensor) -> torch.Tensor:
        return x.view(attn.num_kv_heads, group, attn.head_dim).amax(dim=1).flatten()

    s_kv = _smoothing(per_kv_channel(act_amax), per_kv_channel(o_proj.weight.abs().amax(dim=0)))
    v_rows = slice(attn.q_size + attn.kv_size, attn.q_size + 2 * attn.kv_size)
    qkv.weight[v_rows].div_(s_kv[:, None])
    if qkv.bias is not None:
        qkv.bias[v_rows].div_(s_kv)
    o_proj.weight.mul_(s_kv.view(attn.num_kv_heads, 1, -1).expand(-1, group, -1).flatten())


def _into_up(mlp: torch.nn.Module, act_amax: torch.Tensor) -> None:
    """Smooth down_proj into up's rows of gate_up_proj: SiLU(gate) * up is linear in up."""
    down, gate_up = mlp.down_proj, mlp.gate_up_proj
    s = _smoothing(act_amax, down.weight.abs().amax(dim=0))
    up_rows = slice(down.in_features, 2 * down.in_features)
    gate_up.weight[up_rows].div_(s[:, None])
    if gate_up.bias is not None:
        gate_up.bias[up_rows].div_(s)
    down.weight.mul_(s)


@torch.no_grad()
def smooth(model: torch.nn.Module, act_amax: dict[Linear, torch.Tensor]) -> None:
    """Fold SmoothQuant factors into the float weights (module docstring). `act_amax`: each
    linear layer's max |input| per channel over the calibration forward."""
    for decoder in model.model.layers:
        attn, mlp = decoder.self_attn, decoder.mlp
        _into_norm(decoder.input_layernorm, attn.qkv_proj, act_amax[attn.qkv_proj])
        _into_norm(decoder.post_attention_layernorm, mlp.gate_up_proj, act_amax[mlp.gate_up_proj])
        _into_v(attn, act_amax[attn.o_proj])
        _into_up(mlp, act_amax[mlp.down_proj])
    s = _into_norm(model.model.norm, model.lm_head, act_amax[model.lm_head])
    if model.tie_word_embeddings:  # embedding rows are the head's rows: undo s when reading
        model.lm_head.register_buffer("embed_col_scale", (1.0 / s).float())


@torch.no_grad()
def quantize_model(model: torch.nn.Module, calibrate: Callable[[], None]) -> None:
    """Calibrate (one forward via `calibrate`), smooth, and quantize every linear layer."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    act_amax: dict[Linear, torch.Tensor] = {}

    def record(layer: Linear, inputs: tuple[torch.Tensor, ...]) -> None:
        amax = inputs[0].detach().abs().amax(dim=0).float()
        act_amax[layer] = torch.maximum(act_amax[layer], amax) if layer in act_amax else amax

    hooks = [layer.register_forward_pre_hook(record) for layer in linears]
    try:
        calibrate()
    finally:
        for hook in hooks:
            hook.remove()
    smooth(model, act_amax)
    for name, layer in model.named_modules():
        if isinstance(layer, Linear):
            layer.method.quantize(layer, name)
    if model.tie_word_embeddings:
        model.model.embed_tokens.weight = None  # was the head's float weight


# The cache of quantized weights ---------------------------------------------------------------


def cache_dir(model_dir: Path, quantization: str, calibration_token_ids: list[int]) -> Path:
    """Where the quantized weights of `model_dir` live: keyed by the source files (path, size,
    modification time), the method, the format version and the calibration tokens."""
    files = sorted(p for p in Path(model_dir).iterdir() if p.suffix in (".json", ".safetensors"))
    key = {
        "source": str(Path(model_dir).resolve()),
        "files": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files],
        "quantization": quantization,
        "format": FORMAT_VERSION,
        "alpha": SMOOTHQUANT_ALPHA,
        "calibration": hashlib.sha256(json.dumps(calibration_token_ids).encode()).hexdigest(),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return envs.KVRAIL_CACHE_DIR / "quantized" / digest


def save_quantized(model: torch.nn.Module, target: Path) -> None:
    """Write the quantized state (before packing) beside `target`, then rename it in place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        state = {name: t.contiguous().cpu() for name, t in model.state_dict().items()}
        save_file(state, tmp_dir / "model.safetensors")
        try:
            tmp_dir.rename(target)
        except OSError:  # another process cached the same weights first
            shutil.rmtree(tmp_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


def load_quantized(model: torch.nn.Module, source: Path, device: torch.device) -> None:
    """Fill a freshly built model (float parameters never loaded) from a cached state."""
    state = load_file(source / "model.safetensors", device=str(device))
    for module in model.modules():
        if isinstance(module, Linear):
            module.method.prepare_quantized(module)
    if model.tie_word_embeddings:
        model.model.embed_tokens.weight = None
        model.lm_head.register_buffer("embed_col_scale", torch.empty(model.lm_head.in_features))
    model.load_state_dict(state, strict=True, assign=True)


def is_cached(path: Path) -> bool:
    return (path / "model.safetensors").is_file()
