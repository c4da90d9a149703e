"""service.api on a real uvicorn, a real Redis and a fake worker written here (no mocks).

The fake worker is a real consumer of `kvrail:requests` (XREADGROUP) that answers every
request with a deterministic sequence of TokenChunks and keeps a heartbeat alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
import uvicorn

from engine.loader import load_tokenizer, resolve_model
from queueing.redis_server import free_port
from queueing.schema import Abort, GenerateRequest, TokenChunk, WorkerInfo, keys
from service.api import create_app, server_config
from service.settings import Settings

MODEL = "kvrail-test-model"
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="session")
def tokenizer_dir():
    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


class FakeWorker:
    """Answers each request with `tokens` tokens per choice (` w0`, ` w1`, ...)."""

    def __init__(self, redis_url: str, tokens: int = 3, delay_s: float = 0.0) -> None:
        self.redis = aioredis.Redis.from_url(redis_url, socket_timeout=None)
        self.tokens = tokens
        self.delay_s = delay_s
        self.error: str | None = None
        self.retry = False  # the error is overload (a worker's full waiting queue)
        self.invalid = False  # the error is the request's own (the engine refused it)
        self.requests: list[GenerateRequest] = []
        self._task: asyncio.Task | None = None
        self._answers: set[asyncio.Task] = set()

    async def start(self) -> FakeWorker:
        info = WorkerInfo("fake", MODEL, MAX_MODEL_LEN, started_ms=1, heartbeat_ms=1)
        await self.redis.set(keys.worker("fake"), info.encode(), ex=60)
        with contextlib.suppress(aioredis.ResponseError):  # BUSYGROUP
            await self.redis.xgroup_create(keys.requests, keys.group, id="0", mkstream=True)
        self._task = asyncio.create_task(self._serve())
        return self

    async def stop(self) -> None:
        for task in (self._task, *self._answers):
            task.cancel()
        await asyncio.gather(self._task, *self._answers, return_exceptions=True)
        await self.redis.aclose()

    async def _serve(self) -> None:
        while True:
            reply = await self.redis.xreadgroup(
                keys.group, "fake", {keys.requests: ">"}, count=10, block=100
            )
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    request = GenerateRequest.decode(fields[b"data"])
                    self.requests.append(request)
                    task = asyncio.create_task(self._answer(request, entry_id))
                    self._answers.add(task)
                    task.add_done_callback(self._answers.discard)

    def _chunks(self, request: GenerateRequest) -> list[TokenChunk]:
        if self.error:
            fields = dict(error=self.error, retry=self.retry, invalid=self.invalid)
            return [TokenChunk(request.request_id, 0, finish_reason="error", **fields)]
        n = request.sampling.get("n", 1)
        top = request.sampling.get("logprobs")
        chunks = []
        for index in range(n):
            for j in range(self.tokens):
                token = 100 + j
                logprobs = None
                if top is not None:
                    logprobs = [[[token, -0.5], *[[200 + k, -1.0 - k] for k in range(top)]]]
                chunks.append(
                    TokenChunk(
                        request.request_id,
                        len(chunks),
                        index,
                        [token],
                        f" w{j}",
                        logprobs,
                        finish_reason="length" if j == self.tokens - 1 else None,
                    )
                )
        chunks[-1].usage = {"completion_tokens": n * self.tokens}
        return chunks

    async def _answer(self, request: GenerateRequest, entry_id: bytes) -> None:
        for chunk in self._chunks(request):
            await asyncio.sleep(self.delay_s)
            await self.redis.xadd(request.response_key, {"data": chunk.encode()})
        await self.redis.xack(keys.requests, keys.group, entry_id)


class Api:
    """A real uvicorn serving create_app(...) on a free port, in the test's event loop,
    configured as `kvrail api` configures it (its settings' timeouts and limit)."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        settings = dataclasses.replace(app.state.api.settings, log_level="WARNING")
        config = server_config(app, "127.0.0.1", self.port, settings)
        self.server = uvicorn.Server(config)
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> Api:
        self._task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.should_exit = True
        await self._task


@pytest_asyncio.fixture
async def start_api(redis_url, tokenizer_dir):
    """Start an API with the given settings; returns (base url, http client)."""
    stack = contextlib.AsyncExitStack()

    async def start(worker_cache_s: float = 0.0, **settings: Any) -> httpx.AsyncClient:
        app = create_app(
            redis_url, MODEL, tokenizer_dir, Settings(**settings), worker_cache_s=worker_cache_s
        )
        api = await stack.enter_async_context(Api(app))
        return await stack.enter_async_context(httpx.AsyncClient(base_url=api.url, timeout=10))

    yield start
    await stack.aclose()


@pytest_asyncio.fixture
async def worker(redis_url):
    fake = await FakeWorker(redis_url).start()
    yield fake
    await fake.stop()


@pytest_asyncio.fixture
async def http(start_api, worker):
    return await start_api(api_key="")


def parse_sse(text: str) -> list[dict[str, Any]]:
    """Events as {id, event, data} (data JSON-decoded unless it is [DONE])."""
    events = []
    for block in text.strip().split("\n\n"):
        event: dict[str, Any] = {"id": None, "event": None}
        for line in block.split("\n"):
            name, _, value = line.partition(": ")
            event[name] = value
        if event["data"] != "[DONE]":
            event["data"] = json.loads(event["data"])
        event["id"] = int(event["id"]) if event["id"] is not None else None
        events.append(event)
    return events


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


# ---- happy paths -------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_models_health_metrics_openapi(http):
    models = (await http.get("/v1/models")).json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert (await http.get("/health")).json() == {"status": "ok", "workers": 1}
    document = (await http.get("/openapi.json")).json()
    assert document["openapi"].startswith("3.")
    assert {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/models/{model}",
        "/v1/streams/{request_id}",
        "/health",
        "/metrics",
        "/tokenize",
        "/detokenize",
    } <= set(document["paths"])
    text = (await http.get("/metrics")).text
    assert 'kvrail:http_requests_total{method="GET",route="/v1/models",status="200"}' in text


@pytest.mark.asyncio
async def test_retrieve_model_gives_the_listed_object_or_404(http):
    """OpenAI's `GET /v1/models/{model}`: the entry `/v1/models` lists; any other id (one
    with a slash too, as Hugging Face names have) is a 404 `model_not_found`."""
    listed = (await http.get("/v1/models")).json()["data"][0]
    assert (await http.get(f"/v1/models/{MODEL}")).json() == listed
    for unknown in ("nope", "org/nope"):
        error = assert_error(await http.get(f"/v1/models/{unknown}"), 404, "model")
        assert error["code"] == "model_not_found" and unknown in error["message"]


@pytest.mark.asyncio
async def test_completion_non_stream(http, worker, tokenizer):
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 3, "temperature": 0}
    response = (await http.post("/v1/completions", json=body)).json()
    prompt_ids = tokenizer("Hello there").input_ids
    assert worker.requests[0].prompt_token_ids == prompt_ids
    assert worker.requests[0].sampling["max_tokens"] == 3
    assert response["object"] == "text_completion" and response["id"].startswith("cmpl-")
    assert response["choices"][0]["text"] == " w0 w1 w2"
    assert response["choices"][0]["finish_reason"] == "length"
    assert response["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 3,
        "total_tokens": len(prompt_ids) + 3,
        "prompt_tokens_details": {"cached_tokens": 0},  # a worker that does not say: 0
    }


