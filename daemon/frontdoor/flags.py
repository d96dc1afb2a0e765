"""The front door's serve flags (the client endpoint, its access control, frame size and
in-flight limits): their help and their checks. The fields stay in the one flag table
(daemon/config.py's ``ServeConfig``); daemon/flags.py gathers this help and runs these checks.
The daemon hands the resolved values to the front door as ``FrontDoorConfig`` (config.py here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from outrider.protocol.messages import DEFAULT_MAX_MESSAGE_BYTES

if TYPE_CHECKING:
    from outrider.daemon.config import ServeConfig

FRONT_DOOR_HELP: dict[str, str] = {
    "listen": (
        "client endpoint: ipc://PATH or tcp://HOST:PORT (TCP beyond loopback needs CURVE keys "
        "or --insecure-tcp)"
    ),
    "max_message_bytes": "largest client frame (ZMQ_MAXMSGSIZE); a larger one drops the client",
    "max_inflight_per_client": (
        "most requests one client connection may have in flight (more are refused: overloaded)"
    ),
    "max_inflight": "most requests in flight over all clients (more are refused: overloaded)",
    "insecure_tcp": "allow a tcp:// bind beyond loopback without CURVE keys",
    "curve_secret_key_file": (
        "the daemon's CURVE secret certificate (zmq.auth format), the service user's, mode 0600"
    ),
    "curve_client_keys": (
        "directory of the client public certificates (NAME.key) CURVE lets in; required with "
        "the secret key"
    ),
    "socket_mode": "file mode of an ipc:// client socket, octal: at most 0660 (owner and group)",
}

FRONT_DOOR_METAVARS: dict[str, str] = {
    "listen": "ENDPOINT",
    "curve_secret_key_file": "FILE",
    "curve_client_keys": "DIR",
    "socket_mode": "MODE",
}

FRONT_DOOR_SHOWN_DEFAULTS: dict[str, str] = {
    "listen": "the runtime socket",
    "socket_mode": "0600",
    "max_message_bytes": f"{DEFAULT_MAX_MESSAGE_BYTES} ({DEFAULT_MAX_MESSAGE_BYTES // 2**20} MiB)",
}


def parse_socket_mode(raw: str) -> int:
    """``--socket-mode``'s octal text (``0660``) -> the mode; raises ValueError."""
    try:
        return int(raw, 8)
    except ValueError:
        raise ValueError(f"expected an octal mode such as 0660, got {raw!r}") from None


def front_door_problems(config: ServeConfig) -> list[str]:
    """What keeps the front door's flags of ``config`` from serving, each naming its flag."""
    problems = []
    if config.curve_secret_key_file and not config.curve_client_keys:
        problems.append(
            "--curve-secret-key-file needs --curve-client-keys DIR (the client public "
            "certificates allowed in)"
        )
    if config.curve_client_keys and not config.curve_secret_key_file:
        problems.append("--curve-client-keys needs --curve-secret-key-file (CURVE is off)")
    if config.listen and not config.listen.startswith(("ipc://", "tcp://")):
        problems.append(
            f"--listen {config.listen}: expected ipc://PATH or tcp://HOST:PORT (lower case)"
        )
    if config.max_message_bytes < 1024:
        problems.append("--max-message-bytes must be at least 1024")
    if config.socket_mode & ~0o660:
        problems.append(
            f"--socket-mode {config.socket_mode:04o}: only owner and group read/write bits "
            "(a subset of 0660) may be set"
        )
    return problems
