"""The connection ``Client`` and ``AsyncClient`` build on: their constructor, socket
configuration, reply demultiplexing into one inbox per live request, link supervision and
deadlines. Everything here runs without blocking; the clients add the waiting.

Lifetime of a live request on a client:

```
register (id unique among live ids) -> send -> replies...  -> final reply: unregistered
                                             -> timeout / cancel / stream dropped: unregistered,
                                                and a Generate still running is aborted
                                             -> link lost / daemon restarted / handshake
                                                failed (or dropped SILENT_DROPS_LIMIT times
                                                in a row): final Error('connection_lost')
                                                delivered locally
                                             -> connected, but nothing at all heard for
                                                idle_timeout: Timeout, unregistered (aborted)
                                             -> never connected for connect_timeout:
                                                NotListening, unregistered (aborted)
```
Nothing is ever resubmitted. Every call has a deadline by default: the daemon sends a
client with calls in flight some frame at least every ``PROBE_MAX_S`` (a reply, or a probe),
so a connected client that hears nothing for ``idle_timeout`` (``IDLE_TIMEOUT_S`` unless
given; None: never) has lost it. While no connection exists a wait is for a daemon to bind, for
``connect_timeout`` (``CONNECT_TIMEOUT_S`` unless given; None: as long as the caller's
``timeout``): a daemon that does not exist is told from one that is slow, within seconds. A
request frame over ``max_message_bytes`` (the daemon's ``--max-message-bytes``) is refused
before it is sent: the daemon would drop the whole connection for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections import deque
from typing import Any, Final

import zmq
from zmq.utils.monitor import parse_monitor_message

from outrider.protocol._client_common import CurveKey, abort_request
from outrider.protocol.endpoints import default_endpoint, not_listening_reason
from outrider.protocol.errors import NotListening, RequestError, Timeout
from outrider.protocol.frames import FrameError, reply_codec, request_codec
from outrider.protocol.messages import (
    DEFAULT_MAX_MESSAGE_BYTES,
    PROBE_MAX_S,
    ClientReply,
    ClientRequest,
    Error,
    ErrorCode,
    Generate,
    Health,
    ServerInfo,
    is_final,
    request_revision,
)

# Unsent frames (a best-effort abort at close) get this long; close() itself never blocks.
LINGER_MS: Final = 500
HEARTBEAT_IVL_MS: Final = 2_000
HEARTBEAT_TIMEOUT_MS: Final = 10_000
IDLE_TIMEOUT_S: Final = 4 * PROBE_MAX_S
# A local daemon connects within milliseconds once bound; this leaves room for a busy host and
# a remote one, and for a daemon whose front door is still starting.
CONNECT_TIMEOUT_S: Final = 10.0
# Replies ZeroMQ's I/O thread takes in for a client that is not reading them (libzmq's
# default); past it they wait in the daemon, which ends a client that stays behind
# (slow_consumer). 0: no limit, for a server that reads promptly and bounds its own memory.
REPLY_HWM: Final = 1000
# Handshakes dropped without a reason, in a row, before the calls in flight fail: a wrong
# curve_server_key, or a peer that is no daemon; libzmq retries every 100 ms meanwhile.
SILENT_DROPS_LIMIT: Final = 3

_MONITOR_EVENTS: Final = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)


class Inbox:
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
        self.wake()

    def wake(self) -> None:
        """Let the task waiting on this inbox look again (a reply, or a changed deadline)."""
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class Connection:
    """Socket setup, reply routing and link supervision shared by both clients. Every method
    runs on the client's one thread (for ``AsyncClient``: its event loop). A client supplies
    its sockets (``_open_sockets``), its clock (``_now``) and what starts and stops its reading
    (``_start_reading``, ``_stop_reading``)."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float | None = None,
        idle_timeout: float | None = IDLE_TIMEOUT_S,
        connect_timeout: float | None = CONNECT_TIMEOUT_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        reply_hwm: int = REPLY_HWM,
        curve_server_key: CurveKey | None = None,
        curve_keypair: tuple[CurveKey, CurveKey] | None = None,
    ) -> None:
        self.endpoint = endpoint if endpoint is not None else default_endpoint()
        self.timeout = timeout
        self.idle_timeout = idle_timeout
        self.connect_timeout = connect_timeout
        self.max_message_bytes = max_message_bytes
        self._heard_at = -math.inf  # time.monotonic() of the last frame or connect event
        self.boot_id: str | None = None  # the last one seen in Health / ServerInfo
        self._requests = request_codec()
        self._replies = reply_codec()
        self._pending: dict[str, Inbox] = {}
        # Inboxes of streams garbage-collected unfinished; appended from any thread.
        self._abandoned: deque[Inbox] = deque()
        self._lost_since_boot = False
        self._handshake_failure = ""
        self._link_dead = ""  # why the socket will never connect again
        self._connected = False  # the DEALER holds a connection to the endpoint now
        self._linked = False  # ... and that connection finished its handshake
        self._silent_drops = 0  # handshakes in a row dropped without a reason
        self._closed = False
        # NOTE: only the owners may close the sockets. A socket closed through another
        # object is closed again by its owner when collected, by then perhaps a new socket
        # at the same address. Everything else uses these non-owning blocking views.
        dealer, monitor = self._owners = self._open_sockets()
        self._sock: zmq.Socket[bytes] = zmq.Socket.shadow(dealer.underlying)
        self._monitor: zmq.Socket[bytes] = zmq.Socket.shadow(monitor.underlying)
        try:
            if curve_keypair is not None and curve_server_key is None:
                raise ValueError("curve_keypair needs curve_server_key")
            self._configure(curve_server_key, curve_keypair, reply_hwm)
            try:
                self._sock.connect(self.endpoint)
            except zmq.ZMQError as exc:
                raise ValueError(f"cannot connect to {self.endpoint!r}: {exc}") from exc
        except BaseException:
            self._close_sockets(linger=0)
            raise

    def _configure(
        self,
        curve_server_key: CurveKey | None,
        curve_keypair: tuple[CurveKey, CurveKey] | None,
        reply_hwm: int,
    ) -> None:
        sock = self._sock
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.RCVHWM, reply_hwm)
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

    def _open_sockets(self) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
        """A new DEALER and a PAIR (the monitor's reader), which this client owns."""
        raise NotImplementedError

    def _now(self) -> float:
        """The clock deadlines are taken on (seconds)."""
        raise NotImplementedError

    def _start_reading(self) -> None:
        """Make sure whatever reads replies in the background runs (called before a send)."""

    def _stop_reading(self) -> None:
        """Stop whatever reads replies in the background (called by ``_shutdown``)."""

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the client is closed")

    def _shutdown(self) -> None:
        """Close the sockets; unfinished calls and streams end with ``connection_lost``."""
        if self._closed:
            return
        self._fail_all("connection_lost", "the client was closed")
        self._stop_reading()
        self._close_sockets()

    def _close_sockets(self, linger: int | None = None) -> None:
        self._closed = True
        # NOTE: libzmq sends monitor events from its I/O thread, blocking: once the reading
        # PAIR is closed, one more event from the DEALER (lingering, retrying a failed CURVE
        # handshake) blocks that thread for good, and every socket of the context with it.
        # The monitor must stop before its reader closes.
        self._sock.disable_monitor()
        for sock in self._owners:
            sock.close(linger=linger)

    def _deadline(self, timeout: float | None) -> float | None:
        """When a call given ``timeout`` (None: the client's default) gives up, on ``_now``'s
        clock; None: never."""
        chosen = self.timeout if timeout is None else timeout
        seconds = None if chosen is None or math.isinf(chosen) else chosen
        return None if seconds is None else self._now() + seconds

    def _timeout_error(self, request_id: str) -> Timeout:
        if self._connected:
            return Timeout(f"the daemon at {self.endpoint} did not answer in time", request_id)
        return NotListening(not_listening_reason(self.endpoint), request_id)

    def _wait_limit(self, deadline: float | None, since: float, request_id: str) -> float | None:
        """When a wait that began at ``since`` (``time.monotonic()``) must look again, on
        ``_now``'s clock (None: never): the caller's ``deadline``, or the idle limit while
        connected, or the connect limit while not, whichever comes first. Raises ``Timeout``
        (``NotListening`` while not connected) once one of them has passed."""
        now = self._now()
        if deadline is not None and now >= deadline:
            raise self._timeout_error(request_id)
        if not self._connected:
            if self.connect_timeout is None:
                return deadline
            connect_left = since + self.connect_timeout - time.monotonic()
            if connect_left <= 0:
                raise NotListening(not_listening_reason(self.endpoint), request_id)
            connect_until = now + connect_left
            return connect_until if deadline is None else min(deadline, connect_until)
        if self.idle_timeout is None:
            return deadline
        idle_left = max(self._heard_at, since) + self.idle_timeout - time.monotonic()
        idle_until = now + idle_left
        if idle_left <= 0:
            raise Timeout(
                f"the daemon at {self.endpoint} sent nothing for {self.idle_timeout:g} s "
                "(idle_timeout): it is stuck, or this client was cut off",
                request_id,
            )
        return idle_until if deadline is None else min(deadline, idle_until)

    def _encode(self, msg: ClientRequest) -> bytes:
        """``msg`` as a frame; ``RequestError('invalid_request')`` when it is over
        ``max_message_bytes``."""
        frame = self._requests.encode(msg, request_revision(msg))
        if len(frame) > self.max_message_bytes:
            raise RequestError(
                "invalid_request",
                f"the request is {len(frame)} bytes, over the daemon's limit of "
                f"{self.max_message_bytes} (--max-message-bytes)",
                msg.request_id,
            )
        return frame

    def _register(self, request_id: str) -> Inbox:
        self._service()
        if self._link_dead:
            raise RequestError("connection_lost", self._link_dead, request_id)
        if request_id in self._pending:
            raise RequestError(
                "duplicate_request_id", "already in flight on this client", request_id
            )
        inbox = Inbox(request_id)
        self._pending[request_id] = inbox
        return inbox

    def _mark_sent(self, inbox: Inbox, msg: ClientRequest) -> Inbox:
        """Note that ``msg`` left, unless the link was lost before it could: from now on a
        Generate may run on the daemon."""
        inbox.running = isinstance(msg, Generate) and not inbox.final
        return inbox

    def _take(self, inbox: Inbox) -> ClientReply:
        """The oldest reply in ``inbox`` (one must be there); after the final one the request
        is released."""
        reply = inbox.replies.popleft()
        if is_final(reply):
            self._release(inbox, abort=False)
        return reply

    def _release(self, inbox: Inbox, *, abort: bool) -> None:
        """Stop waiting for ``inbox``; with ``abort``, a Generate that may still run on the
        daemon is aborted (best effort: its Ack and final frame are dropped)."""
        if self._pending.get(inbox.request_id) is not inbox:
            return
        del self._pending[inbox.request_id]
        if abort and inbox.running and not inbox.final and not self._closed:
            abort_frame = abort_request(inbox.request_id)
            frame = self._requests.encode(abort_frame, request_revision(abort_frame))
            # NOTE: with the send queue full the abort is skipped: the daemon finishes the
            # request and its replies are dropped.
            with contextlib.suppress(zmq.Again):
                self._sock.send(frame, zmq.NOBLOCK)
            # NOTE: any operation may consume the edge-triggered readiness of the socket's fd,
            # which AsyncClient's reader waits on: read what has arrived, or it would sit there.
            self._drain()

    def _pump(self) -> None:
        """Handle what is waiting after a wake-up: link events first, then replies."""
        self._service()
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
            self._heard_at = time.monotonic()
            self._dispatch(frames[0])

    def _dispatch(self, frame: bytes) -> None:
        try:
            reply: ClientReply = self._replies.decode(frame)
        except FrameError as exc:
            # A daemon speaking another protocol version fails every call; any other
            # undecodable frame ends the request it still names, or is dropped.
            if exc.code == "unsupported_version":
                self._fail_all("unsupported_version", exc.message)
                return
            if not exc.request_id:
                return
            message = f"undecodable reply from {self.endpoint}: {exc.message}"
            reply = Error(request_id=exc.request_id, code="malformed", message=message)
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
            if event == zmq.EVENT_CONNECTED:
                self._connected = True
                self._heard_at = time.monotonic()
                # The idle limit starts now: waiters computed their wake-up without it.
                for inbox in self._pending.values():
                    inbox.wake()
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._linked = True
                self._silent_drops = 0
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._handshake_failure = " (handshake failed: authentication)"
            elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                self._handshake_failure = " (handshake failed: protocol)"
            else:
                self._lose_link()

    def _lose_link(self) -> None:
        """The connection dropped: the calls it may have carried fail, and a failed handshake
        marks the link dead for good."""
        linked, self._connected, self._linked = self._linked, False, False
        reason, self._handshake_failure = self._handshake_failure, ""
        if not linked and not reason:
            # NOTE: a connection dropped mid-handshake without a stated reason carried nothing:
            # ZeroMQ keeps the requests queued and retries. Once can be a race (the peer closed
            # before the client read why); again and again, the peer will never accept us.
            self._silent_drops += 1
            if self._silent_drops < SILENT_DROPS_LIMIT:
                return
            reason = (
                f" ({self._silent_drops} handshakes in a row failed without a reason:"
                " no daemon, or one with another CURVE setting)"
            )
        self._silent_drops = 0
        # NOTE: replies that arrived before the link dropped are queued ahead of this event;
        # deliver them first so that only unanswered calls fail.
        self._drain()
        message = f"connection to {self.endpoint} lost{reason}"
        self._fail_all("connection_lost", message)
        self._lost_since_boot = True
        if reason.startswith(" (handshake failed"):
            # NOTE: libzmq never reconnects after a failed handshake (a plain client at a
            # CURVE server, a key the server refuses): every later call would wait for
            # nothing. The events often arrive before the first call.
            self._link_dead = message

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


def _key_bytes(key: CurveKey) -> bytes:
    return key.encode("ascii") if isinstance(key, str) else key
