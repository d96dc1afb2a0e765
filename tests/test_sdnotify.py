from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from outrider.daemon.processes.sdnotify import Notifier, strip_notify_env


def _datagram_socket(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(2.0)
    return sock


@pytest.fixture
def path_socket(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    path = str(tmp_path / "notify")
    sock = _datagram_socket(path)
    yield path, sock
    sock.close()


def test_sends_each_message_as_one_exact_datagram(path_socket: tuple[str, socket.socket]) -> None:
    path, sock = path_socket
    notifier = Notifier({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    assert notifier.status("loading shard 1/4")
    assert notifier.extend_timeout(30_000_000)
    assert notifier.ready("serving")
    assert notifier.watchdog()
    assert notifier.watchdog_trigger()
    assert notifier.stopping()
    received = [sock.recv(4096) for _ in range(6)]
    notifier.close()
    assert received == [
        b"STATUS=loading shard 1/4",
        b"EXTEND_TIMEOUT_USEC=30000000",
        b"READY=1\nSTATUS=serving",
        b"WATCHDOG=1",
        b"WATCHDOG=trigger",
        b"STOPPING=1",
    ]


def test_abstract_socket() -> None:
    name = f"outrider-test-{os.getpid()}-{uuid.uuid4().hex}"
    sock = _datagram_socket("\0" + name)
    try:
        notifier = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert notifier.ready()
        assert sock.recv(4096) == b"READY=1"
        notifier.close()
    finally:
        sock.close()


def test_status_cannot_inject_assignments(path_socket: tuple[str, socket.socket]) -> None:
    path, sock = path_socket
    Notifier({"NOTIFY_SOCKET": path}).status("line one\nREADY=1")
    assert sock.recv(4096) == b"STATUS=line one READY=1"


def test_unset_socket_is_a_no_op() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    assert not notifier.ready()
    assert not notifier.watchdog()
    assert notifier.watchdog_interval() is None


def test_send_failure_is_logged_once_and_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    with caplog.at_level(logging.WARNING, logger="outrider.daemon.processes.sdnotify"):
        assert not notifier.ready()
        assert not notifier.watchdog()
    assert len(caplog.records) == 1
    assert "sd_notify" in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WATCHDOG_USEC": "20000000"}, 10.0),
        ({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": str(os.getpid())}, 10.0),
        ({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    assert Notifier(env).watchdog_interval() == expected


def test_strip_notify_env() -> None:
    env = {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2", "PATH": "/bin"}
    strip_notify_env(env)
    assert env == {"PATH": "/bin"}