@pytest.mark.asyncio
async def test_priority_is_passed_to_the_worker(http, worker):
    """vLLM's `priority` field, on both endpoints, streamed or not, each prompt of a batch."""
    await http.post("/v1/completions", json={"model": MODEL, "prompt": ["x", "y"], "priority": -2})
    await http.post("/v1/chat/completions", json={**CHAT, "priority": 5, "stream": True})
    await http.post("/v1/chat/completions", json={**CHAT, "priority": None})
    await http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert [r.priority for r in worker.requests] == [-2, -2, 5, 0, 0]


@pytest.mark.asyncio
async def test_completion_logprobs_shape(http):
    body = {"model": MODEL, "prompt": [1, 2, 3], "logprobs": 2}
    choice = (await http.post("/v1/completions", json=body)).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 3
    assert logprobs["token_logprobs"] == [-0.5] * 3
    assert len(logprobs["top_logprobs"][0]) == 3  # the sampled token and the top 2
    assert logprobs["text_offset"][0] == 0


@pytest.mark.asyncio
async def test_chat_non_stream_n2_with_logprobs(http, worker, tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    body = {"model": MODEL, "messages": messages, "n": 2, "logprobs": True, "top_logprobs": 1}
    response = (await http.post("/v1/chat/completions", json=body)).json()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    templated = tokenizer(text, add_special_tokens=False).input_ids
    assert worker.requests[0].prompt_token_ids == templated
    assert response["object"] == "chat.completion" and response["id"].startswith("chatcmpl-")
    assert [c["index"] for c in response["choices"]] == [0, 1]
    for choice in response["choices"]:
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"] == " w0 w1 w2"
        content = choice["logprobs"]["content"]
        assert len(content) == 3 and len(content[0]["top_logprobs"]) == 1
        assert content[0]["bytes"] == list(content[0]["token"].encode())
    assert response["usage"]["prompt_tokens"] == len(templated)
    assert response["usage"]["completion_tokens"] == 6


@pytest.mark.asyncio
async def test_chat_stream_shape_usage_and_done(http):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = await http.post("/v1/chat/completions", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert events[-1]["data"] == "[DONE]"
    first, *content, usage, _ = events
    assert first["data"]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["id"] for e in content] == [0, 1, 2]
    assert all(e["data"]["object"] == "chat.completion.chunk" for e in content)
    assert "".join(e["data"]["choices"][0]["delta"].get("content", "") for e in content) == (
        " w0 w1 w2"
    )
    assert content[-1]["data"]["choices"][0]["finish_reason"] == "length"
    assert usage["data"]["choices"] == [] and usage["data"]["usage"]["completion_tokens"] == 3


@pytest.mark.asyncio
async def test_completion_stream_and_resume_with_last_event_id(http):
    body = {"model": MODEL, "prompt": "Hi", "stream": True, "n": 2}
    events = parse_sse((await http.post("/v1/completions", json=body)).text)
    assert [e["id"] for e in events[:-1]] == list(range(6))
    assert all(e["data"]["object"] == "text_completion" for e in events[:-1])
    request_id = events[0]["data"]["id"]
    resumed = await http.get(f"/v1/streams/{request_id}", headers={"Last-Event-ID": "3"})
    resumed_events = parse_sse(resumed.text)
    assert [e["id"] for e in resumed_events] == [4, 5, None]
    assert [e["data"] for e in resumed_events[:-1]] == [e["data"] for e in events[4:6]]
    assert resumed_events[-1]["data"] == "[DONE]"
    everything = parse_sse((await http.get(f"/v1/streams/{request_id}")).text)
    assert [e["id"] for e in everything] == [*range(6), None]
    assert (await http.get("/v1/streams/cmpl-unknown")).status_code == 404


@pytest.mark.asyncio
async def test_tokenize_and_detokenize(http, tokenizer):
    response = (await http.post("/tokenize", json={"prompt": "Hello world"})).json()
    assert response["tokens"] == tokenizer("Hello world").input_ids
    assert response["count"] == len(response["tokens"])
    assert response["max_model_len"] == MAX_MODEL_LEN
    chat = await http.post(
        "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}], "model": MODEL}
    )
    assert chat.json()["count"] > 5
    text = (await http.post("/detokenize", json={"tokens": response["tokens"]})).json()
    assert text == {"prompt": "Hello world"}


# ---- disconnects -------------------------------------------------------------------------------


async def wait_for_abort(redis_url: str, request_id: str, timeout_s: float = 5.0) -> None:
    client = aioredis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            entries = await client.xrange(keys.control)
            if any(Abort.decode(f[b"data"]).request_id == request_id for _, f in entries):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"no Abort for {request_id} on {keys.control}")
    finally:
        await client.aclose()


