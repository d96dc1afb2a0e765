"""The daemon's two children (front door, detokenizer): spawned, watched, stopped in order.

Each child gets one end of a duplex pipe: it reports ``ChildStatus`` there and sees EOF when
the daemon closes its end (or dies), which is how it is stopped and never orphaned. Every
status counts as a heartbeat; a child silent for ``HEARTBEAT_STALE_S`` is hung.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from outrider.daemon.detokenizer import DetokenizerConfig, run_detokenizer
from outrider.daemon.frontdoor import FrontDoorConfig, run_frontdoor
from outrider.daemon.internal import ChildStatus, child_status_codec

log = logging.getLogger("outrider.daemon")

HEARTBEAT_STALE_S = 5.0


class ChildDied(RuntimeError):
    pass


class Children:
    """The front door and the detokenizer: spawned, watched, stopped in order."""

    def __init__(self, front: FrontDoorConfig, detok: DetokenizerConfig) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._status_codec = child_status_codec()
        self._pipes: dict[str, Connection] = {}
        self.procs: dict[str, BaseProcess] = {}
        self._heard_at: dict[str, float] = {}
        for name, target, cfg in (
            ("detokenizer", run_detokenizer, detok),
            ("frontdoor", run_frontdoor, front),
        ):
            # Duplex: the child reports ChildStatus on it and sees EOF when the parent goes.
            child_end, parent_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=target, args=(cfg, child_end), name=f"outrider-{name}")
            proc.start()
            child_end.close()
            self._pipes[name] = parent_end
            self.procs[name] = proc
            self._heard_at[name] = time.monotonic()

    def check(self) -> None:
        """Raise ChildDied if a child exited; take in the statuses (heartbeats) waiting."""
        dead = wait([p.sentinel for p in self.procs.values()], timeout=0)
        for name, proc in self.procs.items():
            if proc.sentinel in dead:
                raise ChildDied(f"the {name} process exited with code {proc.exitcode}")
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

    def wait_status(self, name: str, state: str, timeout: float) -> ChildStatus:
        """Block until child ``name`` reports ``state`` (raises ChildDied if it exits)."""
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
                    continue
            if proc.sentinel in ready:
                proc.join(1)
                raise ChildDied(f"the {name} process exited with code {proc.exitcode}")
        raise ChildDied(f"the {name} process did not report {state!r} within {timeout:.0f} s")

    def stop(self, timeout: float = 10.0) -> None:
        """Close each child's pipe (it drains and exits), detokenizer first."""
        for name in ("detokenizer", "frontdoor"):
            self._pipes[name].close()
            proc = self.procs[name]
            proc.join(timeout)
            if proc.is_alive():
                log.warning("the %s process did not exit; killing it", name)
                proc.kill()
                proc.join()
