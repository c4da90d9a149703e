"""Hostile input 10: limits, the API key, `reply_to` and Redis credentials.

The API runs on a real uvicorn and Redis with the fake worker of `tests/service/test_api.py`;
the Redis-credentials test runs a real `Worker` and `KvrailClient` against a Redis that wants a
password, and an ACL user confined to kvrail's keys. (The body-size limit, a plain wrong key
and one over-long prompt are in `tests/service/test_api.py`; here are the other limits.)
"""

from __future__ import annotations

import asyncio
import hmac
import uuid

import pytest
import redis
from redis.exceptions import NoPermissionError

from engine import LLMEngine
from engine.request import MAX_LOGIT_BIAS, MAX_N, MAX_STOP_STRING_LEN, MAX_STOP_STRINGS
from queueing.client import KvrailClient
from queueing.redis_server import EmbeddedRedis
from queueing.schema import GenerateRequest, SchemaError
from tests.engine.tiny_models import make_tiny_model
from tests.reliability.harness import GREEDY, collect
from tests.service.test_api import MAX_MODEL_LEN, MODEL, assert_error
from tests.service.test_worker import serving

pytestmark = pytest.mark.timeout(60)

OVER_LIMIT = [
    ({"n": MAX_N + 1}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),  # prompt + max_tokens > max_model_len
    ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": ["s" * (MAX_STOP_STRING_LEN + 1)]}, "stop"),
    ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ({"logit_bias": {"10000000": 1}}, "logit_bias"),  # not a token id of this vocabulary
    ({"prompt": [5] * MAX_MODEL_LEN}, "prompt"),  # exactly the context: no room to generate
]


@pytest.mark.asyncio
@pytest.mark.parametrize("fields, param", OVER_LIMIT, ids=[p for _, p in OVER_LIMIT])
async def test_limits_give_400_naming_the_parameter(start_api, worker, fields, param):
    http = await start_api(api_key="")
    body = {"model": MODEL, "prompt": "x", **fields}
    assert_error(await http.post("/v1/completions", json=body), 400, param)
    assert not worker.requests  # refused before it reached the request stream


@pytest.mark.asyncio
async def test_api_key_is_compared_in_constant_time(start_api, worker, monkeypatch):
    """Every guess, right length or not, goes through `hmac.compare_digest` and gets 401."""
    compared = []
    real = hmac.compare_digest

    def spy(given, expected):
        compared.append(given)
        return real(given, expected)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    http = await start_api(api_key="s3cret-key")
    guesses = ["", "Bearer", "Bearer s", "Bearer s3cret-kez", "Bearer s3cret-key-and-more"]
    for guess in guesses:
        response = await http.get("/v1/models", headers={"Authorization": guess})
        assert_error(response, 401)
    assert compared == [g.encode() for g in guesses]
    ok = await http.get("/v1/models", headers={"Authorization": "Bearer s3cret-key"})
    assert ok.status_code == 200


@pytest.mark.parametrize(
    "reply_to", ["kvrail:requests", "kvrail:control", "kvrail:resp", "kvrail:respx", "other:resp:x"]
)
def test_reply_to_outside_the_response_namespace_is_refused(reply_to):
    request = GenerateRequest(uuid.uuid4().hex, prompt="x", reply_to=reply_to)
    with pytest.raises(SchemaError, match="reply_to"):
        GenerateRequest.decode(request.encode())


def test_reply_to_inside_the_namespace_is_accepted():
    request = GenerateRequest("r", prompt="x", reply_to="kvrail:resp:elsewhere")
    assert GenerateRequest.decode(request.encode()).response_key == "kvrail:resp:elsewhere"


@pytest.mark.asyncio
async def test_redis_password_and_acl_user_through_redis_url(tmp_path):
    """A worker and a client as an ACL user that may touch only `kvrail:*` keys (and no
    dangerous commands), and a client with the default user's password."""
    model = str(make_tiny_model(tmp_path / "llama", "llama"))
    engine = LLMEngine.from_kwargs(model=model, max_model_len=256, num_kv_blocks=32)
    server = await asyncio.to_thread(EmbeddedRedis(password="admin-pw").start)
    try:
        admin = redis.Redis.from_url(server.url)
        admin.execute_command(
            "ACL", "SETUSER", "kvrail", "on", ">user-pw", "~kvrail:*", "&*", "+@all", "-@dangerous"
        )
        admin.close()
        user_url = f"redis://kvrail:user-pw@127.0.0.1:{server.port}/0"
        async with serving(engine, user_url):
            for url in (user_url, server.url):
                async with KvrailClient(url) as client:
                    rid = uuid.uuid4().hex
                    sampling = {"max_tokens": 4, **GREEDY}
                    await client.submit(GenerateRequest(rid, prompt="hi", sampling=sampling))
                    chunks = await asyncio.wait_for(collect(client, rid), 30)
                    assert chunks[-1].usage["completion_tokens"] == 4
        confined = redis.Redis.from_url(user_url)
        with pytest.raises(NoPermissionError):
            confined.set("outside", 1)
        confined.close()
    finally:
        await asyncio.to_thread(server.cleanup)
