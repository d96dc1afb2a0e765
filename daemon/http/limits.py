"""What one HTTP client may hold of the HTTP front: body bytes, time, connections.

- Body: at most ``max_body_bytes`` (``BodyLimit``). A declared ``Content-Length`` over it is
  answered 413 before any of the body is read; a chunked body is counted as it arrives and
  answered 413 once past it. Either way the connection closes, so that the rest of the body
  is never read. The default limit is derived from the daemon's frame limit
  (``body_limit`` in http/config.py), so that every accepted body fits in one client frame.
- Time (``LimitedHttpProtocol``): a request's headers and body must arrive within
  ``read_timeout_s`` of its first byte (of the connection, for the first request), else the
  connection closes, with a 408 when nothing was answered on it yet. A response write that
  stays unsent for ``send_timeout_s`` (a client that stopped reading) ends the connection,
  which aborts its request. Time the server itself holds the reading back (a pipelined
  request waiting for the one before it) does not count. The kernel's send buffer of a
  connection is fixed at ``SEND_BUFFER_BYTES``: autotuned, it grows to megabytes, which a
  stalled reader would pin and which would hide the stall until a whole stream had gone
  into it.
- Connections: at most ``max_connections`` at once; one more is answered 503 and closed.

None of these log more than a debug line: a client that times out is not an error.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from outrider.daemon.http.errors import error_body, error_response

log = logging.getLogger("outrider.http")

# 64 KiB (the kernel doubles it for its bookkeeping): over 600 KB/s at a 100 ms round trip,
# ample for token streams.
SEND_BUFFER_BYTES = 64 * 2**10


@dataclass(frozen=True)
class ConnectionLimits:
    read_timeout_s: float
    send_timeout_s: float
    max_connections: int


class _BodyTooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: request bodies of at most ``max_bytes`` (see the module docstring)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self._app = app
        self._max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        # httptools refuses a Content-Length that is not a number.
        if declared is not None and int(declared) > self._max_bytes:
            await self._too_large(scope, receive, send)
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self._max_bytes:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if started:
                raise
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is larger than {self._max_bytes} bytes"
        headers = {"Connection": "close"}  # the rest of the body is not read
        await error_response(413, message, code="body_too_large", headers=headers)(
            scope, receive, send
        )


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the read, send and connection limits of
    ``limits`` (see the module docstring); ``limited_protocol`` makes the class uvicorn
    instantiates."""

    limits: ConnectionLimits

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_deadline: asyncio.TimerHandle | None = None
        self._send_deadline: asyncio.TimerHandle | None = None

    # uvicorn types the transport as asyncio.Transport, narrower than Protocol's BaseTransport.
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            log.debug("HTTP connection refused: %d connections", len(self.connections))
            self._close_with(503, "too many connections")
            return
        # NOTE: any unsent byte pauses writing, so that the send deadline runs whenever the
        # client is not reading what it was sent (the default pauses only past 64 KiB).
        transport.set_write_buffer_limits(high=0)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self._arm_read()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_read()
        self._disarm_send()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._read_deadline is None:
            self._arm_read()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm_read()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_deadline is None:
            self._send_deadline = self.loop.call_later(
                self.limits.send_timeout_s, self._send_timed_out
            )

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_send()

    def _arm_read(self) -> None:
        self._disarm_read()
        self._read_deadline = self.loop.call_later(self.limits.read_timeout_s, self._read_timed_out)

    def _disarm_read(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _disarm_send(self) -> None:
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # the server holds the reading back, not the client
            self._arm_read()
            return
        log.debug(
            "HTTP request not read within %g s: connection closed", self.limits.read_timeout_s
        )
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.response_started:
            self._close_with(408, "the request was not received in time")
        else:
            self.transport.abort()

    def _send_timed_out(self) -> None:
        self._send_deadline = None
        log.debug("HTTP client read nothing for %g s: connection reset", self.limits.send_timeout_s)
        # NOTE: a plain close would queue a FIN behind the unread bytes, and the kernel would
        # keep the socket and its buffer until its zero-window probes give up (minutes); a
        # reset frees both now.
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def _close_with(self, status: int, message: str) -> None:
        """Answer ``status`` on the raw connection and close it; a request being read gets
        ``http.disconnect`` and whatever it sends later is dropped."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        body = error_body(status, message, None, None)
        head = (
            b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % len(body)
        )
        self.transport.write(STATUS_LINE[status] + head + body)
        self.transport.close()


def limited_protocol(limits: ConnectionLimits) -> type[LimitedHttpProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, bound to ``limits``."""
    return type("BoundLimitedHttpProtocol", (LimitedHttpProtocol,), {"limits": limits})
