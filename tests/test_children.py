"""daemon/processes/children.py with stand-in children: a front door that cannot bind the
client socket, and a child that exits; and the real children's entry modules without torch."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from multiprocessing.connection import Connection

import pytest

from outrider.daemon.internal import ChildStatus, child_status_codec
from outrider.daemon.processes.children import ChildDied, Children, ClientBindFailed


def _wait_for_parent(_cfg: object, conn: Connection) -> None:
    with contextlib.suppress(EOFError):
        conn.recv_bytes()


def _front_door_that_cannot_bind(error: str, conn: Connection) -> None:
    codec = child_status_codec()
    for status in (
        ChildStatus("frontdoor", os.getpid(), "started", False),
        ChildStatus("frontdoor", os.getpid(), "bind_failed", False, error=error),
    ):
        conn.send_bytes(codec.encode(status))
    _wait_for_parent(None, conn)


def _exit_with(code: int, _conn: Connection) -> None:
    sys.exit(code)


def test_a_failed_client_bind_is_reported_not_a_death() -> None:
    children = Children(
        {
            "detokenizer": (_wait_for_parent, None),
            "frontdoor": (_front_door_that_cannot_bind, "Address already in use"),
        }
    )
    try:
        with pytest.raises(ClientBindFailed, match=r"^Address already in use$"):
            children.wait_status("frontdoor", "serving", timeout=60.0)
        children.check()  # both still run
    finally:
        children.stop()
    assert [proc.exitcode for proc in children.procs.values()] == [0, 0]


def test_an_exited_child_is_noticed_by_the_per_iteration_check() -> None:
    children = Children({"detokenizer": (_exit_with, 3), "frontdoor": (_wait_for_parent, None)})
    try:
        deadline = time.monotonic() + 60.0
        with pytest.raises(ChildDied, match=r"^the detokenizer process exited with code 3$"):
            while time.monotonic() < deadline:
                children.raise_if_exited()
                time.sleep(0.01)
        assert len(children.sentinels) == 2
    finally:
        children.stop()


def test_the_childrens_entry_modules_load_without_torch() -> None:
    """A spawned child imports its entry module before anything of its own runs: the front
    door's, the detokenizer's and the HTTP front's never load torch (over a second of every
    daemon's start on a small host)."""
    entries = ", ".join(
        f"outrider.daemon.{name}" for name in ("frontdoor.process", "detokenizer", "http.process")
    )
    torch = "sorted(m for m in sys.modules if m.split('.')[0] == 'torch')"
    code = f"import sys, {entries}; print({torch})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
