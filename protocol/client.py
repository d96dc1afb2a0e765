"""ZeroMQ client library: ``Client`` (blocking, one thread) here, ``AsyncClient`` (asyncio) in
``async_client.py``.

Both own one DEALER socket connected to the daemon's ROUTER and speak the frames of
``frames.py``, one frame per message. Every request carries a ``request_id`` (uuid4 hex unless
the caller gives one) and every reply echoes it; replies are demultiplexed into one inbox per
live request, and replies for ids nobody waits on any more are dropped. What both share lives
in ``_client_common.py`` (result types, requests, replies) and ``_connection.py`` (socket,
demultiplexing, the lifetime of a live request); the clients add only the waiting.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from types import TracebackType

import zmq

from outrider.protocol._client_common import (
    CurveKey,
    GenerateResult,
    TokenChunk,
    abort_request,
    expect,
    generate_request,
    health_query,
    server_info_query,
    to_result,
)
from outrider.protocol._connection import (
    HEARTBEAT_IVL_MS,
    HEARTBEAT_TIMEOUT_MS,
    IDLE_TIMEOUT_S,
    LINGER_MS,
    REPLY_HWM,
    Connection,
    Inbox,
    StreamState,
)
from outrider.protocol.async_client import AsyncClient, AsyncTokenStream
from outrider.protocol.messages import (
    DEFAULT_MAX_MESSAGE_BYTES,
    Ack,
    ChatMessage,
    Chunk,
    ClientReply,
    ClientRequest,
    Health,
    ServerInfo,
)

# The names this module has always offered; the async client and the shared types are
# re-exported from where they now live.
__all__ = [
    "HEARTBEAT_IVL_MS",
    "HEARTBEAT_TIMEOUT_MS",
    "IDLE_TIMEOUT_S",
    "LINGER_MS",
    "AsyncClient",
    "AsyncTokenStream",
    "Client",
    "CurveKey",
    "GenerateResult",
    "TokenChunk",
    "TokenStream",
]


class Client(Connection):
    """Blocking client of one daemon; use it from one thread.

    ``timeout`` (seconds) is the default for calls that take one; a call's own ``timeout``
    overrides it; None everywhere (or ``math.inf``) sets no overall limit. A request sent
    before the daemon binds is queued by ZeroMQ and delivered once it does; a call that times
    out meanwhile raises ``NotListening``, one that a connected daemon leaves unanswered a
    plain ``Timeout``. Whatever ``timeout`` says, a call raises ``Timeout`` once a connected
    daemon has sent nothing at all for ``idle_timeout`` seconds (it probes clients with calls
    in flight every few seconds; None: no such limit). A request frame over
    ``max_message_bytes`` (the daemon's ``--max-message-bytes``) raises ``RequestError``
    (``invalid_request``) unsent. ``reply_hwm`` is how many replies ZeroMQ takes in while
    nobody reads them (0: no limit); past it they wait in the daemon, which answers the
    requests of a client that stays behind ``slow_consumer``. CURVE is used when
    ``curve_server_key`` is given, with ``curve_keypair = (public, secret)`` or a fresh one.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float | None = None,
        idle_timeout: float | None = IDLE_TIMEOUT_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        reply_hwm: int = REPLY_HWM,
        curve_server_key: CurveKey | None = None,
        curve_keypair: tuple[CurveKey, CurveKey] | None = None,
    ) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        dealer, monitor = ctx.socket(zmq.DEALER), ctx.socket(zmq.PAIR)
        super().__init__(
            dealer, monitor, endpoint, timeout, curve_server_key, curve_keypair,
            idle_timeout, max_message_bytes, reply_hwm,
        )  # fmt: skip
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def generate(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[ChatMessage | Mapping[str, str]] | None = None,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        logprobs: int = 0,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        """Run one request to its end. Exactly one of ``prompt``, ``input_ids``, ``messages``
        (``{"role", "content"}`` dicts or ``ChatMessage``). ``temperature``, ``top_p`` and
        ``top_k`` left None take the daemon's sampling defaults (the model's). Raises
        ``RequestError`` on an ``Error`` frame or a lost connection, ``Timeout`` when
        ``timeout`` passes first (the request is then aborted, best effort)."""
        msg = generate_request(
            prompt=prompt, input_ids=input_ids, messages=messages, request_id=request_id,
            stream=False, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=seed, stop=stop, stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos, logprobs=logprobs,
        )  # fmt: skip
        deadline = self._deadline(timeout)
        inbox = self._submit(msg, deadline)
        while True:
            reply = self._receive(inbox, deadline)
            if not isinstance(reply, Chunk):
                return to_result(reply)

    def stream(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[ChatMessage | Mapping[str, str]] | None = None,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        logprobs: int = 0,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> TokenStream:
        """Send a streamed request now and return the iterator over its chunks. Arguments and
        errors as for ``generate``; ``timeout`` bounds the time until the final frame."""
        msg = generate_request(
            prompt=prompt, input_ids=input_ids, messages=messages, request_id=request_id,
            stream=True, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=seed, stop=stop, stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos, logprobs=logprobs,
        )  # fmt: skip
        deadline = self._deadline(timeout)
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

    def _now(self) -> float:
        return time.monotonic()

    def _poll_ms(self, deadline: float | None, since: float, request_id: str) -> int | None:
        """Milliseconds to wait before looking again (None: no limit); ``Timeout`` once the
        caller's deadline or the idle limit of a wait that began at ``since`` has passed."""
        limit = self._wait_limit(deadline, since, request_id)
        if limit is None:
            return None
        return max(1, math.ceil((limit - time.monotonic()) * 1000))

    def _call(self, msg: ClientRequest, timeout: float | None) -> ClientReply:
        deadline = self._deadline(timeout)
        return self._receive(self._submit(msg, deadline), deadline)

    def _submit(self, msg: ClientRequest, deadline: float | None) -> Inbox:
        self._check_open()
        frame = self._encode(msg)
        inbox = self._register(msg.request_id)
        since = time.monotonic()
        try:
            while True:
                try:
                    self._sock.send(frame, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    self._sock.poll(self._poll_ms(deadline, since, inbox.request_id), zmq.POLLOUT)
                    self._service()
        except BaseException:
            self._release(inbox, abort=False)
            raise
        return self._mark_sent(inbox, msg)

    def _receive(self, inbox: Inbox, deadline: float | None) -> ClientReply:
        """The next reply for ``inbox``; its request is released after its final reply and
        on any exception (``Timeout``, ``KeyboardInterrupt``)."""
        since = time.monotonic()
        try:
            while not inbox.replies:
                self._poller.poll(self._poll_ms(deadline, since, inbox.request_id))
                self._pump()
        except BaseException:
            self._release(inbox, abort=True)
            raise
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
