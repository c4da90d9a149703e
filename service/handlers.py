"""The API's request handlers, one per route, and the routes themselves.

Generation (`/v1/completions`, `/v1/chat/completions`, `/v1/streams/{id}`) hands over to
`service.generation`; the rest answer from the tokenizer, the worker heartbeats and Redis.
"""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from service import metrics
from service.generation import ApiState, event_stream, read_json, serve_generation, state_of
from service.middleware import redis_unavailable
from service.openai_protocol import (
    ApiError,
    RequestBody,
    StreamShape,
    check_model,
    get_field,
    parse_chat,
    parse_chat_template,
    parse_completion,
    parse_event_id,
    parse_messages,
)
from service.openapi import openapi_document


async def completions(request: Request) -> Response:
    state = state_of(request)
    body = RequestBody(await read_json(request, state.settings.max_body_bytes))
    return await serve_generation(request, parse_completion(body, state.parse_context))


async def chat_completions(request: Request) -> Response:
    state = state_of(request)
    body = RequestBody(await read_json(request, state.settings.max_body_bytes))
    return await serve_generation(request, parse_chat(body, state.parse_context))


async def resume_stream(request: Request) -> Response:
    """Re-attach to a streaming request: the chunks after `Last-Event-ID` (default: all)."""
    state = state_of(request)
    request_id = request.path_params["request_id"]
    after = parse_event_id(request.headers.get("last-event-id", "-1"))
    stored = await state.client.sse_shape(request_id)
    if stored is None:
        raise ApiError(404, f"No stream for request '{request_id}' (unknown or expired)")
    shape = StreamShape.from_json(stored)
    if after == [-1]:  # none given (or -1): from the start (a session's: its turn's)
        after = [shape.after_seq] * shape.num_prompts
    if len(after) != shape.num_prompts:
        raise ApiError(
            400,
            f"Last-Event-ID must hold {shape.num_prompts} seqs, one per prompt",
            param="Last-Event-ID",
        )
    reader = await state.readers.attach(shape.request_ids)
    return event_stream(state, shape, after, reader, knew_id=True)


async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [await _model_card(state_of(request))]})


async def retrieve_model(request: Request) -> Response:
    """OpenAI's `GET /v1/models/{model}`: the served model, else 404 `model_not_found`."""
    state = state_of(request)
    check_model({"model": request.path_params["model"]}, state.model_name)
    return JSONResponse(await _model_card(state))


async def _model_card(state: ApiState) -> dict[str, Any]:
    """The served model as an OpenAI model object, with vLLM's fields (its `ModelCard`)."""
    live = await state.workers.live()
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.started,
        "owned_by": "kvrail",
        "root": state.model_name,
        "parent": None,
        "max_model_len": min((w.max_model_len for w in live), default=None),
    }


async def health(request: Request) -> Response:
    """200 when Redis answers and a worker heartbeat is alive, else 503."""
    state = state_of(request)
    try:
        await state.client.ping()
        live = await state.workers.live()
    except Exception as e:  # any Redis failure means unhealthy, whatever its type
        raise redis_unavailable(f"Redis is unreachable: {e}") from None
    if not live:
        await state.serving_max_model_len()  # raises the 503
    return JSONResponse({"status": "ok", "workers": len(live)})


async def prometheus_metrics(request: Request) -> Response:
    return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)


async def tokenize(request: Request) -> Response:
    """vLLM's /tokenize: a `prompt` (special tokens added) or chat `messages` (templated)."""
    state = state_of(request)
    body = await read_json(request, state.settings.max_body_bytes)
    check_model(body, state.model_name, required=False)
    if "messages" in body:
        tokens = await _tokenize_messages(state, body)
    else:
        prompt = get_field(body, "prompt", (str,))
        if prompt is None:
            raise ApiError(400, "'prompt' or 'messages' is required", param="prompt")
        add_special = get_field(body, "add_special_tokens", (bool,), True)
        # Tokenizing a large body takes long (1 MB: 1.3 s): on a thread, not the event loop,
        # which serves every other client meanwhile (issue 12).
        encoding = await asyncio.to_thread(state.tokenizer, prompt, add_special_tokens=add_special)
        tokens = encoding.input_ids
    strs = None
    if get_field(body, "return_token_strs", (bool,), False):
        strs = await asyncio.to_thread(state.tokenizer.convert_ids_to_tokens, tokens)
    live = await state.workers.live()
    return JSONResponse(
        {
            "count": len(tokens),
            "max_model_len": min((w.max_model_len for w in live), default=None),
            "tokens": tokens,
            "token_strs": strs,
        }
    )


async def _tokenize_messages(state: ApiState, body: dict[str, Any]) -> list[int]:
    messages = parse_messages(body["messages"])
    chat_template = parse_chat_template(body, state.parse_context)
    add_special = get_field(body, "add_special_tokens", (bool,), False)
    try:
        return await asyncio.to_thread(chat_template.apply, state.tokenizer, messages, add_special)
    except Exception as e:  # a chat template can raise anything
        raise ApiError(400, f"Cannot apply the chat template: {e}", param="messages") from None


async def detokenize(request: Request) -> Response:
    state = state_of(request)
    body = await read_json(request, state.settings.max_body_bytes)
    check_model(body, state.model_name, required=False)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < state.parse_context.vocab_size
        for t in tokens
    ):
        raise ApiError(400, "'tokens' must be an array of token ids", param="tokens")
    return JSONResponse({"prompt": await asyncio.to_thread(state.tokenizer.decode, tokens)})


async def openapi(request: Request) -> Response:
    return JSONResponse(openapi_document(state_of(request).model_name))


ROUTES = [
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    # `:path`: a served name may hold a slash, as Hugging Face ids do (`org/name`).
    Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
    Route("/v1/streams/{request_id}", resume_stream, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", prometheus_metrics, methods=["GET"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/openapi.json", openapi, methods=["GET"]),
]
