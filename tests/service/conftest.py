"""Fixtures the worker's tests share: a tiny random-weight model, one engine on it (used by
one worker at a time), and an async Redis client."""

from __future__ import annotations

import pytest
import pytest_asyncio

from engine import LLMEngine
from queueing import streams
from tests.engine.tiny_models import make_tiny_model

ENGINE_KWARGS = dict(
    dtype="float32", max_model_len=512, block_size=16, num_kv_blocks=128, max_num_seqs=16
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama"))


@pytest.fixture(scope="module")
def engine(model_dir):
    """One engine shared by the module's workers, one worker at a time."""
    return LLMEngine.from_kwargs(model=model_dir, **ENGINE_KWARGS)


@pytest_asyncio.fixture
async def redis(redis_url):
    r = streams.connect(redis_url)
    yield r
    await r.aclose()
