"""ZeroMQ client library: ``Client`` (blocking, one thread) here, ``AsyncClient`` (asyncio) in
``async_client.py``.

Both own one DEALER socket connected to the daemon's ROUTER and speak the frames of
``frames.py``, one frame per message. Every request carries a ``request_id`` (uuid4 hex unless
the caller gives one) and every reply echoes it; replies are demultiplexed into one inbox per
live request, and replies for ids nobody waits on any more are dropped. Everything but the
waiting is shared: requests and results in ``_client_common.py``, the socket, demultiplexing
and the lifetime of a live request in ``_connection.py``, a call around its waits in
``_client_core.py``. ``Client`` waits by polling, blocking its thread.
"""

from __future__ import annotations

import math
import time
from types import TracebackType

import zmq

from outrider.protocol._client_common import (
    CurveKey,
    GenerateCall,
    GenerateResult,
    TokenChunk,
    abort_request,
    expect,
    health_query,
    server_info_query,
    takes_generate_arguments,
    to_result,
)
from outrider.protocol._client_core import ClientCore, StreamState
from outrider.protocol._connection import (
    HEARTBEAT_IVL_MS,
    HEARTBEAT_TIMEOUT_MS,
    IDLE_TIMEOUT_S,
    LINGER_MS,
    SILENT_DROPS_LIMIT,
    Inbox,
)
from outrider.protocol.async_client import AsyncClient, AsyncTokenStream
from outrider.protocol.messages import Ack, Chunk, ClientReply, ClientRequest, Health, ServerInfo

# The names this module has always offered; the async client and the shared types are
# re-exported from where they now live.
__all__ = [
    "HEARTBEAT_IVL_MS",
    "HEARTBEAT_TIMEOUT_MS",
    "IDLE_TIMEOUT_S",
    "LINGER_MS",
    "SILENT_DROPS_LIMIT",
    "AsyncClient",
    "AsyncTokenStream",
    "Client",
    "CurveKey",
    "GenerateResult",
    "TokenChunk",
    "TokenStream",
]


