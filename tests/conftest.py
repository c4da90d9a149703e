"""Shared fixtures. TRITON_INTERPRET must be set before any kernel module is imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from queueing.redis_server import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server on a free loopback port, private to this test session."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server):
    """The session server's URL, flushed before each test so tests share nothing."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url
