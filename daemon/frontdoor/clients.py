"""The front door's client socket: receiving, never-blocking sends, noticing vanished clients.

- Sends use DONTWAIT. When a client's pipe is full (its high-water mark is reached) the frame
  waits in that client's backlog and every later frame to that client queues behind it, so a
  client sees its frames in order. The backlogs are retried every ``FLUSH_INTERVAL_S``.
- A client whose backlog holds chunks or probes and has not emptied for
  ``slow_consumer_timeout``, or has grown past ``max_backlog_bytes``, is a slow consumer:
  the frames queued for it that end nothing (chunks, probes) are dropped, ``on_slow`` ends
  every request it still has with a final frame, queued behind the finals it has not read,
  and the wait starts again. A backlog thus holds final frames, one per request, and what
  came after the last eviction. A client whose finals alone are past ``max_backlog_bytes``
  (it sends requests and never reads) is cut off: its backlog is dropped, ``on_gone`` is
  called, and it is never sent to nor heard again (its client library's idle limit ends its
  calls).
- A client is gone when a send to it answers EHOSTUNREACH (``ROUTER_MANDATORY``: the ROUTER
  holds no connection with its routing id) or when it is cut off: ``on_gone(identity,
  reason)`` is called once and the port forgets its backlog. Each watched client (one with
  calls in flight) is sent a probe frame that clients ignore, ``PROBE_FIRST_S`` after it
  became watched and then at doubling intervals up to ``PROBE_MAX_S``, so that a client that
  vanished while its request runs is noticed even when nothing else is sent to it, and one
  that waits long before reading finds only a few probes queued.
- Every message is handed on, whatever the state of its connection: a reply to a client that
  is gone fails its send, which is how the front door learns of it.

NOTE: the socket monitor cannot say which client vanished. Its ACCEPTED / DISCONNECTED events
name a file descriptor only, and they reach the reader in no fixed order with the messages: a
new connection's first message can be read before its ACCEPTED event, and a closed
connection's DISCONNECTED after a message of the new connection that reused its descriptor.
A message's source descriptor (ZMQ_SRCFD) is absent for ZMTP 1.0/2.0 peers. EHOSTUNREACH is
exact.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import TypeVar

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator

from outrider.daemon.frontdoor.config import FrontDoorConfig
from outrider.daemon.frontdoor.curve_auth import start_client_auth
from outrider.protocol.endpoints import ipc_path
from outrider.protocol.messages import PROBE_MAX_S

log = logging.getLogger("outrider.frontdoor")

FLUSH_INTERVAL_S = 0.005  # backlog retry period while any client's pipe is full
PROBE_FIRST_S = 0.5  # a client with calls in flight is first probed after this long
RECV_BATCH = 64  # client messages handled before yielding to the other tasks
CUT_OFF_REMEMBERED = 4096  # identities of cut-off clients whose messages are ignored

T = TypeVar("T")


@dataclass
class _Backlog:
    since: float  # monotonic time at which the backlog became non-empty, or was evicted
    frames: deque[tuple[bytes, bool]] = field(default_factory=deque)  # (frame, is final)
    size: int = 0  # bytes in frames
    partials: int = 0  # frames that end nothing (chunks, probes)
    evicting: bool = False  # its requests are being ended: their finals queue unchecked

    def append(self, frame: bytes, final: bool) -> None:
        self.frames.append((frame, final))
        self.size += len(frame)
        self.partials += not final

    def popleft(self) -> None:
        frame, final = self.frames.popleft()
        self.size -= len(frame)
        self.partials -= not final

    def keep_finals(self) -> int:
        """Drop every frame that ends nothing; returns how many were dropped."""
        dropped = self.partials
        self.frames = deque(entry for entry in self.frames if entry[1])
        self.size = sum(len(frame) for frame, _ in self.frames)
        self.partials = 0
        return dropped


@dataclass
class _ProbeDue:
    at: float  # monotonic time of the next probe
    interval: float = PROBE_FIRST_S / 2  # doubled before each probe


class ClientPort:
    """The bound client ROUTER and what is known about its peers."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        cfg: FrontDoorConfig,
        on_message: Callable[[bytes, list[zmq.Frame]], None],
        on_slow: Callable[[bytes, str], None],
        on_gone: Callable[[bytes, str], None],
    ) -> None:
        sock = ctx.socket(zmq.ROUTER)
        sock.router_mandatory = 1  # a send to a vanished client raises EHOSTUNREACH
        sock.sndhwm = sock.rcvhwm = cfg.client_hwm
        sock.linger = 0
        sock.maxmsgsize = cfg.max_message_bytes
        sock.heartbeat_ivl = cfg.heartbeat_ivl_ms  # a silent TCP peer is disconnected
        sock.heartbeat_timeout = 3 * cfg.heartbeat_ivl_ms
        self._auth: ThreadAuthenticator | None = None
        if cfg.curve_server_keys is not None:
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = cfg.curve_server_keys
            self._auth = start_client_auth(ctx, cfg.curve_client_keys)
        self._sock = sock
        try:
            _bind(sock, cfg.client_endpoint, cfg.socket_mode)
        except BaseException:
            self.close(0)
            raise
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._on_message = on_message
        self._on_slow = on_slow
        self._on_gone = on_gone
        self._slow_after = cfg.slow_consumer_timeout
        self._max_backlog = cfg.max_backlog_bytes
        self._backlogs: dict[bytes, _Backlog] = {}
        self._cut_off: OrderedDict[bytes, None] = OrderedDict()
        self._pending = asyncio.Event()  # set while any backlog is non-empty

    def close(self, linger_ms: int) -> None:
        """Close the socket, then stop the ZAP handler (with none, any CURVE client gets in)."""
        self._sock.close(linger=linger_ms)
        if self._auth is not None:
            self._auth.stop()

    @property
    def backlogged(self) -> bool:
        """Whether frames wait for a client whose pipe is full."""
        return bool(self._backlogs)

    def send(self, identity: bytes, frame: bytes, final: bool) -> bool:
        """Send or queue one frame (``final``: it ends a request or a call); False (after
        ``on_gone``, or for a client cut off before) if the client is gone."""
        if identity in self._cut_off:
            return False
        backlog = self._backlogs.get(identity)
        if backlog is None:
            sent = self._try_send(identity, frame)
            if sent is False:
                self._gone(identity, "client disconnected")
            if sent is not None:
                return sent
            backlog = self._backlogs[identity] = _Backlog(time.monotonic())
            self._pending.set()
        backlog.append(frame, final)
        if backlog.size > self._max_backlog and not backlog.evicting:
            self._evict(identity, backlog, f"{backlog.size} bytes queued")
        return identity not in self._cut_off

    async def receive_loop(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while True:
            await poller.poll()
            for _ in range(RECV_BATCH):
                try:
                    frames = _nowait(self._sock.recv_multipart(zmq.DONTWAIT, copy=False))
                except zmq.Again:
                    break
                identity = frames[0].bytes
                if identity not in self._cut_off:
                    self._on_message(identity, frames[1:])
            await asyncio.sleep(0)  # a ready poll() does not yield: let the other tasks run

    async def probe_loop(self, watched: Callable[[], Collection[bytes]], probe: bytes) -> None:
        """Send ``probe`` to the clients in ``watched()`` when they are due; one whose pipe is
        backlogged is already being tried by ``flush_loop``."""
        due: dict[bytes, _ProbeDue] = {}
        while True:
            await asyncio.sleep(PROBE_FIRST_S / 4)
            now = time.monotonic()
            clients = watched()
            for identity in [known for known in due if known not in clients]:
                del due[identity]
            for identity in list(clients):
                next_probe = due.setdefault(identity, _ProbeDue(now + PROBE_FIRST_S))
                if now < next_probe.at or identity in self._backlogs:
                    continue
                next_probe.interval = min(2 * next_probe.interval, PROBE_MAX_S)
                next_probe.at = now + next_probe.interval
                self.send(identity, probe, final=False)

    async def flush_loop(self) -> None:
        while True:
            await self._pending.wait()
            await asyncio.sleep(FLUSH_INTERVAL_S)
            now = time.monotonic()
            for identity, backlog in list(self._backlogs.items()):
                sent: bool | None = True
                while backlog.frames:
                    sent = self._try_send(identity, backlog.frames[0][0])
                    if not sent:
                        break
                    backlog.popleft()
                if sent is False:
                    self._gone(identity, "client disconnected")
                elif not backlog.frames:
                    del self._backlogs[identity]
                elif now - backlog.since < self._slow_after:
                    pass
                elif backlog.partials:
                    self._evict(identity, backlog, f"behind for {now - backlog.since:.1f} s")
                else:  # finals only: nothing runs for it, they wait for it to read
                    backlog.since = now
            if not self._backlogs:
                self._pending.clear()

    def _evict(self, identity: bytes, backlog: _Backlog, why: str) -> None:
        """A slow consumer: keep only its finals, end what it still has, wait again; cut it
        off if its finals alone are over the limit."""
        dropped = backlog.keep_finals()
        log.warning(
            "client %s does not keep up (%s): %d frames dropped, %d finals kept",
            identity.hex(),
            why,
            dropped,
            len(backlog.frames),
        )
        backlog.since = time.monotonic()
        backlog.evicting = True
        try:
            self._on_slow(identity, why)  # its finals queue behind the kept ones
        finally:
            backlog.evicting = False
        if backlog.size > self._max_backlog:
            self._cut(identity, backlog.size)

    def _cut(self, identity: bytes, queued: int) -> None:
        log.warning(
            "client %s is cut off: %d bytes of finals queued for it (the limit is %d)",
            identity.hex(),
            queued,
            self._max_backlog,
        )
        self._cut_off[identity] = None
        if len(self._cut_off) > CUT_OFF_REMEMBERED:
            self._cut_off.popitem(last=False)
        self._gone(identity, "slow consumer cut off")

    def _gone(self, identity: bytes, reason: str) -> None:
        self._backlogs.pop(identity, None)
        self._on_gone(identity, reason)

    def _try_send(self, identity: bytes, frame: bytes) -> bool | None:
        """True: sent; None: the client's pipe is full; False: no such client."""
        # NOTE: nothing sends on the client socket without DONTWAIT, so the future is already
        # resolved. Going through the asyncio socket (not a blocking shadow of it) keeps its
        # edge-triggered receive wake-ups correct.
        try:
            _nowait(self._sock.send_multipart([identity, frame], flags=zmq.DONTWAIT))
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EAGAIN:
                return None
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise
        return True


def _bind(sock: zmq.asyncio.Socket, endpoint: str, mode: int) -> None:
    """Bind ``endpoint``; an ``ipc://`` socket file gets ``mode``, whatever the umask.

    NOTE: the file is created under a umask that leaves only the owner's bits and widened to
    ``mode`` after, so no process outside ``mode`` can connect at any moment. An abstract
    socket (``ipc://@name``) has no file: any process in the network namespace may connect.
    """
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        sock.bind(endpoint)
        return
    old_umask = os.umask(0o177)
    try:
        sock.bind(endpoint)
    finally:
        os.umask(old_umask)
    path = ipc_path(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    assert path is not None
    os.chmod(path, mode)


def _nowait(call: Awaitable[T]) -> T:
    """The outcome of a DONTWAIT call on an asyncio socket: resolved at once, it raises
    ``zmq.Again`` when the call would block."""
    assert isinstance(call, asyncio.Future) and call.done()
    return call.result()
