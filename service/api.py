"""`kvrail api`: the OpenAI-compatible HTTP front end (Starlette on uvicorn).

Each generation request is validated, tokenized here (the API loads only the tokenizer),
checked against the live workers' `max_model_len`, appended to `kvrail:requests` and answered
from `kvrail:resp:{id}` through the client's single response reader. A client that goes away
before the last chunk has its request aborted. The API key (when set) guards `/v1/*`,
`/tokenize` and `/detokenize`; `/health`, `/metrics` and `/openapi.json` stay open for probes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine import apply_chat_template, envs, loader
from engine.loader import resolve_model
from queueing.client import KvrailClient, RedisDataLost, StreamError, StreamTimeout
from queueing.schema import (
    GenerateRequest,
    SchemaError,
    TokenChunk,
    WorkerInfo,
    check_prompt_logprobs_size,
    keys,
)
from service import metrics
from service.openai_protocol import (
    ApiError,
    ParsedRequest,
    StreamEvents,
    StreamShape,
    TokenStrings,
    build_response,
    check_model,
    get_field,
    parse_chat,
    parse_completion,
    parse_messages,
)
from service.openapi import openapi_document

logger = logging.getLogger("kvrail.api")

RETRY_AFTER_BUSY_S = 1
RETRY_AFTER_NO_WORKER_S = 5
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_STATUS_CLIENT_GONE = 499  # nginx's "client closed request", for the metrics


@lru_cache(maxsize=4)
def _load_tokenizer(tokenizer_dir: str) -> Any:
    from engine.loader import load_tokenizer

    return load_tokenizer(Path(tokenizer_dir))


class WorkerView:
    """The live workers, re-read from Redis at most every `ttl_s` (SCAN is O(keyspace)).

    An empty read is never reused: a worker that has just come up must be served at once,
    or a client that saw `/health` turn 200 would get a 503 for the rest of the window."""

    def __init__(self, client: KvrailClient, ttl_s: float) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._workers: list[WorkerInfo] = []
        self._read_at = float("-inf")

    async def live(self) -> list[WorkerInfo]:
        if not self._workers or time.monotonic() - self._read_at >= self._ttl_s:
            self._workers = await self._client.workers()
            self._read_at = time.monotonic()
        return self._workers


@dataclass
class ApiState:
    """Everything the handlers share; built by `create_app`, opened by its lifespan."""

    model_name: str
    tokenizer: Any
    api_key: str | None
    max_body_bytes: int
    max_pending: int
    chunk_timeout_s: float
    response_ttl_s: int
    max_model_len: int | None  # used when no worker reports one (/tokenize only)
    worker_cache_s: float
    started: int = field(default_factory=lambda: int(time.time()))
    client: KvrailClient = field(init=False)
    workers: WorkerView = field(init=False)
    token_str: TokenStrings = field(init=False)

    def __post_init__(self) -> None:
        self.token_str = TokenStrings(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    async def serving_max_model_len(self) -> int:
        """The smallest max_model_len of the live workers; 503 when none is alive."""
        live = await self.workers.live()
        if not live:
            raise ApiError(
                503,
                "No worker is serving requests; try again later",
                type="service_unavailable_error",
                code="no_worker",
                headers={"Retry-After": str(RETRY_AFTER_NO_WORKER_S)},
            )
        return min(w.max_model_len for w in live)


def _state(request: Request) -> ApiState:
    return request.app.state.api


# ---- request bodies ----------------------------------------------------------------------------


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object; 413 past `max_bytes` (declared or streamed), else 400."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"The body is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ApiError(400, "The body must be a JSON object")
    return value


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"The body exceeds {max_bytes} bytes", code="request_too_large")


# ---- generation --------------------------------------------------------------------------------


async def _prompt_token_ids(state: ApiState, parsed: ParsedRequest) -> list[int]:
    tokenizer = state.tokenizer

    def tokenize() -> list[int]:
        if parsed.prompt_token_ids is not None:
            return parsed.prompt_token_ids
        if parsed.prompt is not None:
            return tokenizer(parsed.prompt).input_ids
        return apply_chat_template(tokenizer, parsed.messages)[1]

    try:
        return await asyncio.to_thread(tokenize)
    except ApiError:
        raise
    except Exception as e:  # a chat template can raise anything (jinja, its own checks)
        param = "messages" if parsed.kind == "chat" else "prompt"
        raise ApiError(400, f"Cannot tokenize the {param}: {e}", param=param) from None


def _check_length(prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
    if prompt_len >= max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {prompt_len} tokens",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens; the prompt "
            f"({prompt_len}) plus max_tokens ({max_tokens}) exceeds it",
            param="max_tokens",
            code="context_length_exceeded",
        )


async def _check_backlog(state: ApiState) -> None:
    if await state.client.backlog() >= state.max_pending:
        raise ApiError(
            429,
            "Too many requests are waiting; try again later",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(RETRY_AFTER_BUSY_S)},
        )


async def serve_generation(request: Request, parsed: ParsedRequest) -> Response:
    """Check capacity, submit, and answer as one JSON object or as an SSE stream."""
    state = _state(request)
    prompt_ids = await _prompt_token_ids(state, parsed)
    _check_length(
        len(prompt_ids), parsed.sampling["max_tokens"], await state.serving_max_model_len()
    )
    if parsed.sampling.get("prompt_logprobs") is not None:
        try:
            check_prompt_logprobs_size(len(prompt_ids), parsed.sampling["prompt_logprobs"])
        except SchemaError as e:
            raise ApiError(400, str(e), param="prompt_logprobs") from None
    await _check_backlog(state)
    generate = GenerateRequest(
        parsed.request_id, prompt_token_ids=prompt_ids, sampling=parsed.sampling
    )
    try:
        generate.validate()
    except SchemaError as e:
        raise ApiError(400, str(e)) from None
    if not parsed.stream:
        await state.client.submit(generate)
        return await _answer_whole(request, state, parsed, len(prompt_ids))
    shape = StreamShape(
        parsed.kind,
        parsed.request_id,
        state.model_name,
        parsed.created,
        parsed.include_usage,
        len(prompt_ids),
    )
    # Kept for `/v1/streams/{id}`, which must shape a resumed stream the same way.
    await state.client.redis.set(
        keys.sse(parsed.request_id), shape.to_json(), ex=state.response_ttl_s
    )
    await state.client.submit(generate)
    return _event_stream(state, shape, after_seq=-1)


async def _answer_whole(
    request: Request, state: ApiState, parsed: ParsedRequest, prompt_tokens: int
) -> Response:
    """Collect every chunk, aborting the request if the client disconnects first."""
    collect = asyncio.create_task(_collect(state.client.stream(parsed.request_id)))
    gone = asyncio.create_task(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():
            collect.cancel()
    if not collect.done() or collect.cancelled():
        await _abort(state, parsed.request_id)
        return Response(status_code=_STATUS_CLIENT_GONE)
    try:
        chunks = collect.result()
    except StreamError as e:
        await _abort(state, parsed.request_id)
        raise _stream_failure(e) from None
    last = chunks[-1]
    if last.error is not None:
        raise ApiError(500, last.error, type="server_error", code="worker_error")
    body = build_response(parsed, state.model_name, chunks, prompt_tokens, state.token_str)
    return JSONResponse(body)


async def _abort(state: ApiState, request_id: str) -> None:
    """Abort a request, best effort: with Redis down the abort cannot be sent, and raising
    here would replace the answer the client is owed (the error) with a broken response."""
    with contextlib.suppress(RedisError):
        await state.client.abort(request_id)


async def _collect(chunks: AsyncIterator[TokenChunk]) -> list[TokenChunk]:
    return [chunk async for chunk in chunks]


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _stream_failure(error: StreamError) -> ApiError:
    if isinstance(error, StreamTimeout):
        return ApiError(504, str(error), type="timeout_error", code="worker_timeout")
    if isinstance(error, RedisDataLost):
        return _redis_unavailable(str(error))
    return ApiError(500, str(error), type="server_error", code="stream_error")


# ---- server-sent events ------------------------------------------------------------------------


class EventStreamResponse(Response):
    """An SSE response that notices a client disconnect and calls `on_disconnect`.

    The events are sent by one task while another waits for `http.disconnect`; whichever ends
    first stops the other, so a client that leaves during a silent stretch is still seen.
    """

    def __init__(
        self, events: AsyncIterator[str], on_disconnect: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__()
        # Set whole: the base class would declare `content-length: 0` for the empty body.
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        self.events = events
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        send_task = asyncio.create_task(self._send_all(send))
        gone = asyncio.create_task(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({send_task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (send_task, gone):
                task.cancel()
        disconnected = gone.done() and not gone.cancelled()
        if not disconnected and send_task.done() and not send_task.cancelled():
            disconnected = isinstance(send_task.exception(), OSError)
            if not disconnected and send_task.exception() is not None:
                raise send_task.exception()
        if disconnected:
            await self.on_disconnect()

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _event_stream(state: ApiState, shape: StreamShape, after_seq: int) -> EventStreamResponse:
    """The SSE response for `shape.request_id`'s chunks after `after_seq`, ending [DONE]."""
    finished = False

    async def events() -> AsyncIterator[str]:
        nonlocal finished
        shaper = StreamEvents(shape, state.token_str, send_roles=after_seq < 0)
        try:
            async for chunk in state.client.stream(shape.request_id, after_seq):
                for event in shaper.for_chunk(chunk):
                    yield event
        except StreamError as e:
            await _abort(state, shape.request_id)
            yield StreamEvents.error(_stream_failure(e))
        finished = True
        yield StreamEvents.done()

    async def abort_unless_finished() -> None:
        if not finished:
            await _abort(state, shape.request_id)

    return EventStreamResponse(events(), abort_unless_finished)


