"""The generation path of `service.api`: from a parsed OpenAI request to its answer.

A request is tokenized here (the API loads only the tokenizer), checked against the live
workers' `max_model_len` and the backlog, submitted to the workers through `KvrailClient`, and
answered from its response stream as one JSON object or as SSE events. A client that goes
away before the last chunk has its request aborted: at once when it waited for one JSON
object, after `KVRAIL_RESUME_GRACE_S` when it read SSE, unless a reader came back by then
(`Readers`). `ApiState` is what every handler shares.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import apply_chat_template
from queueing.client import KvrailClient, RedisDataLost, StreamError, StreamTimeout
from queueing.schema import (
    GenerateRequest,
    SchemaError,
    TokenChunk,
    WorkerInfo,
    check_prompt_logprobs_size,
)
from service.middleware import (
    RETRY_AFTER_NO_WORKER_S,
    STATUS_CLIENT_GONE,
    redis_unavailable,
    retry_later,
)
from service.openai_protocol import (
    ApiError,
    ParsedRequest,
    StreamEvents,
    StreamShape,
    TokenStrings,
    build_response,
)
from service.settings import Settings
from service.sse import EventStreamResponse, wait_for_disconnect

RETRY_AFTER_BUSY_S = 1

logger = logging.getLogger("kvrail.api")


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


class Readers:
    """The SSE readers of streaming requests, and the abort of a request nobody reads.

    A client whose connection drops may resume with `/v1/streams/{id}`, possibly on another
    API process, so who reads a request is kept in Redis (`KvrailClient.hold_reader`), not
    here: each SSE response is a reader from its start, and when it leaves before the last
    event it becomes a reader due back within the grace period. The API process where a
    reader left checks once the last grace has run out and aborts the request if no reader is
    connected and the request has not finished (a reader still connected checks when it
    leaves). Grace 0 aborts at once, as a non-streaming request always does.

    An API process that stops cancels its pending checks, and one that dies leaves its
    connected readers marked: those requests then run to their end instead of being aborted.
    """

    def __init__(self, client: KvrailClient, grace_s: float, ttl_s: int) -> None:
        self._client = client
        self._grace_s = grace_s
        self._ttl_s = ttl_s
        self._checks: set[asyncio.Task[None]] = set()

    async def attach(self, request_id: str) -> str:
        """A new reader of `request_id`, connected until `leave`; returns its name."""
        reader = uuid.uuid4().hex
        if self._grace_s > 0:
            await self._client.hold_reader(request_id, reader, self._ttl_s)
        return reader

    async def leave(self, request_id: str, reader: str, *, knew_id: bool) -> None:
        """`reader` left before the end: abort unless a reader is back within the grace. A
        reader that never learned the request id (the first event carries it) cannot come
        back: its request is aborted at once, not left generating for the grace."""
        if self._grace_s == 0 or not knew_id:
            await _abort(self._client, request_id)
            return
        try:
            await self._client.hold_reader(request_id, reader, self._ttl_s, self._grace_s)
        except RedisError as e:  # best effort, like the abort it stands for
            logger.warning("cannot record that a reader of %s left: %s", request_id, e)
            return
        # A check of its own, started after this write: one started before may have read the
        # readers before it and stopped, seeing this reader still connected.
        check = asyncio.create_task(self._abort_when_unread(request_id))
        self._checks.add(check)
        check.add_done_callback(self._checks.discard)

    async def _abort_when_unread(self, request_id: str) -> None:
        try:
            while (wait_s := await self._client.unread_in(request_id)) is not None:
                if wait_s == 0:
                    await self._client.abort(request_id)
                    return
                await asyncio.sleep(wait_s)
        except RedisError as e:
            logger.warning("cannot check the readers of %s: %s", request_id, e)

    def close(self) -> None:
        """Cancel the pending checks (their requests run to their end)."""
        for check in list(self._checks):
            check.cancel()


@dataclass
class ApiState:
    """Everything the handlers share; built by `create_app`, opened by its lifespan."""

    model_name: str
    tokenizer: Any
    settings: Settings
    max_model_len: int | None  # used when no worker reports one (/tokenize only)
    worker_cache_s: float
    started: int = field(default_factory=lambda: int(time.time()))
    client: KvrailClient = field(init=False)
    workers: WorkerView = field(init=False)
    readers: Readers = field(init=False)
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
            raise retry_later(
                503,
                "No worker is serving requests; try again later",
                "service_unavailable_error",
                "no_worker",
                RETRY_AFTER_NO_WORKER_S,
            )
        return min(w.max_model_len for w in live)


def state_of(request: Request) -> ApiState:
    return request.app.state.api


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object: 415 unless sent as application/json (a `text/plain` POST
    needs no CORS preflight, so a page of any origin could send one: issue 12), 413 past
    `max_bytes` (declared or streamed), else 400."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(
            415,
            f"Content-Type must be application/json, got {media_type or 'none'!r}",
            code="unsupported_media_type",
        )
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
    except RecursionError:  # 200,000 `[` made a 500 (issue 12)
        raise ApiError(400, "The body is not valid JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"The body is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ApiError(400, "The body must be a JSON object")
    return value


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"The body exceeds {max_bytes} bytes", code="request_too_large")


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
    if await state.client.backlog() >= state.settings.max_pending:
        raise retry_later(
            429,
            "Too many requests are waiting; try again later",
            "rate_limit_error",
            "rate_limit_exceeded",
            RETRY_AFTER_BUSY_S,
        )


async def serve_generation(request: Request, parsed: ParsedRequest) -> Response:
    """Check capacity, submit, and answer as one JSON object or as an SSE stream."""
    state = state_of(request)
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
    await state.client.save_sse_shape(
        parsed.request_id, shape.to_json(), state.settings.response_ttl_s
    )
    reader = await state.readers.attach(parsed.request_id)
    await state.client.submit(generate)
    return event_stream(state, shape, after_seq=-1, reader=reader, knew_id=False)


async def _answer_whole(
    request: Request, state: ApiState, parsed: ParsedRequest, prompt_tokens: int
) -> Response:
    """Collect every chunk, aborting the request if the client disconnects first."""
    collect = asyncio.create_task(_collect(state.client.stream(parsed.request_id)))
    gone = asyncio.create_task(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():
            collect.cancel()
    if not collect.done() or collect.cancelled():
        await _abort(state.client, parsed.request_id)
        return Response(status_code=STATUS_CLIENT_GONE)
    try:
        chunks = collect.result()
    except StreamError as e:
        await _abort(state.client, parsed.request_id)
        raise _stream_failure(e) from None
    last = chunks[-1]
    if last.error is not None:
        raise ApiError(500, last.error, type="server_error", code="worker_error")
    body = build_response(parsed, state.model_name, chunks, prompt_tokens, state.token_str)
    return JSONResponse(body)


async def _abort(client: KvrailClient, request_id: str) -> None:
    """Abort a request, best effort: with Redis down the abort cannot be sent, and raising
    here would replace the answer the client is owed (the error) with a broken response."""
    with contextlib.suppress(RedisError):
        await client.abort(request_id)


async def _collect(chunks: AsyncIterator[TokenChunk]) -> list[TokenChunk]:
    return [chunk async for chunk in chunks]


def _stream_failure(error: StreamError) -> ApiError:
    if isinstance(error, StreamTimeout):
        return ApiError(504, str(error), type="timeout_error", code="worker_timeout")
    if isinstance(error, RedisDataLost):
        return redis_unavailable(str(error))
    return ApiError(500, str(error), type="server_error", code="stream_error")


def event_stream(
    state: ApiState, shape: StreamShape, after_seq: int, reader: str, *, knew_id: bool
) -> EventStreamResponse:
    """The SSE response for `shape.request_id`'s chunks after `after_seq`, ending [DONE], read
    by `reader` (`Readers.attach`), who leaves unless the response ends with the stream;
    `knew_id`: the reader came with the request id (else it learns it from the first event)."""
    finished = False

    async def events() -> AsyncIterator[str]:
        nonlocal finished, knew_id
        shaper = StreamEvents(shape, state.token_str, send_roles=after_seq < 0)
        try:
            async for chunk in state.client.stream(shape.request_id, after_seq):
                for event in shaper.for_chunk(chunk):
                    yield event
                    knew_id = True  # resumed once the event is sent: the client has the id
        except StreamError as e:
            await _abort(state.client, shape.request_id)
            yield StreamEvents.error(_stream_failure(e))
        finished = True
        yield StreamEvents.done()

    async def leave_unless_finished() -> None:
        if not finished:
            await state.readers.leave(shape.request_id, reader, knew_id=knew_id)

    return EventStreamResponse(events(), leave_unless_finished)
