"""The HTTP front's serve flags (``--http``, ``--http-*``, ``--api-key``,
``--served-model-name``): their help and their checks. The fields stay in the one flag table
(daemon/config.py's ``ServeConfig``); daemon/flags.py gathers this help and runs these checks.

Light (no Starlette, no uvicorn), as http/config.py: resolving the flags imports it whether or
not ``--http`` is given. Invariant: without ``--http`` every one of these flags keeps its
default.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from outrider.daemon.http.config import FRAME_HEADROOM, body_limit, parse_host_port
from outrider.daemon.processes.runtime import is_loopback

if TYPE_CHECKING:
    from outrider.daemon.config import ServeConfig

HTTP_HELP: dict[str, str] = {
    "http": "serve the OpenAI-compatible HTTP API there (loopback unless --http-allow-remote)",
    "http_allow_remote": "let --http bind beyond loopback",
    "api_key": (
        "with --http: every path but /health and /health/ready requires 'Authorization: "
        "Bearer KEY'; required with --http-allow-remote"
    ),
    "http_allow_origins": (
        "browser origins (scheme://host[:port], comma-separated) the HTTP API serves and "
        "answers CORS preflight for; a request from any other origin is refused"
    ),
    "http_max_body_bytes": (
        "largest HTTP request body (larger: 413, connection closed); at most the default"
    ),
    "http_max_tokenize_tokens": (
        "most token ids /tokenize answers with and /detokenize takes (more: 400)"
    ),
    "http_read_timeout": (
        "seconds an HTTP request's headers and body may take to arrive (then 408, closed)"
    ),
    "http_send_timeout": (
        "seconds an HTTP response may wait for its client to read (then the connection "
        "closes and its request is aborted)"
    ),
    "http_max_connections": "most HTTP connections at once (more: 503, closed)",
    "served_model_name": "the model name the HTTP API lists and requests may give",
}

HTTP_METAVARS: dict[str, str] = {
    "http": "HOST:PORT",
    "api_key": "KEY",
    "served_model_name": "NAME",
    "http_allow_origins": "ORIGINS",
    "http_read_timeout": "S",
    "http_send_timeout": "S",
}

HTTP_SHOWN_DEFAULTS: dict[str, str] = {
    "http_max_body_bytes": f"--max-message-bytes less {FRAME_HEADROOM // 2**10} KiB",
    "served_model_name": "the model directory's name (outrider-family for the embedded family)",
}


def http_problems(config: ServeConfig) -> list[str]:
    """What keeps the HTTP flags of ``config`` from serving, each naming its flag."""
    if not config.http:
        given = [
            "--" + f.name.replace("_", "-")
            for f in fields(config)
            if f.name in HTTP_HELP and f.name != "http" and getattr(config, f.name) != f.default
        ]
        return [f"{', '.join(given)}: need --http"] if given else []
    try:
        host, _port = parse_host_port(config.http)
    except ValueError as exc:
        return [f"--http: {exc}"]
    if not config.http_allow_remote and not is_loopback(host):
        return [f"--http {config.http}: {host} is not a loopback address (--http-allow-remote)"]
    if config.http_allow_remote and not config.api_key:
        return [
            "--http-allow-remote needs --api-key: beyond loopback, anyone who reaches the port "
            "would drive the daemon"
        ]
    if config.curve_secret_key_file:
        return ["--http with CURVE keys is not supported: the HTTP front would need a client key"]
    return _limit_problems(config)


def _limit_problems(config: ServeConfig) -> list[str]:
    problems = []
    largest = body_limit(config.max_message_bytes)
    if largest < 1:
        problems.append(f"--max-message-bytes must exceed {FRAME_HEADROOM} with --http")
    elif not 0 <= config.http_max_body_bytes <= largest:
        problems.append(
            f"--http-max-body-bytes must be in [1, {largest}] (--max-message-bytes less "
            f"{FRAME_HEADROOM}), or 0 for that"
        )
    if config.http_max_tokenize_tokens < 1 or config.http_max_connections < 1:
        problems.append("--http-max-tokenize-tokens and --http-max-connections must be >= 1")
    if config.http_read_timeout <= 0 or config.http_send_timeout <= 0:
        problems.append("--http-read-timeout and --http-send-timeout must be > 0")
    for origin in config.http_origins:
        scheme, sep, rest = origin.partition("://")
        if scheme not in ("http", "https") or not sep or not rest or "/" in rest or "*" in rest:
            problems.append(
                f"--http-allow-origins {origin!r}: expected scheme://host[:port] (no path, "
                "no wildcard)"
            )
    return problems