# ---- handlers ----------------------------------------------------------------------------------


async def completions(request: Request) -> Response:
    state = _state(request)
    body = await read_json(request, state.max_body_bytes)
    return await serve_generation(
        request, parse_completion(body, state.model_name, state.vocab_size)
    )


async def chat_completions(request: Request) -> Response:
    state = _state(request)
    body = await read_json(request, state.max_body_bytes)
    return await serve_generation(request, parse_chat(body, state.model_name, state.vocab_size))


async def resume_stream(request: Request) -> Response:
    """Re-attach to a streaming request: the chunks after `Last-Event-ID` (default: all)."""
    state = _state(request)
    request_id = request.path_params["request_id"]
    last_event_id = request.headers.get("last-event-id", "-1").strip()
    try:
        after_seq = int(last_event_id)
    except ValueError:
        raise ApiError(400, "Last-Event-ID must be an integer seq", param="Last-Event-ID") from None
    if after_seq < -1:
        raise ApiError(400, "Last-Event-ID must be >= -1", param="Last-Event-ID")
    stored = await state.client.redis.get(keys.sse(request_id))
    if stored is None:
        raise ApiError(404, f"No stream for request '{request_id}' (unknown or expired)")
    return _event_stream(state, StreamShape.from_json(stored), after_seq)


