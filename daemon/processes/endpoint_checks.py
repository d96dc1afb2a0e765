"""The endpoints a serving configuration binds, checked before anything is spawned or loaded:
the client endpoint (``--listen``, else the default socket) and the ``--http`` address.
``outrider serve`` refuses to start on any problem; ``outrider plugins --check`` reports the
same ones.

Each problem is one line naming its flag. Nothing is taken but for an instant (a probe bind,
a shared lock; runtime.py) and no file is made or removed: a stale ``ipc://`` socket file
passes, as the daemon removes it under the lock.
"""

from __future__ import annotations

from outrider.daemon.config import ServeConfig
from outrider.daemon.http.config import bind_http, missing_http_modules, parse_host_port
from outrider.daemon.processes.runtime import (
    EndpointError,
    check_client_endpoint,
    tcp_bind_problem,
)
from outrider.protocol.endpoints import default_endpoint

LISTEN_FLAG = "--listen"
HTTP_FLAG = "--http"


def endpoint_problems(config: ServeConfig) -> list[str]:
    """Every reason ``config``'s endpoints cannot be bound now; empty when they can. A
    follower host (``--node-rank`` > 0) binds neither."""
    if config.node_rank > 0:
        return []
    return client_bind_problems(config) + http_bind_problems(config)


def client_bind_problems(config: ServeConfig) -> list[str]:
    """A TCP bind beyond loopback without CURVE keys, a live daemon on the ``ipc://`` path, or
    an address another process holds."""
    endpoint = config.listen or default_endpoint()
    beyond_loopback = tcp_bind_problem(
        endpoint, curve_keys=bool(config.curve_secret_key_file), insecure_tcp=config.insecure_tcp
    )
    if beyond_loopback is not None:
        return [beyond_loopback]
    try:
        check_client_endpoint(endpoint)
    except EndpointError as exc:
        return [f"{LISTEN_FLAG}: {exc}"]
    return []


def http_bind_problems(config: ServeConfig) -> list[str]:
    """The HTTP front's packages are installed and its address can be bound (the front binds
    it again as it starts)."""
    if not config.http:
        return []
    missing = missing_http_modules()
    if missing:
        return [f"{HTTP_FLAG} needs {', '.join(missing)}: pip install 'outrider[daemon]'"]
    try:
        bind_http(*parse_host_port(config.http)).close()
    except OSError as exc:
        return [f"{HTTP_FLAG}: cannot listen on {config.http}: {exc.strerror}"]
    return []
