"""Where the daemon's sockets live, and who may own the client socket.

- ``RuntimeDir``: a fresh private directory (mode 0700) per daemon instance holding the
  internal ``ipc://`` pipes, made under ``$RUNTIME_DIRECTORY`` (systemd), else
  ``$XDG_RUNTIME_DIR``, else the temp dir. A subdirectory even under systemd: the unit's
  runtime directory also holds the client socket, which operators may open to a group, while
  the internal pipes carry already-validated requests and must stay private to the daemon.
- ``lock_client_endpoint``: an ``ipc://`` client socket is guarded by ``<socket>.lock`` so a
  second daemon refuses to start instead of silently stealing the socket; the socket file is
  removed under that lock, at start (a stale one) and at exit. The lock file holds the
  daemon's pid while it is held: a client that finds it and no socket file says the daemon is
  loading (protocol/endpoints.py).
- ``tcp_bind_problem``: a TCP bind beyond loopback needs CURVE keys or ``--insecure-tcp``.
- ``check_can_listen``: a ``tcp://`` or abstract ``ipc://@name`` endpoint that another process
  holds is refused before anything is loaded.
- ``check_client_endpoint``: what the two above would refuse, found without taking the lock
  or touching the socket file, so that a check may run beside a live daemon.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import os
import shutil
import socket
import stat
import struct
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from outrider.protocol.endpoints import ipc_path, lock_file_path

# sun_path is 108 bytes on Linux, NUL included; libzmq's error for a longer path is obscure.
_MAX_SOCKET_PATH = 107


class EndpointError(RuntimeError):
    """The client endpoint cannot be used; the message says why and what to change."""


@dataclass(frozen=True)
class InternalEndpoints:
    """The internal pipes; each has one writer and one reader, and the reader binds."""

    to_daemon: str  # front door -> daemon (ToDaemon)
    to_detokenizer: str  # daemon -> detokenizer (Outputs)
    to_front_door: str  # detokenizer -> front door (Outputs)
    control: str  # daemon -> front door (Control)


class RuntimeDir:
    """A private directory for one daemon instance; ``cleanup()`` removes it."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.path = Path(tempfile.mkdtemp(prefix="outrider-", dir=_runtime_base(env)))

    def endpoint(self, name: str) -> str:
        return ipc_endpoint(self.path / f"{name}.sock")

    def internal_endpoints(self) -> InternalEndpoints:
        return InternalEndpoints(
            to_daemon=self.endpoint("to-daemon"),
            to_detokenizer=self.endpoint("to-detokenizer"),
            to_front_door=self.endpoint("to-front-door"),
            control=self.endpoint("control"),
        )

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def ipc_endpoint(path: Path) -> str:
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise EndpointError(f"socket path {path} is longer than {_MAX_SOCKET_PATH} bytes")
    return f"ipc://{path}"


class EndpointLock:
    """Holds ``<socket path>.lock`` (an ``flock``) for the daemon's lifetime.

    NOTE: the lock file is never removed: unlinking it would let one daemon lock the old inode
    and another a new file, both believing they own the socket.
    """

    def __init__(self, endpoint: str, socket_path: Path, lock_path: Path, fd: int) -> None:
        self.endpoint = endpoint
        self.socket_path = socket_path
        self.lock_path = lock_path
        self._fd: int | None = fd

    def release(self) -> None:
        """Remove the socket file (once nothing serves on it) and release the lock."""
        if self._fd is None:
            return
        try:
            # NOTE: only while the lock is held: after it, the path may be another daemon's.
            _remove_socket_file(self.socket_path)
        finally:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None


