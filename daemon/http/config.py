"""The HTTP front's settings and its ``--http HOST:PORT`` address: parsed, checked, bound.

Light (no Starlette, no uvicorn): the CLI and the daemon import it whether or not ``--http``
is given.
"""

from __future__ import annotations

import importlib.util
import socket
from dataclasses import dataclass

# What the HTTP front imports beyond the daemon's own needs (the daemon extra has them).
HTTP_MODULES = ("starlette", "uvicorn", "httptools", "prometheus_client")

# NOTE: what a client frame may carry beyond the bytes of the HTTP body it came from. Every
# field of a request body reaches the frame at most as long as its JSON (a msgpack string is
# never longer than its JSON string, an integer never longer than its decimal digits plus a
# separator); what the frame adds (its header, a request id, every field of ``Generate`` the
# body left out, at their defaults) is under 1 KiB, which ``test_http_openai`` checks; the
# rest leaves room for fields the frame may gain.
FRAME_HEADROOM = 64 * 2**10


def body_limit(max_message_bytes: int) -> int:
    """The largest HTTP body whose client frame fits in ``max_message_bytes``."""
    return max_message_bytes - FRAME_HEADROOM


@dataclass(frozen=True)
class HttpFrontConfig:
    """What the daemon hands the HTTP front (http/process.py) at spawn."""

    host: str
    port: int
    client_endpoint: str  # the daemon's client socket (the front door binds it once ready)
    served_model_name: str
    version: str
    model_dir: str | None  # for token texts in logprobs (its tokenizer.json)
    max_message_bytes: int  # the daemon's client frame limit (--max-message-bytes)
    max_body_bytes: int  # at most body_limit(max_message_bytes)
    max_tokenize_tokens: int
    read_timeout_s: float
    send_timeout_s: float
    max_connections: int
    api_key: str = ""  # "": no key checked
    allow_origins: tuple[str, ...] = ()
    log_level: str = "info"


def missing_http_modules() -> list[str]:
    return [name for name in HTTP_MODULES if importlib.util.find_spec(name) is None]


def parse_host_port(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) -> (host, port); raises ValueError."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def bind_http(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening); raises OSError."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock
