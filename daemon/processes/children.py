"""The daemon's children (front door, detokenizer, and the HTTP front with ``--http``):
spawned, watched, stopped in order.

Each child gets one end of a duplex pipe: it reports ``ChildStatus`` there and sees EOF when
the daemon closes its end (or dies), which is how it is stopped and never orphaned. Every
status counts as a heartbeat; a child silent for ``HEARTBEAT_STALE_S`` is hung.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import select
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Literal

from outrider.daemon.detokenizer import DetokenizerConfig, run_detokenizer
from outrider.daemon.frontdoor.config import FrontDoorConfig
from outrider.daemon.frontdoor.process import run_frontdoor
from outrider.daemon.http.config import HttpFrontConfig
from outrider.daemon.internal import ChildState, ChildStatus, child_status_codec

log = logging.getLogger("outrider.daemon")

HEARTBEAT_STALE_S = 5.0

ChildName = Literal["frontdoor", "detokenizer", "http"]
# Stop order: each passes on what the one before it flushed (final frames reach HTTP clients).
STOP_ORDER: tuple[ChildName, ...] = ("detokenizer", "frontdoor", "http")
# A child's entry point: ``target(config, pipe_end)``, run in a spawned process.
ChildTarget = Callable[[Any, Connection], None]


class ChildDied(RuntimeError):
    pass


class ClientBindFailed(RuntimeError):
    """A child could not bind its client (or HTTP) socket; the message is its error text."""


class Children:
    """The daemon's children: spawned, watched, stopped in order."""

    def __init__(self, targets: Mapping[ChildName, tuple[ChildTarget, object]]) -> None:
        """Spawn ``target(config, pipe_end)`` per child, in the mapping's order."""
        ctx = multiprocessing.get_context("spawn")
        self._status_codec = child_status_codec()
        self._pipes: dict[str, Connection] = {}
        self.procs: dict[str, BaseProcess] = {}
        self._heard_at: dict[str, float] = {}
        self._exits = select.poll()
        self._name_of_sentinel: dict[int, str] = {}
        for name, (target, cfg) in targets.items():
            # Duplex: the child reports ChildStatus on it and sees EOF when the parent goes.
            child_end, parent_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=target, args=(cfg, child_end), name=f"outrider-{name}")
            proc.start()
            child_end.close()
            self._pipes[name] = parent_end
            self.procs[name] = proc
            self._heard_at[name] = time.monotonic()
            self._exits.register(proc.sentinel, select.POLLIN)
            self._name_of_sentinel[proc.sentinel] = name

    @classmethod
    def spawn(
        cls, front: FrontDoorConfig, detok: DetokenizerConfig, http: HttpFrontConfig | None = None
    ) -> Children:
        targets: dict[ChildName, tuple[ChildTarget, object]] = {
            "detokenizer": (run_detokenizer, detok),
            "frontdoor": (run_frontdoor, front),
        }
        if http is not None:
            # Imported only with --http: Starlette and uvicorn are needed there alone.
            from outrider.daemon.http.process import run_http_front

            targets["http"] = (run_http_front, http)
        return cls(targets)

    @property
    def sentinels(self) -> list[int]:
        """File descriptors that become readable when a child exits."""
        return list(self._name_of_sentinel)

    def raise_if_exited(self) -> None:
        """Raise ChildDied if a child exited: one poll(2), cheap enough for every iteration
        of the engine loop."""
        for fd, _event in self._exits.poll(0):
            name = self._name_of_sentinel[fd]
            proc = self.procs[name]
            proc.join(1)
            raise ChildDied(f"the {name} process exited with code {proc.exitcode}")

    def check(self) -> None:
        """Raise ChildDied if a child exited; take in the statuses (heartbeats) waiting."""
        self.raise_if_exited()
        for name, conn in self._pipes.items():
            # EOF means the child is exiting: its sentinel tells at the next check.
            with contextlib.suppress(EOFError):
                while conn.poll():
                    self._take(name, conn.recv_bytes())

    def hung(self) -> list[str]:
        """The children not heard from for ``HEARTBEAT_STALE_S`` (as of the last check)."""
        now = time.monotonic()
        return [name for name, at in self._heard_at.items() if now - at > HEARTBEAT_STALE_S]

    def _take(self, name: str, data: bytes) -> ChildStatus:
        status = self._status_codec.decode(data)
        self._heard_at[name] = time.monotonic()
        if status.torch_imported and status.state != "alive":
            log.error("the %s process imported torch; it must not", name)
        return status

    def wait_status(self, name: str, state: ChildState, timeout: float) -> ChildStatus:
        """Block until child ``name`` reports ``state``. Raises ChildDied if it exits first,
        ClientBindFailed if it reports ``bind_failed`` instead."""
        conn, proc = self._pipes[name], self.procs[name]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready = wait([conn, proc.sentinel], timeout=deadline - time.monotonic())
            if conn in ready:
                try:
                    status = self._take(name, conn.recv_bytes())
                except EOFError:
                    ready = [proc.sentinel]
                else:
                    if status.state == state:
                        return status
                    if status.state == "bind_failed":
                        raise ClientBindFailed(status.error or "unknown error")
                    continue
            if proc.sentinel in ready:
                proc.join(1)
                raise ChildDied(f"the {name} process exited with code {proc.exitcode}")
        raise ChildDied(f"the {name} process did not report {state!r} within {timeout:.0f} s")

    def stop(self, timeout: float = 10.0) -> None:
        """Close each child's pipe (it drains and exits), in ``STOP_ORDER``."""
        for name in (name for name in STOP_ORDER if name in self._pipes):
            self._pipes[name].close()
            proc = self.procs[name]
            proc.join(timeout)
            if proc.is_alive():
                log.warning("the %s process did not exit; killing it", name)
                proc.kill()
                proc.join()
