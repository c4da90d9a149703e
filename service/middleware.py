"""The API's cross-cutting HTTP layer: the API key check, the request metrics and the body
timeout (ASGI middlewares), and the exception handlers that turn every error into OpenAI's
error body.

Redis down is the service being unavailable (503 with Retry-After), a client gone before its
answer is 499 in the metrics, anything unexpected a logged 500.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from redis.exceptions import RedisError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import metrics
from service.openai_protocol import ApiError

logger = logging.getLogger("kvrail.api")

RETRY_AFTER_NO_WORKER_S = 5
STATUS_CLIENT_GONE = 499  # nginx's "client closed request", for the metrics
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


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


def retry_later(status: int, message: str, type: str, code: str, after_s: int) -> ApiError:
    """An error the client should retry after `after_s` (Retry-After)."""
    return ApiError(status, message, type=type, code=code, headers={"Retry-After": str(after_s)})


def redis_unavailable(message: str) -> ApiError:
    return retry_later(
        503, message, "service_unavailable_error", "redis_unavailable", RETRY_AFTER_NO_WORKER_S
    )


async def _redis_error(request: Request, exc: Exception) -> Response:
    """Redis down (or restarting) is the service being unavailable, not a server bug: 503
    with Retry-After, so clients back off and retry."""
    logger.warning("redis error on %s %s: %s", request.method, request.url.path, exc)
    return await _api_error(request, redis_unavailable(f"Redis is unavailable: {exc}"))


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The client left while its body was read: nobody to answer, nothing to log as a fault."""
    return Response(status_code=STATUS_CLIENT_GONE)


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


class BodyTimeoutMiddleware:
    """408 (and the connection closed) when a request's body has not all arrived `timeout_s`
    after its head. uvicorn bounds neither the body nor the wait between its chunks: a body
    sent one byte every 10 s held its connection and its handler as long as the client liked
    (issue 12). Once the body is in, `receive` waits unbounded again: for a disconnect, all
    through a long SSE response."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        body_in = False

        async def receive_in_time() -> Message:
            nonlocal body_in
            if body_in:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise ApiError(
                    408,
                    f"The request body did not arrive within {self.timeout_s:g} s",
                    code="request_timeout",
                    headers={"Connection": "close"},  # the rest of the body is not awaited
                ) from None
            body_in = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, receive_in_time, send)


class HttpMetricsMiddleware:
    """Counts requests by route template and status, and times them to the last byte."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = STATUS_CLIENT_GONE

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


EXCEPTION_HANDLERS = {
    ApiError: _api_error,
    HTTPException: _http_error,
    RedisError: _redis_error,
    ClientDisconnect: _client_gone,
    Exception: _server_error,
}