async def list_models(request: Request) -> Response:
    state = _state(request)
    live = await state.workers.live()
    max_model_len = min((w.max_model_len for w in live), default=state.max_model_len)
    model = {
        "id": state.model_name,
        "object": "model",
        "created": state.started,
        "owned_by": "kvrail",
        "root": state.model_name,
        "parent": None,
        "max_model_len": max_model_len,
    }
    return JSONResponse({"object": "list", "data": [model]})


async def health(request: Request) -> Response:
    """200 when Redis answers and a worker heartbeat is alive, else 503."""
    state = _state(request)
    try:
        await state.client.redis.ping()
        live = await state.workers.live()
    except Exception as e:  # any Redis failure means unhealthy, whatever its type
        raise _redis_unavailable(f"Redis is unreachable: {e}") from None
    if not live:
        await state.serving_max_model_len()  # raises the 503
    return JSONResponse({"status": "ok", "workers": len(live)})


async def prometheus_metrics(request: Request) -> Response:
    return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)


async def tokenize(request: Request) -> Response:
    """vLLM's /tokenize: a `prompt` (special tokens added) or chat `messages` (templated)."""
    state = _state(request)
    body = await read_json(request, state.max_body_bytes)
    check_model(body, state.model_name, required=False)
    if "messages" in body:
        tokens = await _tokenize_messages(state, body)
    else:
        prompt = get_field(body, "prompt", (str,))
        if prompt is None:
            raise ApiError(400, "'prompt' or 'messages' is required", param="prompt")
        add_special = get_field(body, "add_special_tokens", (bool,), True)
        tokens = state.tokenizer(prompt, add_special_tokens=add_special).input_ids
    strs = None
    if get_field(body, "return_token_strs", (bool,), False):
        strs = state.tokenizer.convert_ids_to_tokens(tokens)
    live = await state.workers.live()
    return JSONResponse(
        {
            "count": len(tokens),
            "max_model_len": min((w.max_model_len for w in live), default=state.max_model_len),
            "tokens": tokens,
            "token_strs": strs,
        }
    )


