"""The API's HTTP timeouts and connection limit (issue 12: slow headers, a body at one byte per
10 s and idle connections all stayed open past 90 s).

Raw sockets against the API served as `kvrail api` serves it (`service.api.server_config`),
with timeouts of a fraction of a second. A connection that outlives its bound by 3 s fails the
test; none may close before its bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from urllib.parse import urlsplit

import pytest

from tests.service.test_api import MODEL, parse_sse

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

TIMEOUT_S = 0.5  # each timeout under test
MARGIN_S = 3.0  # how much later than its bound a connection may close (uvicorn: 5 s keep-alive)


async def connect(http):
    url = urlsplit(str(http.base_url))
    return await asyncio.open_connection(url.hostname, url.port)


async def trickle(writer: asyncio.StreamWriter, data: bytes) -> None:
    """Send `data` one byte every 0.1 s (a slowloris client) until the server hangs up."""
    with contextlib.suppress(ConnectionError):
        for byte in data:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.1)


async def until_closed(reader: asyncio.StreamReader, since: float) -> tuple[bytes, float]:
    """What the server sent until it closed the connection, and when it closed (s after
    `since`); fails when it is still open `TIMEOUT_S + MARGIN_S` after `since`."""
    data = bytearray()
    try:
        async with asyncio.timeout(since + TIMEOUT_S + MARGIN_S - time.monotonic()):
            # Read as it comes: the bytes a slow client sends after the server closed make
            # it reset the connection, and the reader then drops what it has not handed out.
            while part := await reader.read(1 << 16):
                data += part
    except TimeoutError:
        raise AssertionError(f"still open {TIMEOUT_S + MARGIN_S} s later") from None
    except ConnectionResetError:
        pass
    return bytes(data), time.monotonic() - since


@contextlib.asynccontextmanager
async def slow_client(http, head: bytes, slowly: bytes):
    """A connection that sends `head` at once, then `slowly` a byte at a time."""
    reader, writer = await connect(http)
    writer.write(head)
    sending = asyncio.create_task(trickle(writer, slowly))
    try:
        yield reader
    finally:
        sending.cancel()
        writer.close()


async def test_a_connection_without_a_whole_request_head_is_closed(start_api, worker):
    http = await start_api(http_header_timeout_s=TIMEOUT_S)
    opened = time.monotonic()
    reader, writer = await connect(http)  # sends nothing at all
    data, idle_closed_s = await until_closed(reader, opened)
    writer.close()
    assert data == b"" and idle_closed_s >= TIMEOUT_S
    # The head never ends (one header byte every 0.1 s), so nothing is answered.
    head = b"GET /health HTTP/1.1\r\nHost: test\r\n"
    opened = time.monotonic()
    async with slow_client(http, head, b"X-Slow: " + b"a" * 200) as reader:
        data, slow_closed_s = await until_closed(reader, opened)
    assert data == b"" and slow_closed_s >= TIMEOUT_S
    # A later request on a kept-alive connection has the same bound from its first byte.
    reader, writer = await connect(http)
    writer.write(head + b"\r\n")
    response = await reader.readuntil(b'"workers":1}')
    assert response.startswith(b"HTTP/1.1 200 ")
    started = time.monotonic()
    sending = asyncio.create_task(trickle(writer, b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 200))
    data, later_closed_s = await until_closed(reader, started)
    sending.cancel()
    writer.close()
    assert data == b"" and later_closed_s >= TIMEOUT_S
    print(
        f"closed after {idle_closed_s:.2f} s idle, {slow_closed_s:.2f} s of a slow head, "
        f"{later_closed_s:.2f} s of a slow second head (header timeout {TIMEOUT_S} s)"
    )


async def test_a_body_that_does_not_arrive_in_time_gets_408(start_api, worker):
    http = await start_api(http_body_timeout_s=TIMEOUT_S)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n{"
    )
    sent = time.monotonic()
    async with slow_client(http, head, b" " * 999) as reader:
        data, closed_s = await until_closed(reader, sent)
    status_line, _, rest = data.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 408 Request Timeout", data
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
    assert closed_s >= TIMEOUT_S
    assert not worker.requests  # nothing was submitted
    print(f"408 and closed {closed_s:.2f} s after the head (body timeout {TIMEOUT_S} s)")


async def test_an_idle_kept_alive_connection_is_closed(start_api, worker):
    http = await start_api(http_keep_alive_s=TIMEOUT_S)
    reader, writer = await connect(http)
    writer.write(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
    await reader.readuntil(b'"workers":1}')
    answered = time.monotonic()
    data, closed_s = await until_closed(reader, answered)
    writer.close()
    assert data == b"" and closed_s >= TIMEOUT_S
    print(f"idle connection closed {closed_s:.2f} s after its response (keep-alive {TIMEOUT_S} s)")


async def test_connections_beyond_the_limit_get_503(start_api, worker):
    http = await start_api(http_max_connections=2)
    request = b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n"
    held = [await connect(http) for _ in range(2)]  # open, not yet asking anything
    reader, writer = await connect(http)
    writer.write(request)
    data, _ = await until_closed(reader, time.monotonic())
    assert data.startswith(b"HTTP/1.1 503 "), data
    _, first = held.pop()
    first.close()  # one of the two goes: room for one more
    reader, writer = held[0]
    writer.write(request)
    assert (await reader.readuntil(b'"workers":1}')).startswith(b"HTTP/1.1 200 ")
    writer.close()
    assert (await http.get("/health")).status_code == 200


async def test_a_long_and_silent_stream_outlives_every_timeout(start_api, worker):
    """Each chunk comes later than every timeout after the one before."""
    http = await start_api(
        http_header_timeout_s=TIMEOUT_S, http_body_timeout_s=TIMEOUT_S, http_keep_alive_s=TIMEOUT_S
    )
    worker.tokens, worker.delay_s = 4, 2 * TIMEOUT_S
    body = {"model": MODEL, "prompt": "Hi", "stream": True, "max_tokens": 4}
    response = await http.post("/v1/completions", json=body)
    events = parse_sse(response.text)
    assert [e["id"] for e in events] == [0, 1, 2, 3, None] and events[-1]["data"] == "[DONE]"
    assert events[-2]["data"]["choices"][0]["finish_reason"] == "length"
