"""The `kvrail` command line passes engine options through, and refuses bad ones at startup."""

from __future__ import annotations

import pytest

from service.cli import _engine_kwargs, build_parser, main
from tests.engine.tiny_models import make_tiny_model


@pytest.mark.parametrize("command", ["serve", "worker", "generate"])
def test_engine_options_reach_the_engine(command):
    argv = [command, "--quantization", "int8", "--kv-cache-dtype", "fp8", "--dtype", "float32"]
    argv += ["--scheduling-policy", "priority"]
    if command == "generate":
        argv.append("hello")
    kwargs = _engine_kwargs(build_parser().parse_args(argv))
    assert kwargs == {
        "quantization": "int8",
        "kv_cache_dtype": "fp8",
        "dtype": "float32",
        "scheduling_policy": "priority",
    }


def test_generate_with_int8_and_a_refused_option(tmp_path, capsys):
    model = str(make_tiny_model(tmp_path / "llama", "llama", num_hidden_layers=1))
    base = ["generate", "--model", model, "--dtype", "float32", "--max-tokens", "4", "--raw"]
    assert main([*base, "--quantization", "int8", "Hello"]) == 0
    assert capsys.readouterr().out.strip()
    with pytest.raises(ValueError, match="quantization must be None or one of"):
        main([*base, "--quantization", "int4", "Hello"])
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        main([*base, "--scheduling-policy", "lifo", "Hello"])
