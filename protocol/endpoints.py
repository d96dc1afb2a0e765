"""Where the daemon's client socket lives unless told otherwise, and what a client that finds
no daemon there can tell about why.

The daemon binds and ``outrider generate`` (or any ``Client()`` without an endpoint) connects to
the same default, resolved from the environment of the calling process.

An ``ipc://PATH`` daemon holds ``PATH.lock`` with its pid in it from before it loads the model
until it exits (daemon/processes/runtime.py), and binds ``PATH`` only once it is loaded: a pid
there with no socket file is a daemon still loading.
"""

from __future__ import annotations

import os

SOCKET_NAME = "outrider.sock"
_IPC = "ipc://"


def default_endpoint() -> str:
    """The default client endpoint, first match wins:

    - ``ipc://$RUNTIME_DIRECTORY/outrider.sock`` (systemd's ``RuntimeDirectory=``);
    - ``ipc://$XDG_RUNTIME_DIR/outrider/outrider.sock``;
    - ``ipc:///tmp/outrider-$UID/outrider.sock``.
    """
    runtime_dir = os.environ.get("RUNTIME_DIRECTORY")
    if runtime_dir:
        # NOTE: systemd joins several RuntimeDirectory= entries with ':'; ours is the first.
        return _IPC + os.path.join(runtime_dir.split(":")[0], SOCKET_NAME)
    xdg_runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if xdg_runtime_dir:
        return _IPC + os.path.join(xdg_runtime_dir, "outrider", SOCKET_NAME)
    return _IPC + os.path.join("/tmp", f"outrider-{os.getuid()}", SOCKET_NAME)


def ipc_path(endpoint: str) -> str | None:
    """The filesystem path of an ``ipc://`` endpoint; None for other transports, abstract
    sockets (``ipc://@name``) and the bind wildcard (``ipc://*``)."""
    if not endpoint.startswith(_IPC):
        return None
    path = endpoint[len(_IPC) :]
    if not path or path == "*" or path.startswith("@"):
        return None
    return path


def lock_file_path(socket_path: str) -> str:
    """The lock file an ``ipc://`` daemon holds, with its pid in it, for its lifetime."""
    return socket_path + ".lock"


def loading_daemon_pid(socket_path: str) -> int | None:
    """The pid of a live daemon that holds ``socket_path``'s lock and has not bound it yet
    (it is loading); None otherwise, or when this process may not read the lock file."""
    if os.path.exists(socket_path):
        return None
    try:
        with open(lock_file_path(socket_path), "rb") as lock:
            pid = int(lock.read(32).strip() or b"0")
    except (OSError, ValueError):
        return None
    if pid <= 0:  # released: a daemon that exited empties it
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:  # one that was killed left its pid behind
        return None
    except PermissionError:  # alive, another user's
        pass
    return pid


def not_listening_reason(endpoint: str) -> str:
    """Why a client that has no connection to ``endpoint`` has no answer."""
    path = ipc_path(endpoint)
    if path is None:
        return f"no daemon is listening at {endpoint}"
    if not os.path.exists(path):
        pid = loading_daemon_pid(path)
        if pid is not None:
            return (
                f"the daemon at {endpoint} (pid {pid}) is loading the model; it listens once "
                "the model is loaded"
            )
        return f"no daemon is listening at {endpoint} (no socket file)"
    if not os.access(path, os.W_OK):
        return f"cannot connect to {endpoint} (no write permission on the socket file)"
    return f"no daemon is listening at {endpoint} (stale socket file: nothing accepts on it)"
