from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from outrider.daemon.processes.runtime import (
    EndpointError,
    RuntimeDir,
    check_can_listen,
    lock_client_endpoint,
    tcp_bind_problem,
)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_private_dir_is_fresh_0700_under_the_runtime_base(tmp_path: Path) -> None:
    first = RuntimeDir({"XDG_RUNTIME_DIR": str(tmp_path)})
    second = RuntimeDir({"XDG_RUNTIME_DIR": str(tmp_path)})
    assert first.path.parent == tmp_path
    assert first.path != second.path
    assert _mode(first.path) == 0o700
    endpoints = first.internal_endpoints()
    names = [endpoints.to_daemon, endpoints.to_detokenizer, endpoints.to_front_door]
    names.append(endpoints.control)
    assert len(set(names)) == 4
    assert all(name.startswith(f"ipc://{first.path}/") for name in names)
    first.cleanup()
    second.cleanup()
    assert not first.path.exists()


def test_runtime_directory_wins_over_xdg(tmp_path: Path) -> None:
    systemd_dir, xdg = tmp_path / "run", tmp_path / "xdg"
    systemd_dir.mkdir()
    xdg.mkdir()
    env = {"RUNTIME_DIRECTORY": f"{systemd_dir}:/elsewhere", "XDG_RUNTIME_DIR": str(xdg)}
    runtime = RuntimeDir(env)
    assert runtime.path.parent == systemd_dir
    runtime.cleanup()


def test_temp_dir_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    runtime = RuntimeDir({})
    assert runtime.path.parent == tmp_path
    runtime.cleanup()


def test_lock_creates_private_parent_and_records_pid(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/sub/outrider.sock"
    lock = lock_client_endpoint(endpoint)
    assert lock is not None
    assert _mode(tmp_path / "sub") == 0o700
    assert lock.lock_path.read_text() == f"{os.getpid()}\n"
    lock.release()
    assert lock.lock_path.exists()  # never removed: see EndpointLock
    again = lock_client_endpoint(endpoint)
    assert again is not None
    again.release()


def test_second_daemon_is_refused_with_the_holder_pid(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/outrider.sock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\n"
            "from outrider.daemon.processes.runtime import lock_client_endpoint\n"
            "lock = lock_client_endpoint(sys.argv[1])\n"
            "print('locked', flush=True)\n"
            "sys.stdin.read()\n",
            endpoint,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(EndpointError) as refused:
            lock_client_endpoint(endpoint)
        assert str(refused.value) == f"another daemon (pid {holder.pid}) serves {endpoint}"
    finally:
        holder.communicate("")
    lock = lock_client_endpoint(endpoint)  # the holder exited: its lock went with it
    assert lock is not None
    lock.release()


def test_lock_in_the_same_process_is_refused_too(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/outrider.sock"
    lock = lock_client_endpoint(endpoint)
    assert lock is not None
    with pytest.raises(EndpointError, match=f"pid {os.getpid()}"):
        lock_client_endpoint(endpoint)
    lock.release()


def test_stale_socket_is_removed_under_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "outrider.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()
    assert stat.S_ISSOCK(path.lstat().st_mode)
    lock = lock_client_endpoint(f"ipc://{path}")
    assert lock is not None
    assert not path.exists()
    lock.release()


def test_release_removes_the_socket_file_but_keeps_the_lock_file(tmp_path: Path) -> None:
    path = tmp_path / "outrider.sock"
    lock = lock_client_endpoint(f"ipc://{path}")
    assert lock is not None
    served = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    served.bind(str(path))  # what the front door leaves behind
    served.close()
    lock.release()
    assert not path.exists()
    assert lock.lock_path.exists()
    lock.release()  # twice is harmless


def test_release_keeps_what_is_not_a_socket(tmp_path: Path) -> None:
    path = tmp_path / "outrider.sock"
    lock = lock_client_endpoint(f"ipc://{path}")
    assert lock is not None
    path.write_text("not a socket")
    lock.release()
    assert path.read_text() == "not a socket"


def test_a_regular_file_in_the_way_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "outrider.sock"
    path.write_text("not a socket")
    with pytest.raises(EndpointError, match="not a socket"):
        lock_client_endpoint(f"ipc://{path}")
    assert path.read_text() == "not a socket"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory away")
def test_parent_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    squatted = tmp_path / "squatted"
    squatted.mkdir()
    os.chown(squatted, 54321, 54321)
    with pytest.raises(EndpointError, match="uid 54321"):
        lock_client_endpoint(f"ipc://{squatted}/outrider.sock")


def test_overlong_socket_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(EndpointError, match="longer than"):
        RuntimeDir({"XDG_RUNTIME_DIR": str(tmp_path)}).endpoint("x" * 120)


def test_only_socket_files_are_locked() -> None:
    assert lock_client_endpoint("tcp://127.0.0.1:5557") is None
    assert lock_client_endpoint("ipc://@outrider-abstract") is None


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://127.0.0.1:5557", "tcp://127.0.0.53:1", "tcp://[::1]:5557", "tcp://localhost:5557"],
)
def test_loopback_tcp_is_allowed(endpoint: str) -> None:
    assert tcp_bind_problem(endpoint, curve_keys=False, insecure_tcp=False) is None


@pytest.mark.parametrize(
    "endpoint", ["tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://[::]:5557", "tcp://eth0:5557"]
)
def test_tcp_beyond_loopback_needs_curve_or_insecure_tcp(endpoint: str) -> None:
    problem = tcp_bind_problem(endpoint, curve_keys=False, insecure_tcp=False)
    assert problem is not None
    assert endpoint in problem
    assert "--insecure-tcp" in problem
    assert tcp_bind_problem(endpoint, curve_keys=True, insecure_tcp=False) is None
    assert tcp_bind_problem(endpoint, curve_keys=False, insecure_tcp=True) is None


def test_ipc_is_not_judged_as_tcp() -> None:
    assert tcp_bind_problem("ipc:///tmp/x.sock", curve_keys=False, insecure_tcp=False) is None


@pytest.fixture
def listening_tcp_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "*", "lo"])
def test_a_taken_tcp_port_is_refused(listening_tcp_port: int, host: str) -> None:
    endpoint = f"tcp://{host}:{listening_tcp_port}"
    with pytest.raises(EndpointError) as refused:
        check_can_listen(endpoint)
    assert str(refused.value) == (
        f"cannot listen on {endpoint}: address already in use (another process holds it)"
    )