class Client(ClientCore):
    """Blocking client of one daemon; use it from one thread.

    ``timeout`` (seconds) is the default for calls that take one; a call's own ``timeout``
    overrides it; None everywhere (or ``math.inf``) sets no overall limit. A request sent
    before the daemon binds is queued by ZeroMQ and delivered once it does, if that happens
    within ``connect_timeout`` seconds (None: within the call's ``timeout``); a call that gives
    up meanwhile raises ``NotListening``, one that a connected daemon leaves unanswered a
    plain ``Timeout``. Whatever ``timeout`` says, a call raises ``Timeout`` once a connected
    daemon has sent nothing at all for ``idle_timeout`` seconds (it probes clients with calls
    in flight every few seconds; None: no such limit). A request frame over
    ``max_message_bytes`` (the daemon's ``--max-message-bytes``) raises ``RequestError``
    (``invalid_request``) unsent. ``reply_hwm`` is how many replies ZeroMQ takes in while
    nobody reads them (0: no limit); past it they wait in the daemon, which answers the
    requests of a client that stays behind ``slow_consumer``. CURVE is used when
    ``curve_server_key`` is given, with ``curve_keypair = (public, secret)`` or a fresh one.
    """

    @takes_generate_arguments
    def generate(self, call: GenerateCall) -> GenerateResult:
        """Run one request to its end. Exactly one of ``prompt``, ``input_ids``, ``messages``
        (``{"role", "content"}`` dicts or ``ChatMessage``). ``temperature``, ``top_p`` and
        ``top_k`` left None take the daemon's sampling defaults (the model's). Raises
        ``RequestError`` on an ``Error`` frame or a lost connection, ``Timeout`` when
        ``timeout`` passes first (the request is then aborted, best effort)."""
        msg = call.request(stream=False)
        deadline = self._deadline(call.timeout)
        inbox = self._submit(msg, deadline)
        while True:
            reply = self._receive(inbox, deadline)
            if not isinstance(reply, Chunk):
                return to_result(reply)

    @takes_generate_arguments
    def stream(self, call: GenerateCall) -> TokenStream:
        """Send a streamed request now and return the iterator over its chunks. Arguments and
        errors as for ``generate``; ``timeout`` bounds the time until the final frame."""
        msg = call.request(stream=True)
        deadline = self._deadline(call.timeout)
        return TokenStream(self, self._submit(msg, deadline), deadline)

    def abort(self, request_id: str, *, timeout: float | None = None) -> None:
        """Abort the live request ``request_id``; returns once the daemon acknowledges, raises
        ``RequestError`` on its error (``unknown_request`` when it is not live)."""
        expect(self._call(abort_request(request_id), timeout), Ack)

    def health(self, timeout: float | None = 5.0) -> Health:
        """The daemon's liveness answer; raises ``NotListening`` (a ``Timeout``) while no
        daemon is bound."""
        return expect(self._call(health_query(), timeout), Health)

    def server_info(self, timeout: float | None = None) -> ServerInfo:
        """The daemon's model, configuration, plugins and counters."""
        return expect(self._call(server_info_query(), timeout), ServerInfo)

    def close(self) -> None:
        """Close the socket; unfinished calls and streams end with ``connection_lost``."""
        self._shutdown()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _open_sockets(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        """The sockets, and the poller every wait for a reply polls them with."""
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        dealer, monitor = ctx.socket(zmq.DEALER), ctx.socket(zmq.PAIR)
        self._poller = zmq.Poller()
        self._poller.register(dealer, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)
        self._send_poller = zmq.Poller()
        self._send_poller.register(dealer, zmq.POLLOUT)
        self._send_poller.register(monitor, zmq.POLLIN)
        return dealer, monitor

    def _now(self) -> float:
        return time.monotonic()

    def _call(self, msg: ClientRequest, timeout: float | None) -> ClientReply:
        deadline = self._deadline(timeout)
        return self._receive(self._submit(msg, deadline), deadline)

    def _submit(self, msg: ClientRequest, deadline: float | None) -> Inbox:
        with self._sending(msg) as outgoing:
            since = time.monotonic()
            # NOTE: a send waits only while the DEALER has no room, or no pipe: a handshake
            # that fails meanwhile removes the pipe for good, and the link events, read here
            # too, end the request (connection_lost) instead of its deadline.
            while not outgoing.inbox.final:
                try:
                    self._sock.send(outgoing.frame, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    limit = self._wait_limit(deadline, since, msg.request_id)
                    self._send_poller.poll(_poll_ms(limit))
                    self._service()
        return outgoing.inbox

    def _receive(self, inbox: Inbox, deadline: float | None) -> ClientReply:
        """The next reply for ``inbox``; its request is released after its final reply and
        on any exception (``Timeout``, ``KeyboardInterrupt``)."""
        with self._awaiting_reply(inbox, deadline) as limits:
            for limit in limits:
                self._poller.poll(_poll_ms(limit))
                self._pump()
        return self._take(inbox)


class TokenStream(StreamState[Client]):
    """Iterator over the chunks of one streamed request (``Client.stream``).

    ``request_id`` is known before the first chunk; once the iterator is exhausted,
    ``result`` holds the ``GenerateResult``. An ``Error`` frame raises ``RequestError``.
    ``close()`` (or dropping the stream unfinished) aborts the request, best effort.
    """

    def __init__(self, client: Client, inbox: Inbox, deadline: float | None) -> None:
        super().__init__(client, inbox.request_id, deadline)
        self._track(inbox)

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> TokenChunk:
        if self._done:
            raise StopIteration
        assert self._inbox is not None  # adopted at construction
        try:
            chunk = self._step(self._client._receive(self._inbox, self._deadline))
        except BaseException:
            self._done = True
            raise
        if chunk is None:
            raise StopIteration
        return chunk


def _poll_ms(limit: float | None) -> int | None:
    """Milliseconds to poll until ``limit`` (``time.monotonic()``; None: no limit), at least 1."""
    return None if limit is None else max(1, math.ceil((limit - time.monotonic()) * 1000))
