from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import envs
from engine.attention import get_attn_backend
from engine.loader import load_model, load_tokenizer, resolve_model
from engine.models.layers import LinearMethod
from tests.engine.tiny_models import run_model_steps, smollm2_dir


@pytest.fixture(scope="module")
def smollm2_path():
    return smollm2_dir()  # the real cache: converted once (~25 s), then reused


def test_smollm2_logits_match_hf(smollm2_path, caplog):
    tokenizer = load_tokenizer(smollm2_path)
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    assert prompt_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")

    with caplog.at_level(logging.INFO, logger="kvrail.loader"):
        model, config = load_model(
            smollm2_path,
            torch.float32,
            torch.device("cpu"),
            get_attn_backend("torch"),
            LinearMethod(None, torch.float32),
        )
    assert "LlamaForCausalLM" in caplog.text and "134.5M params" in caplog.text
    assert config.num_hidden_layers == 30 and config.num_key_value_heads == 3
    # Two chunks: the second reads the first one's keys and values back from the paged cache.
    half = len(prompt_ids) // 2
    (logits,) = run_model_steps(model, [prompt_ids], [[half], [len(prompt_ids) - half]])
    del model

    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt_ids])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=1e-3)
    assert tokenizer.decode(int(logits[-1].argmax())) == "The"


def test_second_resolve_hits_cache(smollm2_path):
    start = time.perf_counter()
    assert resolve_model(None) == smollm2_path
    assert time.perf_counter() - start < 3.0
    assert (smollm2_path / "chat_template.jinja").is_file()
    assert json.loads((smollm2_path / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]


def test_failed_conversion_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRAIL_CACHE_DIR", str(tmp_path / "cache"))
    cache_dir = envs.KVRAIL_CACHE_DIR
    assert cache_dir == tmp_path / "cache"
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"GGUF not really")
    with pytest.raises(Exception):  # noqa: B017 - whatever the GGUF reader raises
        resolve_model(bogus)
    assert [p.suffix for p in (tmp_path / "cache" / "gguf").iterdir()] == [".lock"]


def test_a_conversion_waits_for_one_in_progress_and_takes_its_result(tmp_path, monkeypatch):
    """Processes sharing a cache convert a GGUF once: a second one waits on the lock, then
    finds the first one's folder (here the GGUF is not one: converting it would raise)."""
    import fcntl
    import threading

    from engine.loader import _convert_gguf, _sha256

    monkeypatch.setenv("KVRAIL_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF not really")
    target = tmp_path / "cache" / "gguf" / _sha256(gguf)
    target.parent.mkdir(parents=True)
    result = []
    with (target.parent / f"{target.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first process, converting
        waiter = threading.Thread(target=lambda: result.append(_convert_gguf(gguf)))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and not result  # waiting on the lock
        target.mkdir()
        (target / "config.json").write_text("{}")  # the first one's conversion lands
    waiter.join(10)
    assert result == [target]


def test_bad_model_paths_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(tmp_path / "nope")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"not a \.gguf"):
        resolve_model(tmp_path / "weights.bin")
    with pytest.raises(ValueError, match=r"no config\.json"):
        resolve_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        resolve_model(tmp_path)


@pytest.mark.parametrize("preset", [None, "0"])
def test_importing_the_engine_asks_torch_for_huge_pages_unless_told_otherwise(preset):
    """`envs.prefer_huge_pages`: torch reads THP_MEM_ALLOC_ENABLE at its first CPU allocation,
    so `import engine` sets it before importing torch, and keeps a value already given."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if preset is not None:
        env["THP_MEM_ALLOC_ENABLE"] = preset
    code = "import os, engine; print(os.environ['THP_MEM_ALLOC_ENABLE'])"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (preset or "1")
