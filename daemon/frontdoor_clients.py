"""The front door's client socket: receiving, never-blocking sends, noticing vanished clients.

- Sends use DONTWAIT. When a client's pipe is full (its high-water mark is reached) the frame
  waits in that client's backlog and every later frame to that client queues behind it, so a
  client sees its frames in order. The backlogs are retried every ``FLUSH_INTERVAL_S``; a
  client whose backlog has not emptied for ``slow_consumer_timeout`` is a slow consumer.
- A client is gone when its connection closes, when a send to it answers EHOSTUNREACH
  (``ROUTER_MANDATORY``), or when it is a slow consumer: ``on_gone(identity, reason)`` is
  called once and the port forgets its backlog.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

if TYPE_CHECKING:
    from outrider.daemon.frontdoor import FrontDoorConfig

log = logging.getLogger("outrider.frontdoor")

FLUSH_INTERVAL_S = 0.005  # backlog retry period while any client's pipe is full
RECV_BATCH = 64  # client messages handled before yielding to the other tasks

T = TypeVar("T")


@dataclass
class _Backlog:
    since: float  # monotonic time at which the backlog became non-empty
    frames: deque[bytes] = field(default_factory=deque)


class ClientPort:
    """The bound client ROUTER and everything about its peers' connections."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        cfg: FrontDoorConfig,
        on_message: Callable[[bytes, list[zmq.Frame]], None],
        on_gone: Callable[[bytes, str], None],
    ) -> None:
        sock = ctx.socket(zmq.ROUTER)
        sock.router_mandatory = 1  # a send to a vanished client raises EHOSTUNREACH
        sock.sndhwm = sock.rcvhwm = cfg.client_hwm
        sock.linger = 0
        sock.maxmsgsize = cfg.max_message_bytes
        sock.heartbeat_ivl = cfg.heartbeat_ivl_ms  # a silent TCP peer is disconnected
        sock.heartbeat_timeout = 3 * cfg.heartbeat_ivl_ms
        if cfg.curve_server_keys is not None:
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = cfg.curve_server_keys
        monitor_address = f"inproc://frontdoor-monitor-{id(self)}"
        sock.monitor(monitor_address, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._monitor = ctx.socket(zmq.PAIR)
        # NOTE: libzmq's I/O thread blocks when the monitor pipe is full: keep it unbounded.
        self._monitor.rcvhwm = 0
        self._monitor.linger = 0
        self._monitor.connect(monitor_address)
        sock.bind(cfg.client_endpoint)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        self._on_message = on_message
        self._on_gone = on_gone
        self._slow_after = cfg.slow_consumer_timeout
        self._backlogs: dict[bytes, _Backlog] = {}
        self._pending = asyncio.Event()  # set while any backlog is non-empty
        # Which client vanished, from each message's source fd (ZMQ_SRCFD) and the monitor's
        # ACCEPTED / DISCONNECTED events. ROUTER_NOTIFY would say it directly, but it is a
        # libzmq draft API, absent from pyzmq's wheels.
        self._open_fds: set[int] = set()
        self._fd_of: dict[bytes, int] = {}
        self._identity_on_fd: dict[int, bytes] = {}

    @property
    def backlogged(self) -> bool:
        """Whether frames wait for a client whose pipe is full."""
        return bool(self._backlogs)

    def send(self, identity: bytes, frame: bytes) -> bool:
        """Send or queue one frame; False (after ``on_gone``) if the client is gone."""
        backlog = self._backlogs.get(identity)
        if backlog is not None:
            backlog.frames.append(frame)
            return True
        sent = self._try_send(identity, frame)
        if sent is None:
            self._backlogs[identity] = _Backlog(time.monotonic(), deque([frame]))
            self._pending.set()
        elif not sent:
            self._gone(identity, "client disconnected")
        return sent is not False

    async def receive_loop(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            await poller.poll()
            for _ in range(RECV_BATCH):
                # NOTE: monitor events first. libzmq queues ACCEPTED before it reads from a
                # new fd and DISCONNECTED before it closes one, so when a message is handled
                # every earlier event about its fd has been seen, even if the fd number was
                # reused by a new connection.
                self._read_connection_events()
                try:
                    frames = _nowait(self._sock.recv_multipart(zmq.DONTWAIT, copy=False))
                except zmq.Again:
                    break
                self._on_frames(frames)
            await asyncio.sleep(0)  # a ready poll() does not yield: let the other tasks run

    async def flush_loop(self) -> None:
        while True:
            await self._pending.wait()
            await asyncio.sleep(FLUSH_INTERVAL_S)
            now = time.monotonic()
            for identity, backlog in list(self._backlogs.items()):
                sent: bool | None = True
                while backlog.frames:
                    sent = self._try_send(identity, backlog.frames[0])
                    if not sent:
                        break
                    backlog.frames.popleft()
                if sent is False:
                    self._gone(identity, "client disconnected")
                elif not backlog.frames:
                    del self._backlogs[identity]
                elif now - backlog.since >= self._slow_after:
                    log.warning(
                        "client %s read nothing for %.1f s", identity.hex(), now - backlog.since
                    )
                    self._gone(identity, "slow consumer")
            if not self._backlogs:
                self._pending.clear()

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        fd = frames[-1].get(zmq.SRCFD)
        if fd not in self._open_fds:
            # Read after its connection closed: nobody is left to answer.
            self._gone(identity, "client disconnected")
            return
        if self._fd_of.get(identity) != fd:
            self._fd_of[identity] = fd
            self._identity_on_fd[fd] = identity
        self._on_message(identity, frames[1:])

    def _read_connection_events(self) -> None:
        while True:
            try:
                event = parse_monitor_message(_nowait(self._monitor.recv_multipart(zmq.DONTWAIT)))
            except zmq.Again:
                return
            fd = event["value"]
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._open_fds.add(fd)
                continue
            self._open_fds.discard(fd)
            identity = self._identity_on_fd.pop(fd, None)
            if identity is not None and self._fd_of.get(identity) == fd:
                self._gone(identity, "client disconnected")

    def _gone(self, identity: bytes, reason: str) -> None:
        self._backlogs.pop(identity, None)
        fd = self._fd_of.pop(identity, None)
        if fd is not None and self._identity_on_fd.get(fd) == identity:
            del self._identity_on_fd[fd]
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


def _nowait(call: Awaitable[T]) -> T:
    """The outcome of a DONTWAIT call on an asyncio socket: resolved at once, it raises
    ``zmq.Again`` when the call would block."""
    assert isinstance(call, asyncio.Future) and call.done()
    return call.result()
