"""What the daemon's two children (front door, detokenizer) share as processes.

Each child is started with the spawn method and handed one end of a ``multiprocessing.Pipe``
(``parent_conn``). The contract with the daemon:

- the child ignores SIGINT and SIGTERM: the daemon stops it after draining;
- it reports ``ChildStatus`` messages (internal.py) with ``send_bytes``; the parent never
  writes to the pipe, so the pipe becoming readable means the parent closed it or died, and
  the child then exits at once (so no child outlives the daemon);
- an internal error ends the child with a non-zero exit code; the daemon, which watches the
  child's sentinel, then exits non-zero as well rather than serve half-alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from multiprocessing.connection import Connection
from typing import Any, Literal

import uvloop
import zmq
import zmq.asyncio

from outrider.daemon.internal import ChildStatus, child_status_codec
from outrider.daemon.tokenizer import child_environment_setup

ChildName = Literal["frontdoor", "detokenizer"]


def child_setup(name: ChildName, log_level: str) -> None:
    """First thing in a child's entry point, before anything imports transformers."""
    child_environment_setup()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level.upper(),
        format=f"%(asctime)s {name}[%(process)d] %(levelname)s %(name)s: %(message)s",
        force=True,
    )


class ParentPipe:
    """The child's end of its spawn pipe."""

    def __init__(self, conn: Connection, child: ChildName) -> None:
        self._conn = conn
        self._child = child
        self._codec = child_status_codec()

    def report(self, state: Literal["started", "serving"], endpoint: str = "") -> None:
        status = ChildStatus(self._child, os.getpid(), state, "torch" in sys.modules, endpoint)
        # OSError: the parent is gone, and the pipe watcher ends this child.
        with contextlib.suppress(OSError):
            self._conn.send_bytes(self._codec.encode(status))

    def watch(self, on_close: Callable[[], None]) -> None:
        """Call ``on_close`` once the pipe is readable, i.e. the parent closed it or died."""
        loop = asyncio.get_running_loop()
        fd = self._conn.fileno()

        def closed() -> None:
            loop.remove_reader(fd)
            on_close()

        loop.add_reader(fd, closed)


def internal_socket(
    ctx: zmq.asyncio.Context, kind: int, *, bind: str = "", connect: str = ""
) -> zmq.asyncio.Socket:
    """A socket of an internal pipe (one writer, one reader; the reader binds)."""
    sock = ctx.socket(kind)
    # Unbounded: both ends are ours and the front door's in-flight limits bound what can be
    # queued, so a send never waits or fails, and sends leave in call order.
    sock.sndhwm = sock.rcvhwm = 0
    sock.linger = 0
    if bind:
        sock.bind(bind)
    if connect:
        sock.connect(connect)
    return sock


class ChildTasks:
    """A child's tasks: the first one to fail, or the parent closing the pipe, ends them all."""

    def __init__(self, parent: ParentPipe) -> None:
        self._parent = parent
        self._tasks: set[asyncio.Task[None]] = set()
        self._stop = asyncio.Event()
        self._failure: BaseException | None = None

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    async def run(self, ctx: zmq.asyncio.Context) -> None:
        """Wait until stopped, then cancel the tasks and close every socket of ``ctx``;
        re-raises the failure of a task that failed."""
        self._parent.watch(self._stop.set)
        try:
            await self._stop.wait()
        finally:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            ctx.destroy(linger=0)
        if self._failure is not None:
            raise self._failure

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._failure = task.exception()
            self._stop.set()


def run_child(main: Coroutine[Any, Any, None]) -> None:
    """Run a child's main coroutine on uvloop; any escaping error exits non-zero."""
    try:
        uvloop.run(main)
    except Exception:
        logging.getLogger("outrider").exception("child failed")
        sys.exit(1)
