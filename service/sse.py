"""The SSE transport of `service.api`: a `text/event-stream` response that sends events as
they come and notices the client leaving, even while no event is due.

What the events say is `service.openai_protocol`'s; which chunks they carry, `service.generation`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has gone (`http.disconnect`); other messages are dropped."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(Response):
    """An SSE response that notices a client disconnect, and calls `on_close` once it ends,
    however it ends: every event sent, the client gone, a failure, or the server stopping.

    The events are sent by one task while another waits for `http.disconnect`; whichever ends
    first stops the other, so a client that leaves during a silent stretch is still seen.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__()
        # Set whole: the base class would declare `content-length: 0` for the empty body.
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        send_task = asyncio.create_task(self._send_all(send))
        gone = asyncio.create_task(wait_for_disconnect(receive))
        try:
            await asyncio.wait({send_task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (send_task, gone):
                task.cancel()
            await self.on_close()
        client_left = gone.done() and not gone.cancelled()
        if not client_left and send_task.done() and not send_task.cancelled():
            error = send_task.exception()
            if error is not None and not isinstance(error, OSError):  # OSError: client gone
                raise error

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
