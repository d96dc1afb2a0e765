"""The front door's client socket: receiving, never-blocking sends, noticing vanished clients.

- Sends use DONTWAIT. When a client's pipe is full (its high-water mark is reached) the frame
  waits in that client's backlog and every later frame to that client queues behind it, so a
  client sees its frames in order. The backlogs are retried every ``FLUSH_INTERVAL_S``; a
  client whose backlog has not emptied for ``slow_consumer_timeout`` is a slow consumer.
- A client is gone when a send to it answers EHOSTUNREACH (``ROUTER_MANDATORY``: the ROUTER
  holds no connection with its routing id) or when it is a slow consumer: ``on_gone(identity,
  reason)`` is called once and the port forgets its backlog. Each watched client (one with
  requests in flight) is sent a probe frame that clients ignore, ``PROBE_FIRST_S`` after it
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
from collections import deque
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator

from outrider.daemon.curve_auth import start_client_auth
from outrider.protocol.endpoints import ipc_path

if TYPE_CHECKING:
    from outrider.daemon.frontdoor import FrontDoorConfig

log = logging.getLogger("outrider.frontdoor")

FLUSH_INTERVAL_S = 0.005  # backlog retry period while any client's pipe is full
PROBE_FIRST_S = 0.5  # a client with requests in flight is first probed after this long
PROBE_MAX_S = 8.0  # the longest interval between its probes
RECV_BATCH = 64  # client messages handled before yielding to the other tasks

T = TypeVar("T")


@dataclass
class _Backlog:
    since: float  # monotonic time at which the backlog became non-empty
    frames: deque[bytes] = field(default_factory=deque)


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
        self._on_gone = on_gone
        self._slow_after = cfg.slow_consumer_timeout
        self._backlogs: dict[bytes, _Backlog] = {}
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
        while True:
            await poller.poll()
            for _ in range(RECV_BATCH):
                try:
                    frames = _nowait(self._sock.recv_multipart(zmq.DONTWAIT, copy=False))
                except zmq.Again:
                    break
                self._on_message(frames[0].bytes, frames[1:])
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
                self.send(identity, probe)

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