def test_a_free_tcp_port_passes_and_stays_free() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for _ in range(2):  # the probe released what it bound
        check_can_listen(f"tcp://127.0.0.1:{port}")
    check_can_listen("tcp://127.0.0.1:*")
    check_can_listen("tcp://localhost:0")


def test_a_taken_abstract_name_is_refused() -> None:
    name = f"outrider-test-{os.getpid()}"
    check_can_listen(f"ipc://@{name}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as holder:
        holder.bind(b"\0" + name.encode())
        with pytest.raises(EndpointError) as refused:
            check_can_listen(f"ipc://@{name}")
    assert str(refused.value) == (
        f"cannot listen on ipc://@{name}: address already in use (another process holds it)"
    )
    check_can_listen(f"ipc://@{name}")


@pytest.mark.parametrize(
    ("endpoint", "reason"),
    [
        ("tcp://[::1]:5557", "no interface, IPv4 address or host named '::1'"),
        ("tcp://no-such-host.invalid:5557", "no interface, IPv4 address or host named"),
        ("tcp://127.0.0.1:65536", "the port must be 1 to 65535 or *"),
        ("tcp://127.0.0.1:http", "the port must be 1 to 65535 or *"),
        ("tcp://203.0.113.254:5557", "cannot assign requested address (not an address of this"),
    ],
)
def test_unusable_tcp_endpoints_are_refused(endpoint: str, reason: str) -> None:
    with pytest.raises(EndpointError) as refused:
        check_can_listen(endpoint)
    assert str(refused.value).startswith(f"cannot listen on {endpoint}: {reason}")


def test_socket_paths_are_left_to_the_lock(tmp_path: Path) -> None:
    check_can_listen(f"ipc://{tmp_path}/outrider.sock")
    check_can_listen("ipc://*")
