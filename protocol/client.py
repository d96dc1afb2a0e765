"""ZeroMQ client library: ``Client`` (blocking, one thread) and ``AsyncClient`` (asyncio).

Both own one DEALER socket connected to the daemon's ROUTER and speak the frames of
``frames.py``, one frame per message. Every request carries a ``request_id`` (uuid4 hex unless
the caller gives one) and every reply echoes it; replies are demultiplexed into one inbox per
live request, and replies for ids nobody waits on any more are dropped.

Lifetime of a live request on this client:

```
register (id unique among live ids) -> send -> replies...  -> final reply: unregistered
                                             -> timeout / cancel / stream dropped: unregistered,
                                                and a Generate still running is aborted
                                             -> link lost / daemon restarted: final
                                                Error('connection_lost') delivered locally
```
Nothing is ever resubmitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Final, TypeVar

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from outrider.protocol.endpoints import default_endpoint
from outrider.protocol.errors import RequestError, Timeout
from outrider.protocol.frames import FrameError, reply_codec, request_codec
from outrider.protocol.messages import (
    Abort,
    Ack,
    ChatMessage,
    Chunk,
    ClientReply,
    ClientRequest,
    Error,
    ErrorCode,
    Finished,
    FinishReason,
    Generate,
    Health,
    HealthQuery,
    ServerInfo,
    ServerInfoQuery,
    TokenLogprob,
    Usage,
    is_final,
)

# Unsent frames (a best-effort abort at close) get this long; close() itself never blocks.
LINGER_MS: Final = 500
HEARTBEAT_IVL_MS: Final = 2_000
HEARTBEAT_TIMEOUT_MS: Final = 10_000

_MONITOR_EVENTS: Final = (
    zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)

CurveKey = bytes | str
R = TypeVar("R", bound=ClientReply)


class GenerateResult(msgspec.Struct, frozen=True):
    """The outcome of one generation request (the daemon's ``Finished`` frame)."""

    request_id: str
    output_ids: list[int]
    text: str
    finish_reason: FinishReason
    matched_stop: str | int | None
    usage: Usage
    logprobs: list[TokenLogprob] | None


class TokenChunk(msgspec.Struct, frozen=True):
    """Tokens committed since the previous chunk of a streamed request."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None


class _Inbox:
    """Replies received for one live request, oldest first."""

    __slots__ = ("final", "replies", "request_id", "running", "waiter")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.replies: deque[ClientReply] = deque()
        self.final = False
        self.running = False  # a Generate was sent and may still run on the daemon
        self.waiter: asyncio.Future[None] | None = None

    def put(self, reply: ClientReply) -> None:
        # NOTE: exactly one final reply per request; anything after it is stale.
        if self.final:
            return
        self.replies.append(reply)
        self.final = is_final(reply)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class _Connection:
    """Socket setup, reply routing and link supervision shared by both clients. Every method
    runs on the client's one thread (for ``AsyncClient``: its event loop)."""

    def __init__(
        self,
        dealer: zmq.Socket[Any],
        monitor: zmq.Socket[Any],
        endpoint: str | None,
        timeout: float | None,
        curve_server_key: CurveKey | None,
        curve_keypair: tuple[CurveKey, CurveKey] | None,
    ) -> None:
        self.endpoint = endpoint if endpoint is not None else default_endpoint()
        self.timeout = timeout
        self.boot_id: str | None = None  # the last one seen in Health / ServerInfo
        self._requests = request_codec()
        self._replies = reply_codec()
        self._pending: dict[str, _Inbox] = {}
        # Inboxes of streams garbage-collected unfinished; appended from any thread.
        self._abandoned: deque[_Inbox] = deque()
        self._lost_since_boot = False
        self._handshake_failure = ""
        self._closed = False
        # NOTE: only the owners may close the sockets. A socket closed through another
        # object is closed again by its owner when collected, by then perhaps a new socket
        # at the same address. Everything else uses these non-owning blocking views.
        self._owners = (dealer, monitor)
        self._sock: zmq.Socket[bytes] = zmq.Socket.shadow(dealer.underlying)
        self._monitor: zmq.Socket[bytes] = zmq.Socket.shadow(monitor.underlying)
        try:
            if curve_keypair is not None and curve_server_key is None:
                raise ValueError("curve_keypair needs curve_server_key")
            self._configure(curve_server_key, curve_keypair)
            try:
                self._sock.connect(self.endpoint)
            except zmq.ZMQError as exc:
                raise ValueError(f"cannot connect to {self.endpoint!r}: {exc}") from exc
        except BaseException:
            self._close_sockets(linger=0)
            raise

    def _configure(
        self, curve_server_key: CurveKey | None, curve_keypair: tuple[CurveKey, CurveKey] | None
    ) -> None:
        sock = self._sock
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        if self.endpoint.startswith("tcp://"):
            # NOTE: heartbeats only where a peer can vanish silently. libzmq 4.3 aborts the
            # process when the heartbeat timer fires on a connection whose peer closed while
            # its receive pipe was full (replies nobody read yet; libzmq issues 3937, 4767).
            # Over ipc:// the kernel reports a dead peer: heartbeats add nothing there.
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
        if curve_server_key is not None:
            public, secret = curve_keypair if curve_keypair is not None else zmq.curve_keypair()
            sock.setsockopt(zmq.CURVE_SERVERKEY, _key_bytes(curve_server_key))
            sock.setsockopt(zmq.CURVE_PUBLICKEY, _key_bytes(public))
            sock.setsockopt(zmq.CURVE_SECRETKEY, _key_bytes(secret))
        address = f"inproc://outrider-client-monitor-{uuid.uuid4().hex}"
        sock.monitor(address, _MONITOR_EVENTS)
        # NOTE: libzmq's monitor sends block its I/O thread once the pipe is full; an idle
        # Client reads events only at its next call, so the pipe must be unbounded.
        self._monitor.setsockopt(zmq.RCVHWM, 0)
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._monitor.connect(address)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the client is closed")

    def _close_sockets(self, linger: int | None = None) -> None:
        self._closed = True
        for sock in self._owners:
            sock.close(linger=linger)

    def _resolve_timeout(self, timeout: float | None) -> float | None:
        chosen = self.timeout if timeout is None else timeout
        return None if chosen is None or math.isinf(chosen) else chosen

    def _timeout_error(self, request_id: str) -> Timeout:
        return Timeout(f"no answer from {self.endpoint} in time", request_id)

    def _register(self, request_id: str) -> _Inbox:
        self._service()
        if request_id in self._pending:
            raise RequestError(
                "duplicate_request_id", "already in flight on this client", request_id
            )
        inbox = _Inbox(request_id)
        self._pending[request_id] = inbox
        return inbox

    def _release(self, inbox: _Inbox, *, abort: bool) -> None:
        """Stop waiting for ``inbox``; with ``abort``, a Generate that may still run on the
        daemon is aborted (best effort: its Ack and final frame are dropped)."""
        if self._pending.get(inbox.request_id) is not inbox:
            return
        del self._pending[inbox.request_id]
        if abort and inbox.running and not inbox.final and not self._closed:
            frame = self._requests.encode(Abort(request_id=_new_id(), target_id=inbox.request_id))
            # NOTE: with the send queue full the abort is skipped: the daemon finishes the
            # request and its replies are dropped.
            with contextlib.suppress(zmq.Again):
                self._sock.send(frame, zmq.NOBLOCK)
            # NOTE: any operation may consume the edge-triggered readiness of the socket's fd,
            # which AsyncClient's reader waits on: read what has arrived, or it would sit there.
            self._drain()

    def _service(self) -> None:
        """Handle what happened while nobody was reading: dropped streams and link events."""
        while self._abandoned:
            self._release(self._abandoned.popleft(), abort=True)
        self._read_monitor()

    def _drain(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._dispatch(frames[0])

    def _dispatch(self, frame: bytes) -> None:
        try:
            reply = self._replies.decode(frame)
        except FrameError as exc:
            # A reply body names its request only once decoded: a daemon speaking another
            # protocol version fails every call; any other unreadable frame is dropped.
            if exc.code == "unsupported_version":
                self._fail_all("unsupported_version", exc.message)
            return
        if isinstance(reply, Health | ServerInfo):
            self._note_boot(reply.boot_id, reply.request_id)
        inbox = self._pending.get(reply.request_id)
        if inbox is not None:
            inbox.put(reply)

    def _read_monitor(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._handshake_failure = " (handshake failed: authentication)"
            elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                self._handshake_failure = " (handshake failed: protocol)"
            else:
                # NOTE: replies that arrived before the link dropped are queued ahead of
                # this event; deliver them first so that only unanswered calls fail.
                self._drain()
                reason, self._handshake_failure = self._handshake_failure, ""
                self._fail_all("connection_lost", f"connection to {self.endpoint} lost{reason}")
                self._lost_since_boot = True

    def _note_boot(self, boot_id: str, request_id: str) -> None:
        # NOTE: a restart always drops the link, which fails the calls in flight; a new boot
        # id with no disconnect seen since the last one means that drop went unnoticed.
        if self.boot_id is not None and boot_id != self.boot_id and not self._lost_since_boot:
            self._fail_all(
                "connection_lost", f"the daemon at {self.endpoint} restarted", keep=request_id
            )
        self.boot_id = boot_id
        self._lost_since_boot = False

    def _fail_all(self, code: ErrorCode, message: str, keep: str | None = None) -> None:
        for inbox in list(self._pending.values()):
            if inbox.request_id != keep:
                inbox.put(Error(request_id=inbox.request_id, code=code, message=message))


class Client(_Connection):
    """Blocking client of one daemon; use it from one thread.

    ``timeout`` (seconds) is the default for calls that take one; a call's own ``timeout``
    overrides it; None everywhere (or ``math.inf``) waits forever. A request sent before the
    daemon binds is queued by ZeroMQ and delivered once it does. CURVE is used when
    ``curve_server_key`` is given, with ``curve_keypair = (public, secret)`` or a fresh one.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float | None = None,
        curve_server_key: CurveKey | None = None,
        curve_keypair: tuple[CurveKey, CurveKey] | None = None,
    ) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        dealer, monitor = ctx.socket(zmq.DEALER), ctx.socket(zmq.PAIR)
        super().__init__(dealer, monitor, endpoint, timeout, curve_server_key, curve_keypair)
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
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        logprobs: int = 0,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        """Run one request to its end. Exactly one of ``prompt``, ``input_ids``, ``messages``
        (``{"role", "content"}`` dicts or ``ChatMessage``). Raises ``RequestError`` on an
        ``Error`` frame or a lost connection, ``Timeout`` when ``timeout`` passes first (the
        request is then aborted, best effort)."""
        msg = _generate_request(
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
                return _result(reply)

    def stream(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[ChatMessage | Mapping[str, str]] | None = None,
        max_new_tokens: int | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
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
        msg = _generate_request(
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
        msg = Abort(request_id=_new_id(), target_id=request_id)
        _expect(self._call(msg, timeout), Ack)

    def health(self, timeout: float | None = 5.0) -> Health:
        """The daemon's liveness answer; raises ``Timeout`` while no daemon is bound."""
        return _expect(self._call(HealthQuery(request_id=_new_id()), timeout), Health)

    def server_info(self, timeout: float | None = None) -> ServerInfo:
        """The daemon's model, configuration, plugins and counters."""
        return _expect(self._call(ServerInfoQuery(request_id=_new_id()), timeout), ServerInfo)

    def close(self) -> None:
        """Close the socket; unfinished calls and streams end with ``connection_lost``."""
        if self._closed:
            return
        self._fail_all("connection_lost", "the client was closed")
        self._close_sockets()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _deadline(self, timeout: float | None) -> float | None:
        seconds = self._resolve_timeout(timeout)
        return None if seconds is None else time.monotonic() + seconds

    def _poll_ms(self, deadline: float | None, request_id: str) -> int | None:
        """Milliseconds left before ``deadline`` (None: no deadline); ``Timeout`` once passed."""
        if deadline is None:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise self._timeout_error(request_id)
        return math.ceil(left * 1000)

    def _call(self, msg: ClientRequest, timeout: float | None) -> ClientReply:
        deadline = self._deadline(timeout)
        return self._receive(self._submit(msg, deadline), deadline)

    def _submit(self, msg: ClientRequest, deadline: float | None) -> _Inbox:
        self._check_open()
        inbox = self._register(msg.request_id)
        frame = self._requests.encode(msg)
        try:
            while True:
                try:
                    self._sock.send(frame, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    self._sock.poll(self._poll_ms(deadline, inbox.request_id), zmq.POLLOUT)
        except BaseException:
            self._release(inbox, abort=False)
            raise
        inbox.running = isinstance(msg, Generate)
        return inbox

    def _receive(self, inbox: _Inbox, deadline: float | None) -> ClientReply:
        """The next reply for ``inbox``; its request is released after its final reply and
        on any exception (``Timeout``, ``KeyboardInterrupt``)."""
        try:
            while not inbox.replies:
                self._poller.poll(self._poll_ms(deadline, inbox.request_id))
                self._service()
                self._drain()
        except BaseException:
            self._release(inbox, abort=True)
            raise
        reply = inbox.replies.popleft()
        if is_final(reply):
            self._release(inbox, abort=False)
        return reply


class TokenStream:
    """Iterator over the chunks of one streamed request (``Client.stream``).

    ``request_id`` is known before the first chunk; once the iterator is exhausted,
    ``result`` holds the ``GenerateResult``. An ``Error`` frame raises ``RequestError``.
    ``close()`` (or dropping the stream unfinished) aborts the request, best effort.
    """

    def __init__(self, client: Client, inbox: _Inbox, deadline: float | None) -> None:
        self.request_id = inbox.request_id
        self.result: GenerateResult | None = None
        self._client = client
        self._inbox = inbox
        self._deadline = deadline
        self._done = False
        weakref.finalize(self, client._abandoned.append, inbox)

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> TokenChunk:
        if self._done:
            raise StopIteration
        try:
            reply = self._client._receive(self._inbox, self._deadline)
            if isinstance(reply, Chunk):
                return _chunk(reply)
            self.result = _result(reply)
        except BaseException:
            self._done = True
            raise
        self._done = True
        raise StopIteration

    def close(self) -> None:
        self._done = True
        self._client._release(self._inbox, abort=True)


class AsyncClient(_Connection):
    """asyncio client of one daemon, bound to the event loop of its first call.

    Any number of tasks may call it at once: one reader task (started on the first call)
    routes every reply to its caller by ``request_id``. Arguments, timeouts and errors as for
    ``Client``; cancelling a call releases its request (a Generate is aborted, best effort).
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float | None = None,
        curve_server_key: CurveKey | None = None,
        curve_keypair: tuple[CurveKey, CurveKey] | None = None,
    ) -> None:
        ctx = zmq.asyncio.Context.instance()
        # The owners, used to wait and to send; NOBLOCK reads and best-effort aborts go
        # through the blocking views.
        self._asock = ctx.socket(zmq.DEALER)
        self._amonitor = ctx.socket(zmq.PAIR)
        super().__init__(
            self._asock, self._amonitor, endpoint, timeout, curve_server_key, curve_keypair
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task[None] | None = None

    async def generate(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[ChatMessage | Mapping[str, str]] | None = None,
        max_new_tokens: int | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        logprobs: int = 0,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        """As ``Client.generate``."""
        msg = _generate_request(
            prompt=prompt, input_ids=input_ids, messages=messages, request_id=request_id,
            stream=False, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=seed, stop=stop, stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos, logprobs=logprobs,
        )  # fmt: skip
        deadline = self._deadline(timeout)
        inbox = await self._submit(msg, deadline)
        while True:
            reply = await self._receive(inbox, deadline)
            if not isinstance(reply, Chunk):
                return _result(reply)

    def stream(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[ChatMessage | Mapping[str, str]] | None = None,
        max_new_tokens: int | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        logprobs: int = 0,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> AsyncTokenStream:
        """As ``Client.stream``, but the request is sent when iteration starts, and
        ``timeout`` counts from then."""
        msg = _generate_request(
            prompt=prompt, input_ids=input_ids, messages=messages, request_id=request_id,
            stream=True, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=seed, stop=stop, stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos, logprobs=logprobs,
        )  # fmt: skip
        return AsyncTokenStream(self, msg, timeout)

    async def abort(self, request_id: str, *, timeout: float | None = None) -> None:
        """As ``Client.abort``."""
        msg = Abort(request_id=_new_id(), target_id=request_id)
        _expect(await self._call(msg, timeout), Ack)

    async def health(self, timeout: float | None = 5.0) -> Health:
        """As ``Client.health``."""
        return _expect(await self._call(HealthQuery(request_id=_new_id()), timeout), Health)

    async def server_info(self, timeout: float | None = None) -> ServerInfo:
        """As ``Client.server_info``."""
        msg = ServerInfoQuery(request_id=_new_id())
        return _expect(await self._call(msg, timeout), ServerInfo)

    def close(self) -> None:
        """Close the socket and stop the reader; calls in flight end with ``connection_lost``.
        Call it on the client's event loop (``async with`` does)."""
        if self._closed:
            return
        self._fail_all("connection_lost", "the client was closed")
        if self._reader is not None:
            self._reader.cancel()
        self._close_sockets()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
        if self._reader is not None:
            await asyncio.wait([self._reader])

    def _deadline(self, timeout: float | None) -> float | None:
        seconds = self._resolve_timeout(timeout)
        return None if seconds is None else asyncio.get_running_loop().time() + seconds

    async def _call(self, msg: ClientRequest, timeout: float | None) -> ClientReply:
        deadline = self._deadline(timeout)
        return await self._receive(await self._submit(msg, deadline), deadline)

    def _start_reader(self) -> None:
        loop = asyncio.get_running_loop()
        if self._reader is None:
            self._loop = loop
            self._reader = loop.create_task(self._read_replies(), name="outrider-client-reader")
        elif loop is not self._loop:
            raise RuntimeError("an AsyncClient serves the event loop of its first call only")
        elif self._reader.done():
            raise RuntimeError("the reply reader of this AsyncClient has stopped")

    async def _read_replies(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._asock, zmq.POLLIN)
        poller.register(self._amonitor, zmq.POLLIN)
        try:
            while True:
                await poller.poll()
                self._service()
                self._drain()
        except Exception as exc:
            self._fail_all("internal", f"the reply reader failed: {exc!r}")
            raise

    async def _submit(self, msg: ClientRequest, deadline: float | None) -> _Inbox:
        self._check_open()
        self._start_reader()
        inbox = self._register(msg.request_id)
        try:
            async with asyncio.timeout_at(deadline):
                await self._asock.send(self._requests.encode(msg))
        except TimeoutError:
            self._release(inbox, abort=False)
            raise self._timeout_error(inbox.request_id) from None
        except BaseException:
            self._release(inbox, abort=False)
            raise
        inbox.running = isinstance(msg, Generate)
        return inbox

    async def _receive(self, inbox: _Inbox, deadline: float | None) -> ClientReply:
        """As ``Client._receive``; cancellation releases the request too."""
        try:
            async with asyncio.timeout_at(deadline):
                while not inbox.replies:
                    inbox.waiter = asyncio.get_running_loop().create_future()
                    await inbox.waiter
        except TimeoutError:
            self._release(inbox, abort=True)
            raise self._timeout_error(inbox.request_id) from None
        except BaseException:
            self._release(inbox, abort=True)
            raise
        finally:
            inbox.waiter = None
        reply = inbox.replies.popleft()
        if is_final(reply):
            self._release(inbox, abort=False)
        return reply


class AsyncTokenStream:
    """Async iterator over the chunks of one streamed request (``AsyncClient.stream``);
    otherwise as ``TokenStream``."""

    def __init__(self, client: AsyncClient, msg: Generate, timeout: float | None) -> None:
        self.request_id = msg.request_id
        self.result: GenerateResult | None = None
        self._client = client
        self._msg = msg
        self._timeout = timeout
        self._inbox: _Inbox | None = None
        self._deadline: float | None = None
        self._done = False

    def __aiter__(self) -> AsyncTokenStream:
        return self

    async def __anext__(self) -> TokenChunk:
        if self._done:
            raise StopAsyncIteration
        try:
            if self._inbox is None:
                self._deadline = self._client._deadline(self._timeout)
                self._inbox = await self._client._submit(self._msg, self._deadline)
                weakref.finalize(self, self._client._abandoned.append, self._inbox)
            reply = await self._client._receive(self._inbox, self._deadline)
            if isinstance(reply, Chunk):
                return _chunk(reply)
            self.result = _result(reply)
        except BaseException:
            self._done = True
            raise
        self._done = True
        raise StopAsyncIteration

    def close(self) -> None:
        self._done = True
        if self._inbox is not None:
            self._client._release(self._inbox, abort=True)


def _new_id() -> str:
    return uuid.uuid4().hex


def _key_bytes(key: CurveKey) -> bytes:
    return key.encode("ascii") if isinstance(key, str) else key


def _generate_request(
    *,
    prompt: str | None,
    input_ids: Sequence[int] | None,
    messages: Sequence[ChatMessage | Mapping[str, str]] | None,
    request_id: str | None,
    stream: bool,
    max_new_tokens: int | None,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stop: str | Sequence[str],
    stop_token_ids: Sequence[int],
    ignore_eos: bool,
    logprobs: int,
) -> Generate:
    request_id = request_id if request_id is not None else _new_id()
    if sum(x is not None for x in (prompt, input_ids, messages)) != 1:
        raise RequestError(
            "invalid_request", "give exactly one of prompt, input_ids, messages", request_id
        )
    chat: list[ChatMessage] | None = None
    if messages is not None:
        try:
            chat = [
                m if isinstance(m, ChatMessage) else msgspec.convert(m, ChatMessage)
                for m in messages
            ]
        except msgspec.ValidationError as exc:
            raise RequestError("invalid_request", f"messages: {exc}", request_id) from None
    return Generate(
        request_id=request_id,
        prompt=prompt,
        input_ids=list(input_ids) if input_ids is not None else None,
        messages=chat,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=[stop] if isinstance(stop, str) else list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        stream=stream,
    )


def _expect(reply: ClientReply, kind: type[R]) -> R:
    if isinstance(reply, kind):
        return reply
    if isinstance(reply, Error):
        raise RequestError(reply.code, reply.message, reply.request_id)
    raise RequestError("malformed", f"unexpected {type(reply).__name__} reply", reply.request_id)


def _result(reply: ClientReply) -> GenerateResult:
    done = _expect(reply, Finished)
    return GenerateResult(
        request_id=done.request_id,
        output_ids=done.output_ids,
        text=done.text,
        finish_reason=done.finish_reason,
        matched_stop=done.matched_stop,
        usage=done.usage,
        logprobs=done.logprobs,
    )


def _chunk(reply: Chunk) -> TokenChunk:
    return TokenChunk(
        request_id=reply.request_id,
        token_ids=reply.token_ids,
        text=reply.text,
        logprobs=reply.logprobs,
    )
