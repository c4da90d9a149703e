"""Shared fixtures. TRITON_INTERPRET must be set before any kernel module is imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess
import sys

import pytest

from queueing.redis_server import EmbeddedRedis, die_with_parent


def pytest_addoption(parser):
    parser.addoption(
        "--busy-processes",
        type=int,
        default=0,
        help="run N processes that spin on a CPU beside the tests (a loaded machine)",
    )


@pytest.fixture(scope="session", autouse=True)
def busy_processes(request):
    """`--busy-processes N`: N CPU-bound spinners for the whole session, so tests that wait on
    conditions can be shown to hold on a machine with other work
    (`make test-reliability-loaded`)."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=die_with_parent)
        for _ in range(request.config.getoption("--busy-processes"))
    ]
    yield len(spinners)
    for spinner in spinners:
        spinner.kill()
        spinner.wait()


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


@pytest.fixture
def lose_a_reply(monkeypatch):
    """`lose_a_reply("XREADGROUP")`: the next reply of that command handing out entries is lost
    after Redis ran the command (the connection drops before the reply is read), as when Redis
    stops between running a command and writing its reply (docs/reliability.md item 31)."""
    from redis.asyncio.client import Redis
    from redis.exceptions import ConnectionError

    real_parse_response, armed = Redis.parse_response, set()

    def hands_out_entries(command_name, reply) -> bool:
        if command_name == "XAUTOCLAIM":  # [cursor, entries, deleted ids]
            return bool(reply[1])
        return any(entries for _, entries in reply or [])  # XREADGROUP: [[stream, entries]]

    async def parse_response(self, connection, command_name, **options):
        reply = await real_parse_response(self, connection, command_name, **options)
        if command_name in armed and hands_out_entries(command_name, reply):
            armed.discard(command_name)
            await connection.disconnect()
            raise ConnectionError(f"the reply of {command_name} was lost (injected)")
        return reply

    monkeypatch.setattr(Redis, "parse_response", parse_response)
    return armed.add