@pytest.mark.asyncio
async def test_stream_disconnect_aborts_at_once_without_a_resume_grace(
    start_api, worker, redis_url
):
    http = await start_api(resume_grace_s=0)  # with a grace: tests/service/test_resume.py
    worker.tokens, worker.delay_s = 50, 0.1
    body = {"model": MODEL, "prompt": "Hi", "stream": True, "max_tokens": 50}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                request_id = json.loads(line[6:])["id"]
                break
    await wait_for_abort(redis_url, request_id)


@pytest.mark.asyncio
async def test_non_stream_disconnect_aborts(http, worker, redis_url):
    worker.tokens, worker.delay_s = 50, 0.1
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 50}
    with pytest.raises(httpx.ReadTimeout):
        await http.post("/v1/completions", json=body, timeout=0.5)
    await wait_for_abort(redis_url, worker.requests[0].request_id)


# ---- errors ------------------------------------------------------------------------------------


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
JSON_TYPE = {"content-type": "application/json"}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "method, path, body, status, param",
    [
        ("POST", "/v1/completions", b"{not json", 400, None),
        ("POST", "/v1/completions", b"[1, 2]", 400, None),
        ("POST", "/v1/completions", b"[" * 200_000, 400, None),
        ("POST", "/tokenize", b"[" * 200_000, 400, None),
        ("POST", "/v1/completions", {"prompt": "x"}, 400, "model"),
        ("POST", "/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": [["a"]]}, 400, "prompt"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "n": "2"}, 400, "n"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 2}, 400, "top_p"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "seed": 2**64}, 400, "seed"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 1e20}, 400, "top_k"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 2**64}, 400, "top_k"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": [99999999]}, 400, "prompt"),
        ("POST", "/v1/completions", {"model": "other", "prompt": "x"}, 404, "model"),
        ("POST", "/v1/chat/completions", {**CHAT, "temperature": True}, 400, "temperature"),
        ("POST", "/v1/chat/completions", {**CHAT, "priority": "1"}, 400, "priority"),
        ("POST", "/v1/chat/completions", {**CHAT, "priority": True}, 400, "priority"),
        (
            "POST",
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "priority": 1.5},
            400,
            "priority",
        ),
        (
            "POST",
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "priority": 2**64},
            400,
            "priority",
        ),
        ("POST", "/v1/chat/completions", {**CHAT, "logit_bias": {"a": 1}}, 400, "logit_bias"),
        ("POST", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
        ("POST", "/v1/chat/completions", {**CHAT, "stop": [""]}, 400, "stop"),
        ("POST", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
        ("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 5000}, 400, "max_tokens"),
        ("POST", "/v1/chat/completions", {"messages": CHAT["messages"]}, 400, "model"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": [5] * 3000}, 400, "prompt"),
        ("GET", "/v1/completions", None, 405, None),
        ("GET", "/v1/nothing", None, 404, None),
        ("GET", "/v1/streams/x", {"Last-Event-ID": "abc"}, 400, "Last-Event-ID"),
    ],
)
async def test_error_statuses(http, method, path, body, status, param):
    if method == "GET":
        response = await http.get(path, headers=body or {})
    elif isinstance(body, bytes):
        response = await http.post(path, content=body, headers=JSON_TYPE)
    else:
        response = await http.post(path, json=body)
    assert_error(response, status, param)


@pytest.mark.asyncio
async def test_body_too_large_declared_and_streamed(start_api, worker):
    http = await start_api(max_body_bytes=1000)
    big = {"model": MODEL, "prompt": "x" * 2000}
    assert_error(await http.post("/v1/completions", json=big), 413)

    async def chunked():  # no Content-Length: the streamed length must be checked
        yield json.dumps(big).encode()

    assert_error(await http.post("/v1/completions", content=chunked(), headers=JSON_TYPE), 413)


@pytest.mark.asyncio
async def test_api_key(start_api, worker):
    http = await start_api(api_key="sekret")
    body = {"model": MODEL, "prompt": "x"}
    assert_error(await http.post("/v1/completions", json=body), 401)
    wrong = {"Authorization": "Bearer nope"}
    assert_error(await http.post("/v1/completions", json=body, headers=wrong), 401)
    good = {"Authorization": "Bearer sekret"}
    assert (await http.post("/v1/completions", json=body, headers=good)).status_code == 200
    assert (await http.get("/health")).status_code == 200  # probes need no key


@pytest.mark.asyncio
async def test_no_worker_gives_503_until_one_comes_up(start_api, redis_url):
    # A long cache window: a worker that comes up must be served at once all the same.
    http = await start_api(api_key="", worker_cache_s=60.0)
    body = {"model": MODEL, "prompt": "x"}
    response = await http.post("/v1/completions", json=body)
    assert_error(response, 503)
    assert response.headers["Retry-After"]
    assert_error(await http.get("/health"), 503)
    fake = await FakeWorker(redis_url).start()
    try:
        assert (await http.get("/health")).status_code == 200
        assert (await http.post("/v1/completions", json=body)).status_code == 200
    finally:
        await fake.stop()


@pytest.mark.asyncio
async def test_backlog_gives_429(start_api, redis_url):
    http = await start_api(api_key="", max_pending=2)
    backlog = aioredis.Redis.from_url(redis_url)
    info = WorkerInfo("idle", MODEL, MAX_MODEL_LEN, started_ms=1, heartbeat_ms=1)
    await backlog.set(keys.worker("idle"), info.encode(), ex=60)  # alive but never reading
    for i in range(2):
        request = GenerateRequest(f"queued-{i}", prompt="x")
        await backlog.xadd(keys.requests, {"data": request.encode()})
    await backlog.aclose()
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert_error(response, 429)
    assert response.headers["Retry-After"] == "1"


@pytest.mark.asyncio
async def test_worker_error_chunk(http, worker):
    worker.error = "engine exploded"
    body = {"model": MODEL, "prompt": "x"}
    error = assert_error(await http.post("/v1/completions", json=body), 500)
    assert error["message"] == "engine exploded"
    events = parse_sse((await http.post("/v1/completions", json={**body, "stream": True})).text)
    assert events[0]["event"] == "error" and events[0]["data"]["error"]["message"]
    assert events[-1]["data"] == "[DONE]"


@pytest.mark.asyncio
async def test_a_full_worker_queue_is_429_not_500(http, worker):
    # Concurrent requests can pass the backlog check together and overfill a worker's waiting
    # queue (seen under load: 22 of 931 burst requests got 500): that is overload, as the
    # backlog limit's own 429 is.
    worker.error, worker.retry = "waiting queue is full (32 requests); retry later", True
    body = {"model": MODEL, "prompt": "x"}
    response = await http.post("/v1/completions", json=body)
    error = assert_error(response, 429)
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert error["message"] == worker.error and response.headers["Retry-After"] == "1"
    events = parse_sse((await http.post("/v1/completions", json={**body, "stream": True})).text)
    assert events[0]["event"] == "error"
    assert events[0]["data"]["error"]["code"] == "rate_limit_exceeded"
    assert events[-1]["data"] == "[DONE]"


@pytest.mark.asyncio
async def test_a_request_the_engine_refuses_is_400_not_500(http, worker):
    # Schemathesis: priority 2 on a worker whose engine schedules fcfs was a 500.
    worker.error = "got priority 2 but priority scheduling is not enabled"
    worker.invalid = True
    body = {"model": MODEL, "prompt": "x", "priority": 2}
    error = assert_error(await http.post("/v1/completions", json=body), 400)
    assert error["type"] == "invalid_request_error" and error["message"] == worker.error
    events = parse_sse((await http.post("/v1/completions", json={**body, "stream": True})).text)
    assert events[0]["event"] == "error"
    assert events[0]["data"]["error"]["type"] == "invalid_request_error"


# ---- the official client -----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_official_openai_client(start_api, worker):
    http = await start_api(api_key="sekret")
    client = openai.AsyncOpenAI(
        base_url=f"{str(http.base_url).rstrip('/')}/v1", api_key="sekret", max_retries=0
    )
    messages = [{"role": "user", "content": "Hi"}]
    chat = await client.chat.completions.create(model=MODEL, messages=messages)
    assert chat.choices[0].message.content == " w0 w1 w2"
    assert chat.usage.completion_tokens == 3
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}
    )
    pieces = [c async for c in stream]
    assert pieces[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == " w0 w1 w2"
    assert pieces[-1].usage.total_tokens > 3
    completion = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    assert completion.choices[0].text == " w0 w1 w2"
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert (await client.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("nope")
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt="Hello")
    await client.close()


@pytest.mark.asyncio
async def test_only_json_bodies_and_no_cross_origin_calls_by_default(http, start_api, worker):
    """Issue 12: a `text/plain` POST (no CORS preflight needed) from any page got a
    completion. Bodies must be application/json (415 otherwise), and with no
    KVRAIL_CORS_ORIGINS no origin may call: preflights refused, no allow header."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1})
    evil = {"origin": "http://evil.example"}
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {**evil, **({"content-type": content_type} if content_type else {})}
        response = await http.post("/v1/completions", content=body, headers=headers)
        assert_error(response, 415)
        assert "access-control-allow-origin" not in response.headers
    ok = await http.post(
        "/v1/completions", content=body, headers={"content-type": "application/json; charset=utf-8"}
    )
    assert ok.status_code == 200
    preflight = {
        **evil,
        "access-control-request-method": "POST",
        "access-control-request-headers": "content-type",
    }
    refused = await http.options("/v1/completions", headers=preflight)
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    # An allowed origin gets its preflight and its answers.
    allowing = await start_api(cors_origins=("http://app.example",))
    allowed = {**preflight, "origin": "http://app.example"}
    answered = await allowing.options("/v1/completions", headers=allowed)
    assert answered.status_code == 200
    assert answered.headers["access-control-allow-origin"] == "http://app.example"


@pytest.mark.asyncio
async def test_tokenize_runs_off_the_event_loop(http, tokenizer, monkeypatch):
    """Issue 12: /tokenize ran the tokenizer on the event loop, so a 1 MB prompt held every
    other client (/health: 51 ms -> 1.3 s). Here the tokenizer blocks until /health has been
    answered: on the loop, it would wait forever."""
    answered = threading.Event()
    tokenizer_type, real_call = type(tokenizer), type(tokenizer).__call__

    def blocking_call(self, text, *args, **kwargs):
        if text == "block":
            assert answered.wait(10), "the tokenizer held the event loop"
        return real_call(self, text, *args, **kwargs)

    monkeypatch.setattr(tokenizer_type, "__call__", blocking_call)
    pending = asyncio.create_task(http.post("/tokenize", json={"prompt": "block"}))
    health = await http.get("/health")
    answered.set()
    assert health.status_code == 200
    assert (await pending).json()["count"] > 0
