"""What the daemon's two children (front door, detokenizer) share as processes.

Each child is started with the spawn method and handed one end of a ``multiprocessing.Pipe``
(``parent_conn``). The contract with the daemon:

- the child ignores SIGINT and SIGTERM: the daemon stops it after draining;
- it reports ``ChildStatus`` messages (internal.py) with ``send_bytes``, and a heartbeat from
  its event loop every ``CHILD_HEARTBEAT_S`` (a child whose loop hangs stops the systemd
  watchdog pings, processes/server.py); the parent never
  writes to the pipe, so the pipe becoming readable means the parent closed it or died. The
  child then stops taking new work, passes on what is already on its way until its inputs
  have been quiet for ``QUIET_S`` (at most ``FLUSH_LIMIT_S``), and exits, giving its sockets
  ``EXIT_LINGER_MS`` to deliver what they hold. So no child outlives the daemon, and the
  final frames of a drained daemon still reach their clients when it stops the detokenizer
  first, then the front door;
- an internal error ends the child with a non-zero exit code; the daemon, which watches the
  child's sentinel, then exits non-zero as well rather than serve half-alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from multiprocessing.connection import Connection
from typing import Any, Literal, cast

import uvloop
import zmq
import zmq.asyncio

from outrider.daemon.internal import ChildState, ChildStatus, child_status_codec
from outrider.daemon.processes.logs import configure_logging
from outrider.daemon.tokenizer import child_environment_setup

ChildName = Literal["frontdoor", "detokenizer", "http"]

CHILD_HEARTBEAT_S = 1.0
QUIET_S = 0.1
FLUSH_LIMIT_S = 2.0
EXIT_LINGER_MS = 500


def child_setup(name: ChildName, log_level: str) -> None:
    """First thing in a child's entry point, before anything imports transformers."""
    child_environment_setup()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fmt = f"%(asctime)s {name}[%(process)d] %(levelname)s %(name)s: %(message)s"
    configure_logging(log_level, fmt)


class ParentPipe:
    """The child's end of its spawn pipe."""

    def __init__(self, conn: Connection, child: ChildName) -> None:
        self._conn = conn
        self._child = child
        self._codec = child_status_codec()

    def report(self, state: ChildState, endpoint: str = "", error: str = "") -> None:
        # torch is blocked in children with a None entry (tokenizer.child_environment_setup).
        torch_imported = sys.modules.get("torch") is not None
        status = ChildStatus(self._child, os.getpid(), state, torch_imported, endpoint, error)
        # OSError: the parent is gone, and the pipe watcher ends this child.
        with contextlib.suppress(OSError):
            self._conn.send_bytes(self._codec.encode(status))

    def beat(self) -> None:
        """A heartbeat, skipped while the parent is not reading (it loads the model): the
        pipe is a Unix socket pair, writable only while at most a quarter of its buffer is
        taken, so a small write then never blocks this child's event loop."""
        _readable, writable, _ = select.select([], [self._conn.fileno()], [], 0)
        if writable:
            self.report("alive")

    def watch(self, on_close: Callable[[], None]) -> None:
        """Call ``on_close`` once the pipe is readable, i.e. the parent closed it or died."""
        loop = asyncio.get_running_loop()
        fd = self._conn.fileno()

        def closed() -> None:
            loop.remove_reader(fd)
            on_close()

        loop.add_reader(fd, closed)


def internal_receiver(ctx: zmq.asyncio.Context, bind: str) -> zmq.asyncio.Socket:
    """The receiving end (PULL) of an internal pipe: one writer, one reader; the reader binds."""
    sock = ctx.socket(zmq.PULL)
    _internal_options(sock)
    sock.bind(bind)
    return sock


def internal_sender(ctx: zmq.asyncio.Context, connect: str) -> zmq.Socket[bytes]:
    """The sending end (PUSH) of an internal pipe: a plain socket, since sends never wait."""
    # pyzmq's stubs tie socket_class to the context's own class; a plain socket is meant.
    sock = cast(
        "zmq.Socket[bytes]",
        ctx.socket(zmq.PUSH, socket_class=zmq.Socket),  # type: ignore[arg-type]
    )
    _internal_options(sock)
    sock.connect(connect)
    return sock


def _internal_options(sock: zmq.Socket[Any]) -> None:
    # Unbounded: both ends are ours and the front door's in-flight limits bound what can be
    # queued, so a send never waits or fails, and sends leave in call order.
    sock.sndhwm = sock.rcvhwm = 0
    sock.linger = 0


class ChildTasks:
    """A child's tasks: the first one to fail, or the parent closing the pipe, ends them all."""

    def __init__(self, parent: ParentPipe) -> None:
        self._parent = parent
        self._tasks: set[asyncio.Task[None]] = set()
        self._stop = asyncio.Event()
        self._failure: BaseException | None = None
        self._last_input = time.monotonic()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def touch(self) -> None:
        """Note that input arrived (the flush on exit waits for a quiet spell)."""
        self._last_input = time.monotonic()

    async def run(
        self,
        *,
        parent_gone: Callable[[], None] = lambda: None,
        flushed: Callable[[], bool] = lambda: True,
    ) -> None:
        """Wait until the parent closes the pipe or a task fails. After the parent is gone,
        call ``parent_gone`` and keep running until the inputs are quiet and ``flushed()``
        (bounded); then cancel the tasks. Re-raises the failure of a task that failed."""
        self._parent.watch(self._stop.set)
        self.spawn(self._heartbeat())
        try:
            await self._stop.wait()
            if self._failure is None:
                parent_gone()
                await self._flush(flushed)
        finally:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._failure is not None:
            raise self._failure

    async def _heartbeat(self) -> None:
        while True:
            self._parent.beat()
            await asyncio.sleep(CHILD_HEARTBEAT_S)

    async def _flush(self, flushed: Callable[[], bool]) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FLUSH_LIMIT_S):
                while time.monotonic() - self._last_input < QUIET_S or not flushed():
                    if self._failure is not None:
                        return
                    await asyncio.sleep(QUIET_S / 4)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._failure = task.exception()
            self._stop.set()


def run_child(main: Callable[[zmq.asyncio.Context], Coroutine[Any, Any, None]]) -> None:
    """Run ``main(ctx)`` on uvloop; any escaping error exits non-zero. Every socket of
    ``ctx`` is closed when ``main`` ends, however it ends: an open socket would make the
    context's termination at exit wait forever."""

    async def body() -> None:
        ctx = zmq.asyncio.Context()
        try:
            await main(ctx)
        finally:
            ctx.destroy(linger=EXIT_LINGER_MS)

    try:
        uvloop.run(body())
    except Exception:
        logging.getLogger("outrider").exception("child failed")
        sys.exit(1)
