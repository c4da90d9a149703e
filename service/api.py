"""`kvrail api`: the OpenAI-compatible HTTP front end (Starlette on uvicorn).

This module builds the app and its server: the routes are `service.handlers`', the generation
path `service.generation`'s, the SSE transport `service.sse`'s, the API key check, metrics and
error bodies `service.middleware`'s. Requests go to the workers on `kvrail:requests` and are
answered from `kvrail:resp:{id}` through the client's single response reader. The API key
(when set) guards `/v1/*`, `/tokenize` and `/detokenize`; `/health`, `/metrics` and
`/openapi.json` stay open for probes.

The server bounds what a client may hold (issue 12: slow headers, a body at one byte per 10 s
and idle connections all stayed open past 90 s): uvicorn's own keep-alive timeout and
concurrency limit, a header timeout in its HTTP protocol (`HeaderTimeoutProtocol`) and a body
timeout in the app (`BodyTimeoutMiddleware`). None of them bounds a response: an SSE stream
lasts as long as its request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import h11
import uvicorn
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine import load_tokenizer, resolve_model
from queueing.client import KvrailClient
from service.generation import ApiState, Readers, WorkerView
from service.handlers import ROUTES
from service.middleware import (
    EXCEPTION_HANDLERS,
    ApiKeyMiddleware,
    BodyTimeoutMiddleware,
    HttpMetricsMiddleware,
)
from service.settings import Settings
from service.settings import served_model_name as _served_model_name


@lru_cache(maxsize=4)
def _load_tokenizer(tokenizer_dir: str) -> Any:
    return load_tokenizer(Path(tokenizer_dir))


def create_app(
    redis_url: str,
    model_name: str,
    tokenizer_dir: str | Path,
    settings: Settings,
    *,
    worker_cache_s: float = 1.0,
) -> Starlette:
    """The API app serving `model_name` with the tokenizer in `tokenizer_dir`.

    Its limits and API key are the `settings`' (api_key, max_body_bytes, max_pending,
    stream_timeout_s, response_ttl_s, resume_grace_s, unknown_fields). `worker_cache_s` is how
    long a read of the worker heartbeats is reused. The Redis client and its response reader
    live for the app's lifespan.
    """
    state = ApiState(
        model_name=model_name, tokenizer=_load_tokenizer(str(tokenizer_dir)), settings=settings
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with KvrailClient(redis_url, chunk_timeout_s=settings.stream_timeout_s) as client:
            state.client = client
            state.workers = WorkerView(client, worker_cache_s)
            state.readers = Readers(client, settings.resume_grace_s, settings.response_ttl_s)
            try:
                yield
            finally:
                state.readers.close()

    app = Starlette(routes=ROUTES, lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)
    app.state.api = state
    app.add_middleware(BodyTimeoutMiddleware, timeout_s=settings.http_body_timeout_s)
    app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(HttpMetricsMiddleware)
    # Outermost (added last): a preflight carries no API key. With no origin allowed, a
    # preflight is answered 400 and no response carries Access-Control-Allow-Origin.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(settings.cors_origins),
        allow_methods=["GET", "POST"],
        allow_headers=["Authorization", "Content-Type", "Last-Event-ID"],
    )
    return app


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol (h11: httptools is not installed), closing a connection
    whose request head (request line and headers) is not complete `header_timeout_s` after
    the connection opened, or after the first byte of a later request on it.

    uvicorn (0.54) times only the idle wait after a response (`timeout_keep_alive`, cancelled
    by the next request's first byte): a connection that never sent a request, or sent its
    head one byte at a time, stayed open for good (issue 12).
    """

    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._header_timer = self.loop.call_later(
            self._header_timeout_s,
            self.timeout_keep_alive_handler,  # closes the connection
        )

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is in (or the connection failed)
            self._stop_header_timer()
        elif self._header_timer is None:  # the first bytes of a later request
            self._header_timer = self.loop.call_later(
                self._header_timeout_s, self.timeout_keep_alive_handler
            )

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None


def server_config(app: Starlette, host: str, port: int, settings: Settings) -> uvicorn.Config:
    """uvicorn's configuration for the API `app`, with the settings' HTTP timeouts and limit
    and their log level."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        log_config=None,  # logging is configured once by the CLI (service.logging)
        log_level=settings.log_level.lower(),
        http=partial(HeaderTimeoutProtocol, header_timeout_s=settings.http_header_timeout_s),
        timeout_keep_alive=settings.http_keep_alive_s,
        # uvicorn answers 503 once the open connections, the new one among them, reach its
        # limit: one more serves exactly `http_max_connections`.
        limit_concurrency=settings.http_max_connections + 1,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
    )


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
    settings: Settings,
    *,
    served_model_name: str | None = None,
) -> ApiServer:
    """The API on uvicorn (uvloop), ready to `serve()`; stop it with `should_exit = True`.

    `model` is what the workers were given (HF folder or .gguf, None = the default GGUF);
    only its tokenizer is loaded here, never the weights.
    """
    tokenizer_dir = await asyncio.to_thread(resolve_model, model)
    name = served_model_name or _served_model_name(model)
    app = await asyncio.to_thread(create_app, redis_url, name, tokenizer_dir, settings)
    return ApiServer(server_config(app, host, port, settings))
