"""Where the daemon's client socket lives unless told otherwise.

The daemon binds and ``outrider generate`` (or any ``Client()`` without an endpoint) connects to
the same default, resolved from the environment of the calling process.
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


def not_listening_reason(endpoint: str) -> str:
    """Why a client that has no connection to ``endpoint`` has no answer."""
    path = ipc_path(endpoint)
    if path is None:
        return f"no daemon is listening at {endpoint}"
    if not os.path.exists(path):
        return f"no daemon is listening at {endpoint} (no socket file)"
    if not os.access(path, os.W_OK):
        return f"cannot connect to {endpoint} (no write permission on the socket file)"
    return f"no daemon is listening at {endpoint} (stale socket file: nothing accepts on it)"
