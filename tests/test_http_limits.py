"""The HTTP front's per-connection limits (http/limits.py) on a real uvicorn server in a
thread, with no daemon: body size, read and send deadlines, the connection count. Every
client here is a raw socket, so that it can misbehave."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, Router

from outrider.daemon.http.errors import Guard
from outrider.daemon.http.limits import BodyLimit, ConnectionLimits, limited_protocol

MAX_BODY = 1000
FAST = ConnectionLimits(read_timeout_s=0.5, send_timeout_s=0.5, max_connections=64)


class _App:
    def __init__(self) -> None:
        self.streams_ended = 0

    def routes(self) -> Router:
        return Router(
            [
                Route("/echo", self.echo, methods=["POST"]),
                Route("/slow", self.slow, methods=["GET"]),
                Route("/stream", self.stream, methods=["GET"]),
            ]
        )

    async def echo(self, request: Request) -> Response:
        return JSONResponse({"bytes": len(await request.body())})

    async def slow(self, _request: Request) -> Response:
        await asyncio.sleep(1.0)
        return JSONResponse({"slow": True})

    async def stream(self, _request: Request) -> Response:
        async def events() -> AsyncIterator[bytes]:
            try:
                while True:
                    yield b"data: " + b"x" * 16_000 + b"\n\n"
                    await asyncio.sleep(0.001)
            finally:
                self.streams_ended += 1

        return StreamingResponse(events(), media_type="text/event-stream")


@contextlib.contextmanager
def _serve(limits: ConnectionLimits) -> Iterator[tuple[int, _App]]:
    app = _App()
    config = uvicorn.Config(
        Guard(BodyLimit(app.routes(), MAX_BODY)),
        http=limited_protocol(limits),
        lifespan="off",
        log_config=None,
        access_log=False,
    )
    server = uvicorn.Server(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1], app
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def fast() -> Iterator[tuple[int, _App]]:
    with _serve(FAST) as served:
        yield served


def _connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    sock.settimeout(5.0)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes (a reset counts as closed)."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def _post_head(length: int | None) -> bytes:
    size = b"transfer-encoding: chunked" if length is None else b"content-length: %d" % length
    return b"POST /echo HTTP/1.1\r\nhost: localhost\r\n" + size + b"\r\n\r\n"


def test_a_body_within_the_limit_is_served(fast: tuple[int, _App]) -> None:
    with _connect(fast[0]) as sock:
        sock.sendall(_post_head(MAX_BODY) + b"x" * MAX_BODY)
        assert b'{"bytes":1000}' in sock.recv(65536)


def test_a_declared_length_over_the_limit_is_refused_unread(fast: tuple[int, _App]) -> None:
    with _connect(fast[0]) as sock:
        sock.sendall(_post_head(100 * 2**20))  # and not a byte of the body
        answer = _read_all(sock)
    assert _status(answer) == 413 and b"body_too_large" in answer


def test_a_chunked_body_over_the_limit_is_refused(fast: tuple[int, _App]) -> None:
    with _connect(fast[0]) as sock:
        sock.sendall(_post_head(None))
        with contextlib.suppress(ConnectionError):
            for _ in range(2 * MAX_BODY // 100):
                sock.sendall(b"64\r\n" + b"y" * 100 + b"\r\n")
        answer = _read_all(sock)
    assert _status(answer) == 413


@pytest.mark.parametrize(
    "opening",
    [b"", b"GET /echo HTTP/1.1\r\nhost: loc", _post_head(MAX_BODY) + b"x" * 10],
    ids=["nothing", "dripped-headers", "dripped-body"],
)
def test_a_request_not_received_in_time_is_408_and_closed(
    fast: tuple[int, _App], opening: bytes
) -> None:
    started = time.monotonic()
    with _connect(fast[0]) as sock:
        sock.sendall(opening)
        with contextlib.suppress(ConnectionError):
            for _ in range(10 if opening else 0):  # a byte every 0.2 s: progress, never done
                time.sleep(0.2)
                sock.send(b"x")
        answer = _read_all(sock)
    assert _status(answer) == 408
    assert time.monotonic() - started < FAST.read_timeout_s + 2.5


def test_keep_alive_and_slow_answers_are_not_read_timeouts(fast: tuple[int, _App]) -> None:
    with _connect(fast[0]) as sock:
        for _ in range(2):
            sock.sendall(_post_head(3) + b"abc")
            assert b'{"bytes":3}' in sock.recv(65536)
            time.sleep(FAST.read_timeout_s * 0.6)
        # Answered after twice the read timeout: the request itself had arrived at once.
        sock.sendall(b"GET /slow HTTP/1.1\r\nhost: localhost\r\n\r\n")
        assert b'{"slow":true}' in sock.recv(65536)


def test_a_reader_that_stalls_loses_its_connection_and_its_response(
    fast: tuple[int, _App],
) -> None:
    port, app = fast
    ended_before = app.streams_ended
    with _connect(port, rcvbuf=4096) as sock:
        sock.sendall(b"GET /stream HTTP/1.1\r\nhost: localhost\r\n\r\n")
        deadline = time.monotonic() + FAST.send_timeout_s + 5
        while app.streams_ended == ended_before:
            assert time.monotonic() < deadline, "the stalled stream is still running"
            time.sleep(0.05)
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 200")


def test_connections_past_the_limit_are_refused() -> None:
    limits = ConnectionLimits(read_timeout_s=30, send_timeout_s=30, max_connections=4)
    with _serve(limits) as (port, _app), contextlib.ExitStack() as held:
        for _ in range(limits.max_connections):
            held.enter_context(_connect(port)).sendall(b"GET /echo HTTP/1.1\r\n")
        time.sleep(0.2)
        with _connect(port) as extra:
            assert _status(_read_all(extra)) == 503
        with contextlib.ExitStack() as more:  # the held ones still count
            assert _status(_read_all(more.enter_context(_connect(port)))) == 503
