"""The generation path of `service.api`: from a parsed OpenAI request to its answer.

A request is tokenized here (the API loads only the tokenizer), checked against the live
workers' `max_model_len` and the backlog, submitted to the workers through `KvrailClient`, and
answered from its response stream as one JSON object or as SSE events. A batch of prompts
is one engine request per prompt, their chunks merged as they come (`_merge`). A client that
goes away before the last chunk has its engine requests aborted: at once when it waited for
one JSON object, after `KVRAIL_RESUME_GRACE_S` when it read SSE, unless a reader came back by
then (`Readers`). `ApiState` is what every handler shares.

A chat request with `session_id` is the next turn of that streaming-input session: its
history is read from the session's response stream (so any API process can serve any turn),
its messages are templated after that history's tokens (`ChatTemplate.apply_continuation`),
the turn is submitted only if it is the session's next (`KvrailClient.submit_turn`: 409
otherwise) and answered from the chunks after the turns before. An aborted turn (the client
gone) closes the session.
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

from engine import chat_template_variables
from queueing.client import (
    KvrailClient,
    RedisDataLost,
    SessionError,
    StreamError,
    StreamTimeout,
)
from queueing.schema import (
    GenerateRequest,
    SchemaError,
    SessionHistory,
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
    RETRY_AFTER_BUSY_S,
    ApiError,
    ParseContext,
    ParsedRequest,
    Prompt,
    StreamEvents,
    StreamShape,
    TokenStrings,
    build_response,
    chunk_error,
)
from service.settings import Settings
from service.sse import EventStreamResponse, wait_for_disconnect

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

    async def attach(self, request_ids: list[str]) -> str:
        """A new reader of the engine requests `request_ids` (one HTTP request's), connected
        until `leave`; returns its name."""
        reader = uuid.uuid4().hex
        if self._grace_s > 0:
            await asyncio.gather(
                *(self._client.hold_reader(r, reader, self._ttl_s) for r in request_ids)
            )
        return reader

    async def leave(self, request_ids: list[str], reader: str, *, knew_id: bool) -> None:
        """`reader` left before the end: abort each request unless a reader is back within
        the grace. A reader that never learned the request id (the first event carries it)
        cannot come back: its requests are aborted at once, not left generating for the
        grace."""
        if self._grace_s == 0 or not knew_id:
            await _abort(self._client, request_ids)
            return
        for request_id in request_ids:
            try:
                await self._client.hold_reader(request_id, reader, self._ttl_s, self._grace_s)
            except RedisError as e:  # best effort, like the abort it stands for
                logger.warning("cannot record that a reader of %s left: %s", request_id, e)
                continue
            # A check of its own, started after this write: one started before may have read
            # the readers before it and stopped, seeing this reader still connected.
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
    started: int = field(default_factory=lambda: int(time.time()))
    client: KvrailClient = field(init=False)
    workers: WorkerView = field(init=False)
    readers: Readers = field(init=False)
    token_str: TokenStrings = field(init=False)
    parse_context: ParseContext = field(init=False)

    def __post_init__(self) -> None:
        self.token_str = TokenStrings(self.tokenizer)
        self.parse_context = ParseContext(
            self.model_name,
            len(self.tokenizer),
            chat_template_variables(self.tokenizer),
            self.settings.unknown_fields,
        )

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


async def _tokenize(
    state: ApiState, parsed: ParsedRequest, history: SessionHistory | None
) -> list[Prompt]:
    """The prompts' tokens; a session's later turn: its history's, then its own."""
    tokenizer = state.tokenizer

    def prompt(given: str | list[int]) -> Prompt:
        token_ids = given if isinstance(given, list) else tokenizer(given).input_ids
        if not parsed.echo:
            return Prompt(token_ids)
        return Prompt(token_ids, given if isinstance(given, str) else tokenizer.decode(given))

    def tokenize() -> list[Prompt]:
        if history is not None and history.num_turns:
            so_far = history.token_ids
            turn = parsed.chat_template.apply_continuation(tokenizer, parsed.messages, so_far)
            return [Prompt(so_far + turn)]
        if parsed.kind == "chat":
            return [Prompt(parsed.chat_template.apply(tokenizer, parsed.messages))]
        return [prompt(given) for given in parsed.prompts]

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


async def _check_backlog(state: ApiState, num_requests: int) -> None:
    if await state.client.backlog() + num_requests > state.settings.max_pending:
        raise retry_later(
            429,
            "Too many requests are waiting; try again later",
            "rate_limit_error",
            "rate_limit_exceeded",
            RETRY_AFTER_BUSY_S,
        )


async def _session_history(state: ApiState, session_id: str) -> SessionHistory:
    """The session's turns so far, if it can take its next one now; else 409."""

    def conflict(message: str) -> ApiError:
        return ApiError(409, message, param="session_id", code="session_conflict")

    try:
        history = await state.client.session_history(session_id)
    except SchemaError:
        raise conflict(f"'{session_id}' is the id of a request that is not a session") from None
    if history.failed:
        raise conflict(f"Session '{session_id}' is closed")
    if not history.ended:
        raise conflict(f"Turn {history.num_turns - 1} of session '{session_id}' is still running")
    return history


async def serve_generation(request: Request, parsed: ParsedRequest) -> Response:
    """Check capacity, submit, and answer as one JSON object or as an SSE stream."""
    state = state_of(request)
    if len(parsed.prompts) > state.settings.max_pending:  # would never fit in the backlog
        raise ApiError(
            400,
            f"'prompt' holds {len(parsed.prompts)} prompts, more than the "
            f"{state.settings.max_pending} requests this server queues",
            param="prompt",
        )
    history = None
    if parsed.session_id is not None:
        history = await _session_history(state, parsed.session_id)
    prompts = await _tokenize(state, parsed, history)
    max_model_len = await state.serving_max_model_len()
    for prompt in prompts:
        _check_length(len(prompt.token_ids), parsed.max_tokens, max_model_len)
        if parsed.sampling.get("prompt_logprobs") is not None:
            try:
                check_prompt_logprobs_size(
                    len(prompt.token_ids), parsed.sampling["prompt_logprobs"]
                )
            except SchemaError as e:
                raise ApiError(400, str(e), param="prompt_logprobs") from None
    await _check_backlog(state, len(prompts))
    turn, after_seq = (history.num_turns, history.last_seq) if history else (0, -1)
    num_history_tokens = len(history.token_ids) if history else 0
    generates = [
        GenerateRequest(
            request_id,
            prompt_token_ids=prompt.token_ids[num_history_tokens:],
            sampling=parsed.sampling,
            priority=parsed.priority,
            beam_search=parsed.beam_search,
            turn=turn,
            resumable=history is not None,
        )
        for request_id, prompt in zip(parsed.engine_request_ids, prompts, strict=True)
    ]
    try:
        for generate in generates:
            generate.validate()
    except SchemaError as e:
        raise ApiError(400, str(e)) from None
    if not parsed.stream:
        await _submit(state.client, generates)
        return await _answer_whole(request, state, parsed, prompts, turn, after_seq)
    shape = StreamShape(
        parsed.kind,
        parsed.request_id,
        state.model_name,
        parsed.created,
        parsed.include_usage,
        sum(len(prompt.token_ids) for prompt in prompts),
        num_prompts=len(prompts),
        n=parsed.n,
        top_logprobs=parsed.sampling.get("logprobs"),
        echo=[prompt.echo for prompt in prompts] if parsed.echo else None,
        echo_only=parsed.echo_only,
        tool_choice=parsed.tool_choice,
        turn=turn,
        after_seq=after_seq,
    )
    # Kept for `/v1/streams/{id}`, which must shape a resumed stream the same way.
    await state.client.save_sse_shape(
        parsed.request_id, shape.to_json(), state.settings.response_ttl_s
    )
    if parsed.session_id is None:
        reader = await state.readers.attach(shape.request_ids)
        await _submit(state.client, generates)
    else:  # a session's turn: submitting it forgets the last turn's readers, so marked after
        await _submit(state.client, generates)
        reader = await state.readers.attach(shape.request_ids)
    return event_stream(state, shape, [after_seq] * len(prompts), reader, knew_id=False)


async def _submit(client: KvrailClient, generates: list[GenerateRequest]) -> None:
    """Submit every engine request, or none: on a failure (or a cancel) those submitted, the
    one in flight among them, are aborted. A session's turn is submitted only if it is the
    session's next (409 if not: another request took that turn, or the session closed)."""
    for i, generate in enumerate(generates):
        try:
            if generate.is_session:
                await client.submit_turn(generate)
            else:
                await client.submit(generate)
        except SessionError as e:
            raise ApiError(409, str(e), param="session_id", code="session_conflict") from None
        except BaseException:
            await _abort(client, [g.request_id for g in generates[: i + 1]])
            raise


async def _answer_whole(
    request: Request,
    state: ApiState,
    parsed: ParsedRequest,
    prompts: list[Prompt],
    turn: int,
    after_seq: int,
) -> Response:
    """Collect every chunk (of a session's `turn`: those after `after_seq`), aborting the
    requests if the client disconnects first."""
    request_ids = parsed.engine_request_ids
    collect = asyncio.create_task(_collect(state.client, request_ids, turn, after_seq))
    gone = asyncio.create_task(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():
            collect.cancel()
    if not collect.done() or collect.cancelled():
        await _abort(state.client, request_ids)
        return Response(status_code=STATUS_CLIENT_GONE)
    try:
        results = collect.result()
    except StreamError as e:
        await _abort(state.client, request_ids)
        raise _stream_failure(e) from None
    failed = next((c[-1] for c in results if c and c[-1].error is not None), None)
    if failed is not None:  # a failed prompt fails the batch: the others are cut short
        ended = [bool(c) and c[-1].is_last for c in results]
        unfinished = [r for r, done in zip(request_ids, ended, strict=True) if not done]
        await _abort(state.client, unfinished)
        raise chunk_error(failed)
    body = build_response(parsed, state.model_name, results, prompts, state.token_str)
    return JSONResponse(body)


async def _abort(client: KvrailClient, request_ids: list[str]) -> None:
    """Abort requests, best effort: with Redis down the abort cannot be sent, and raising
    here would replace the answer the client is owed (the error) with a broken response."""
    with contextlib.suppress(RedisError):
        for request_id in request_ids:
            await client.abort(request_id)


async def _collect(
    client: KvrailClient, request_ids: list[str], turn: int, after_seq: int
) -> list[list[TokenChunk]]:
    """Each request's chunks, until every one has ended or one has failed."""
    results: list[list[TokenChunk]] = [[] for _ in request_ids]
    streams = _merge([client.stream(r, after_seq, turn=turn) for r in request_ids])
    async with contextlib.aclosing(streams) as chunks:
        async for index, chunk in chunks:
            results[index].append(chunk)
            if chunk.error is not None:
                break
    return results


async def _merge(
    streams: list[AsyncIterator[TokenChunk]],
) -> AsyncIterator[tuple[int, TokenChunk]]:
    """The chunks of several streams as they come, each with its stream's index, until all
    have ended; the first error of one is raised. Closing it stops them all."""
    queue: asyncio.Queue[tuple[int, TokenChunk | Exception | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[TokenChunk]) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((index, chunk))
        except Exception as e:
            queue.put_nowait((index, e))
        else:
            queue.put_nowait((index, None))  # this stream has ended

    pumps = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(pumps)
        while running:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                running -= 1
            else:
                yield index, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def _stream_failure(error: StreamError) -> ApiError:
    if isinstance(error, StreamTimeout):
        return ApiError(504, str(error), type="timeout_error", code="worker_timeout")
    if isinstance(error, RedisDataLost):
        return redis_unavailable(str(error))
    return ApiError(500, str(error), type="server_error", code="stream_error")


def event_stream(
    state: ApiState, shape: StreamShape, after: list[int], reader: str, *, knew_id: bool
) -> EventStreamResponse:
    """The SSE response for `shape.request_id`'s chunks after `after` (per prompt, the seq of
    the last chunk the client has), ending [DONE], read by `reader` (`Readers.attach`), who
    leaves unless the response ends with the streams; `knew_id`: the reader came with the
    request id (else it learns it from the first event). Every chunk is read from the first
    (of a session's turn: its first), for `StreamEvents` to know what the client had."""
    finished = False
    request_ids = shape.request_ids

    async def events() -> AsyncIterator[str]:
        nonlocal finished, knew_id
        shaper = StreamEvents(shape, state.token_str, after)
        streams = _merge(
            [state.client.stream(r, shape.after_seq, turn=shape.turn) for r in request_ids]
        )
        try:
            for event in shaper.start():
                yield event
                knew_id = True  # resumed once an event is sent: the client has the id
            async with contextlib.aclosing(streams) as chunks:
                async for index, chunk in chunks:
                    for event in shaper.for_chunk(index, chunk):
                        yield event
                        knew_id = True
                    if chunk.error is not None:  # a failed prompt ends the stream
                        await _abort(state.client, shaper.unfinished)
                        break
        except StreamError as e:
            await _abort(state.client, request_ids)
            yield StreamEvents.error(_stream_failure(e))
        finished = True
        yield StreamEvents.done()

    async def leave_unless_finished() -> None:
        if not finished:
            await state.readers.leave(request_ids, reader, knew_id=knew_id)

    return EventStreamResponse(events(), leave_unless_finished)