async def _tokenize_messages(state: ApiState, body: dict[str, Any]) -> list[int]:
    messages = parse_messages(body["messages"])
    add_generation_prompt = get_field(body, "add_generation_prompt", (bool,), True)
    add_special = get_field(body, "add_special_tokens", (bool,), False)
    try:
        return apply_chat_template(
            state.tokenizer,
            messages,
            add_generation_prompt=add_generation_prompt,
            add_special_tokens=add_special,
        )[1]
    except Exception as e:  # a chat template can raise anything
        raise ApiError(400, f"Cannot apply the chat template: {e}", param="messages") from None


async def detokenize(request: Request) -> Response:
    state = _state(request)
    body = await read_json(request, state.max_body_bytes)
    check_model(body, state.model_name, required=False)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < state.vocab_size for t in tokens
    ):
        raise ApiError(400, "'tokens' must be an array of token ids", param="tokens")
    return JSONResponse({"prompt": state.tokenizer.decode(tokens)})


async def openapi(request: Request) -> Response:
    return JSONResponse(openapi_document(_state(request).model_name))


# ---- errors, auth, metrics ---------------------------------------------------------------------


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code)
    error = ApiError(
        exc.status_code,
        f"{exc.detail}: {request.method} {request.url.path}",
        type=kind or "invalid_request_error",
        headers=dict(exc.headers or {}),
    )
    return await _api_error(request, error)


def _redis_unavailable(message: str) -> ApiError:
    return ApiError(
        503,
        message,
        type="service_unavailable_error",
        code="redis_unavailable",
        headers={"Retry-After": str(RETRY_AFTER_NO_WORKER_S)},
    )


async def _redis_error(request: Request, exc: Exception) -> Response:
    """Redis down (or restarting) is the service being unavailable, not a server bug: 503
    with Retry-After, so clients back off and retry."""
    logger.warning("redis error on %s %s: %s", request.method, request.url.path, exc)
    return await _api_error(request, _redis_unavailable(f"Redis is unavailable: {exc}"))


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The client left while its body was read: nobody to answer, nothing to log as a fault."""
    return Response(status_code=_STATUS_CLIENT_GONE)


async def _server_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    error = ApiError(500, "Internal server error", type="server_error")
    return JSONResponse(error.body(), status_code=500)


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches, on the protected paths."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.expected is None
            or scope["type"] != "http"
            or not scope["path"].startswith(_PROTECTED_PREFIXES)
        ):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        error = ApiError(
            401, "Invalid or missing API key", type="authentication_error", code="invalid_api_key"
        )
        response = JSONResponse(error.body(), 401, {"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class HttpMetricsMiddleware:
    """Counts requests by route template and status, and times them to the last byte."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = _STATUS_CLIENT_GONE

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        metrics.http_requests_in_progress.inc()
        try:
            await self.app(scope, receive, send_with_status)
        finally:
            metrics.http_requests_in_progress.dec()
            route = getattr(scope.get("route"), "path", "unmatched")
            method = scope["method"]
            metrics.http_requests.labels(route, method, str(status)).inc()
            metrics.http_request_duration_seconds.labels(route, method).observe(
                time.perf_counter() - start
            )