def lock_client_endpoint(endpoint: str) -> EndpointLock | None:
    """For ``ipc://PATH``: lock ``PATH.lock``, write our pid there, and remove a stale socket
    file at ``PATH`` (safe only while holding the lock). None for other transports and for
    abstract sockets, whose bind is exclusive anyway.

    Raises ``EndpointError`` when another daemon holds the lock or the path is unusable.
    """
    path = ipc_path(endpoint)
    if path is None:
        return None
    socket_path = Path(path)
    _ensure_private_parent(socket_path.parent)
    lock_path = Path(lock_file_path(path))
    # O_CLOEXEC: a child that inherited the fd would keep the lock after the daemon died.
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        refusal = _held_by_another(fd, endpoint)
        os.close(fd)
        raise refusal from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _remove_stale_socket(socket_path)
    except BaseException:
        os.close(fd)
        raise
    return EndpointLock(endpoint, socket_path, lock_path, fd)


def check_client_endpoint(endpoint: str) -> None:
    """Raise ``EndpointError`` when ``endpoint`` would be refused as the client endpoint: an
    ``ipc://`` path whose lock another daemon holds, whose directory belongs to another user,
    or that is not a socket (``lock_client_endpoint``); a ``tcp://`` or abstract endpoint that
    another process holds (``check_can_listen``). Creates and removes nothing: a stale socket
    file passes (the daemon removes it under the lock)."""
    path = ipc_path(endpoint)
    if path is None:
        check_can_listen(endpoint)
        return
    socket_path = Path(path)
    _check_unlocked(endpoint, socket_path.with_name(socket_path.name + ".lock"))
    if socket_path.parent.is_dir():
        _check_owner(socket_path.parent)
    with contextlib.suppress(FileNotFoundError):
        _check_is_socket(socket_path, socket_path.lstat())


def _check_unlocked(endpoint: str, lock_path: Path) -> None:
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise EndpointError(f"cannot open {lock_path}: {exc.strerror}") from None
    try:
        # NOTE: a shared lock, held for an instant and never written: a daemon starting in
        # that instant refuses as if another served, which a restart cures.
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _held_by_another(fd, endpoint) from None
    finally:
        os.close(fd)


def _held_by_another(lock_fd: int, endpoint: str) -> EndpointError:
    holder = os.pread(lock_fd, 32, 0).decode(errors="replace").strip() or "unknown"
    return EndpointError(f"another daemon (pid {holder}) serves {endpoint}")


def tcp_bind_problem(endpoint: str, *, curve_keys: bool, insecure_tcp: bool) -> str | None:
    """Why ``endpoint`` must not be bound, or None. Only ``tcp://`` endpoints are judged."""
    if not endpoint.startswith("tcp://"):
        return None
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    if is_loopback(host) or curve_keys or insecure_tcp:
        return None
    return (
        f"refusing to bind {endpoint} beyond loopback without CURVE keys: set "
        "--curve-secret-key-file, bind 127.0.0.1, or pass --insecure-tcp"
    )


