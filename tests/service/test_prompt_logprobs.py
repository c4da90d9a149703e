"""`prompt_logprobs` through the service: the Starlette app, a real Redis and a real `Worker`
on a tiny random-weight model, against the offline engine."""

from __future__ import annotations

import httpx
import msgpack
import pytest
import pytest_asyncio

from engine import LLM, SamplingParams
from queueing import streams
from queueing.schema import (
    MAX_MESSAGE_BYTES,
    GenerateRequest,
    SchemaError,
    TokenChunk,
    check_prompt_logprobs_size,
    keys,
)
from service.api import create_app
from service.settings import Settings
from tests.service.conftest import ENGINE_KWARGS
from tests.service.test_api import Api, assert_error, parse_sse
from tests.service.test_worker import GREEDY, PROMPT, read_chunks, serving, submit

pytestmark = pytest.mark.timeout(60)

MODEL = "tiny"


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model=model_dir, **ENGINE_KWARGS)


@pytest_asyncio.fixture
async def http(engine, model_dir, redis_url):
    """The API app and a real worker, both on the test's Redis."""
    app = create_app(redis_url, MODEL, model_dir, Settings(), worker_cache_s=0.0)
    async with (
        serving(engine, redis_url),
        Api(app) as api,
        httpx.AsyncClient(base_url=api.url, timeout=30) as client,
    ):
        yield client


def assert_like_offline(returned, expected, tokenizer) -> None:
    """The JSON prompt logprobs hold the offline engine's tokens, ranks and values."""
    assert returned[0] is None and len(returned) == len(expected)
    for got, want in zip(returned[1:], expected[1:], strict=True):
        assert list(got) == [str(t) for t in want]  # the prompt's token first, as vLLM
        for token_id, lp in want.items():
            entry = got[str(token_id)]
            assert entry["rank"] == lp.rank
            assert entry["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
            assert entry["decoded_token"] == tokenizer.decode([token_id])


@pytest.mark.asyncio
async def test_completion_and_chat_return_them_as_vllm(http, offline):
    tokenizer = offline.get_tokenizer()
    (expected,) = offline.generate(
        PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=2, **GREEDY)
    )
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "n": 2, "prompt_logprobs": 2}
    response = await http.post("/v1/completions", json={**body, **GREEDY})
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 2 and choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    assert_like_offline(choices[0]["prompt_logprobs"], expected.prompt_logprobs, tokenizer)
    assert [c["text"] for c in choices] == [expected.outputs[0].text] * 2

    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
    answer = (await http.post("/v1/chat/completions", json={**chat, "prompt_logprobs": 0})).json()
    prompt_logprobs = answer["prompt_logprobs"]  # at the top, as vLLM's chat
    assert len(prompt_logprobs) == answer["usage"]["prompt_tokens"]
    assert all(len(position) == 1 for position in prompt_logprobs[1:])  # the prompt's token
    assert "prompt_logprobs" not in answer["choices"][0]

    # Not asked: not computed, and the answer keeps its former shape.
    plain = (await http.post("/v1/completions", json={**body, "prompt_logprobs": None})).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    # 0 with stream=true is accepted (vLLM's rule) and, never streamed, not computed.
    streamed = await http.post(
        "/v1/completions", json={**body, "prompt_logprobs": 0, "stream": True}
    )
    assert streamed.status_code == 200
    events = [e["data"] for e in parse_sse(streamed.text) if e["data"] != "[DONE]"]
    assert events and all("prompt_logprobs" not in c for e in events for c in e["choices"])


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "extra",
    [
        {"prompt_logprobs": 21},
        {"prompt_logprobs": -1},
        {"prompt_logprobs": "2"},
        {"prompt_logprobs": True},
        {"prompt_logprobs": 1, "stream": True},
    ],
)
async def test_bad_values_are_400_naming_the_field(http, extra):
    for path, body in [
        ("/v1/completions", {"model": MODEL, "prompt": PROMPT}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
    ]:
        assert_error(await http.post(path, json={**body, **extra}), 400, "prompt_logprobs")


@pytest.mark.asyncio
async def test_resumed_request_does_not_send_them_again(engine, offline, redis, redis_url):
    sampling = dict(max_tokens=12, prompt_logprobs=3, **GREEDY)
    entry_id = await submit(redis, GenerateRequest("plp", prompt=PROMPT, sampling=sampling))
    # A worker that read the entry, published the first steps' chunks (the first one with the
    # prompt logprobs), then died.
    await streams.ensure_group(redis)
    dead = streams.RequestConsumer(redis, redis, "dead")
    assert [e.entry_id for e in await dead.read()] == [entry_id]
    await streams.own_request(redis, "plp", entry_id, 60)
    (expected,) = offline.generate(PROMPT, SamplingParams(**sampling))
    first = TokenChunk(
        "plp",
        0,
        token_ids=expected.outputs[0].token_ids[:1],
        prompt_logprobs=[
            None if d is None else [[t, lp.logprob, lp.rank] for t, lp in d.items()]
            for d in expected.prompt_logprobs
        ],
    )
    second = TokenChunk("plp", 1, token_ids=expected.outputs[0].token_ids[1:3])
    await streams.ResponsePublisher(redis, 60).publish(
        (keys.response("plp"), c) for c in (first, second)
    )
    async with serving(engine, redis_url, claim_idle_ms=500):
        chunks = await read_chunks(redis, "plp")
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert [t for c in chunks for t in c.token_ids] == expected.outputs[0].token_ids
    assert [c.seq for c in chunks if c.prompt_logprobs is not None] == [0]


def test_size_bound_holds_for_the_largest_encoding():
    """The longest prompt accepted, with worst-case values (ids and the prompt token's rank
    past 65535, top-20), still makes a chunk that decodes; one token more is refused."""
    num_logprobs, low, high = 20, 1, 10**6  # bisect: low is accepted, high is refused
    with pytest.raises(SchemaError, match="prompt_logprobs"):
        check_prompt_logprobs_size(high, num_logprobs)
    while high - low > 1:
        mid = (low + high) // 2
        try:
            check_prompt_logprobs_size(mid, num_logprobs)
            low = mid
        except SchemaError:
            high = mid
    position = [[151_000, -12.5, 151_000]] + [[150_000 + k, -1.5, k] for k in range(1, 21)]
    assert len(msgpack.packb(position)) == 3 + 20 + 16 * num_logprobs  # the bound is reached
    data = TokenChunk("r", 0, token_ids=[1], prompt_logprobs=[None] + [position] * low).encode()
    assert len(data) <= MAX_MESSAGE_BYTES
    assert TokenChunk.decode(data).prompt_logprobs[-1] == position