# ---- app ---------------------------------------------------------------------------------------


def create_app(
    redis_url: str,
    model_name: str,
    tokenizer_dir: str | Path,
    api_key: str | None = None,
    *,
    max_body_bytes: int | None = None,
    max_pending: int | None = None,
    chunk_timeout_s: float | None = None,
    max_model_len: int | None = None,
    worker_cache_s: float = 1.0,
) -> Starlette:
    """The API app serving `model_name` with the tokenizer in `tokenizer_dir`.

    Unset limits come from `engine.envs` (KVRAIL_API_KEY, KVRAIL_MAX_BODY_BYTES,
    KVRAIL_MAX_PENDING, KVRAIL_STREAM_TIMEOUT_S). `max_model_len` is only reported when no
    worker is alive; `worker_cache_s` is how long a read of the worker heartbeats is reused.
    The Redis client and its response reader live for the app's lifespan.
    """
    state = ApiState(
        model_name=model_name,
        tokenizer=_load_tokenizer(str(tokenizer_dir)),
        api_key=api_key if api_key is not None else envs.KVRAIL_API_KEY,
        max_body_bytes=max_body_bytes or envs.KVRAIL_MAX_BODY_BYTES,
        max_pending=max_pending or envs.KVRAIL_MAX_PENDING,
        chunk_timeout_s=chunk_timeout_s or envs.KVRAIL_STREAM_TIMEOUT_S,
        response_ttl_s=envs.KVRAIL_RESPONSE_TTL_S,
        max_model_len=max_model_len,
        worker_cache_s=worker_cache_s,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with KvrailClient(redis_url, chunk_timeout_s=state.chunk_timeout_s) as client:
            state.client = client
            state.workers = WorkerView(client, worker_cache_s)
            yield

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/streams/{request_id}", resume_stream, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus_metrics, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            ApiError: _api_error,
            HTTPException: _http_error,
            RedisError: _redis_error,
            ClientDisconnect: _client_gone,
            Exception: _server_error,
        },
    )
    app.state.api = state
    app.add_middleware(ApiKeyMiddleware, api_key=state.api_key)
    app.add_middleware(HttpMetricsMiddleware)
    return app


class ApiServer(uvicorn.Server):
    """uvicorn without its own signal capture: the CLI owns SIGINT/SIGTERM and stops the API
    and the worker together (uvicorn would re-raise the signal after its own shutdown)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def build_api_server(
    host: str,
    port: int,
    redis_url: str,
    model: str | None,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    log_level: str = "info",
) -> ApiServer:
    """The API on uvicorn (uvloop), ready to `serve()`; stop it with `should_exit = True`.

    `model` is what the workers were given (HF folder or .gguf, None = the default GGUF);
    only its tokenizer is loaded here, never the weights.
    """
    tokenizer_dir = await asyncio.to_thread(resolve_model, model)
    name = served_model_name or loader.served_model_name(model)
    app = await asyncio.to_thread(create_app, redis_url, name, tokenizer_dir, api_key)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        log_config=None,  # logging is configured once by the CLI (service.logging)
        log_level=log_level,
        timeout_graceful_shutdown=int(envs.KVRAIL_SHUTDOWN_GRACE_S),
    )
    return ApiServer(config)