def is_loopback(host: str) -> bool:
    """``host`` (a name, or an address with an optional ``%zone``) is this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.partition("%")[0]).is_loopback
    except ValueError:
        return False  # "*", an interface name or a host name


def _runtime_base(env: Mapping[str, str]) -> str:
    for candidate in (env.get("RUNTIME_DIRECTORY", ""), env.get("XDG_RUNTIME_DIR", "")):
        path = _first_path(candidate)
        if path and os.path.isdir(path):
            return path
    return tempfile.gettempdir()


def _first_path(value: str) -> str:
    # systemd joins several RuntimeDirectory= entries with ':'.
    return value.split(":", 1)[0]


def _ensure_private_parent(directory: Path) -> None:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_owner(directory)


def _check_owner(directory: Path) -> None:
    st = directory.stat()
    # NOTE: under a shared /tmp another user could create our directory first and later swap
    # the socket; refuse a parent that neither we nor root own.
    if st.st_uid not in (os.geteuid(), 0):
        raise EndpointError(f"{directory} belongs to uid {st.st_uid}, not to us")


def _remove_stale_socket(socket_path: Path) -> None:
    try:
        st = socket_path.lstat()
    except FileNotFoundError:
        return
    _check_is_socket(socket_path, st)
    socket_path.unlink(missing_ok=True)


def _check_is_socket(socket_path: Path, st: os.stat_result) -> None:
    if not stat.S_ISSOCK(st.st_mode):
        raise EndpointError(f"{socket_path} exists and is not a socket; not removing it")


def _remove_socket_file(socket_path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(socket_path.lstat().st_mode):
            socket_path.unlink()


def check_can_listen(endpoint: str) -> None:
    """Raise ``EndpointError`` unless ``endpoint`` can be bound now. Judged: ``tcp://HOST:PORT``
    (resolved as libzmq resolves a bind: ``*``, an interface name, then an IPv4 address or host
    name; the client socket is IPv4 only) and abstract ``ipc://@name``; an ``ipc://`` path is
    decided by its lock (``lock_client_endpoint``).

    The probe binds a plain socket (SO_REUSEADDR, as libzmq's listener) and closes it at once;
    it never listens, so no client can connect to it.
    """
    address: tuple[str, int] | bytes
    if endpoint.startswith("tcp://"):
        family, address = socket.AF_INET, _tcp_bind_address(endpoint)
    elif endpoint.startswith("ipc://@"):
        name = endpoint.removeprefix("ipc://@")
        family, address = socket.AF_UNIX, b"\0" + os.fsencode(name)
    else:
        return
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        if family == socket.AF_INET:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise EndpointError(f"cannot listen on {endpoint}: {_bind_error(exc)}") from None


def _tcp_bind_address(endpoint: str) -> tuple[str, int]:
    host, sep, port_text = endpoint.removeprefix("tcp://").rpartition(":")
    if not sep or not host:
        raise EndpointError(f"cannot listen on {endpoint}: expected tcp://HOST:PORT")
    if port_text in ("*", "0"):
        port = 0
    elif port_text.isdigit() and 0 < int(port_text) < 65536:
        port = int(port_text)
    else:
        raise EndpointError(f"cannot listen on {endpoint}: the port must be 1 to 65535 or *")
    host = host.removeprefix("[").removesuffix("]")
    if host == "*":
        return "0.0.0.0", port
    address = _interface_ipv4(host) or _resolve_ipv4(host)
    if address is None:
        raise EndpointError(
            f"cannot listen on {endpoint}: no interface, IPv4 address or host named {host!r} "
            "(the client socket listens on IPv4 only)"
        )
    return address, port


# <linux/sockios.h>: an interface's (first) IPv4 address, as libzmq's bind takes it.
_SIOCGIFADDR = 0x8915
_IFNAMSIZ = 16


def _interface_ipv4(name: str) -> str | None:
    try:
        socket.if_nametoindex(name)
    except OSError:
        return None
    request = struct.pack("256s", os.fsencode(name)[: _IFNAMSIZ - 1])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
        except OSError:
            return None  # the interface has no IPv4 address
    # struct ifreq: the name, then a sockaddr_in (family, port, address).
    return socket.inet_ntoa(reply[_IFNAMSIZ + 4 : _IFNAMSIZ + 8])


def _resolve_ipv4(host: str) -> str | None:
    try:
        found = socket.getaddrinfo(
            host, None, socket.AF_INET, socket.SOCK_STREAM, 0, socket.AI_PASSIVE
        )
    except (socket.gaierror, UnicodeError):
        return None
    return str(found[0][4][0]) if found else None


_BIND_HINTS = {
    errno.EADDRINUSE: "another process holds it",
    errno.EADDRNOTAVAIL: "not an address of this host",
    errno.EACCES: "a port below 1024 needs CAP_NET_BIND_SERVICE",
}


def _bind_error(exc: OSError) -> str:
    text = (exc.strerror or str(exc)).lower()
    hint = _BIND_HINTS.get(exc.errno or 0)
    return f"{text} ({hint})" if hint else text
