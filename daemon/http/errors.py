"""The HTTP front's error answers: the OpenAI error shape, the status of each daemon error
code, and the outermost guard that turns anything a route raises into one answer.

Invariants:

- Every error body is ``{"error": {"message", "type", "param", "code"}}``.
- No error body names a socket path or an internal endpoint: the client library's
  ``connection_lost`` and ``timeout`` messages name the daemon's endpoint, so HTTP clients get
  a generic message and the detail goes to the log.
- A request never costs more than one log line: an unexpected exception is a 500 and one
  line with its type (no traceback); a client that went away mid-read costs nothing.
"""

from __future__ import annotations

import logging
import re

import msgspec
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outrider.protocol import RequestError

log = logging.getLogger("outrider.http")

STATUS_OF_CODE = {
    "invalid_request": 400,
    "unsupported": 400,
    "prompt_too_long": 413,
    "overloaded": 429,
    "shutting_down": 503,
    "connection_lost": 503,
    "timeout": 503,
}
_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}
# Codes whose client-library message names the daemon's endpoint.
_PUBLIC_MESSAGE = {
    "connection_lost": "the daemon is not reachable",
    "timeout": "the daemon did not answer in time",
}
_DETAIL_CHARS = 200  # of an unexpected exception's repr, in its one log line
# A msgspec validation path (``... - at `$.messages[0].content```).
# msgspec's "... - at `$.a.b`", or "... - at `key` in `$.a`" for a key of a map.
_PATH = re.compile(r" - at (`key` in )?`\$\.?([^`]*)`$")


def error_body(status: int, message: str, param: str | None, code: str | None) -> bytes:
    kind = _TYPE_OF_STATUS.get(status, "internal_error")
    return msgspec.json.encode(
        {"error": {"message": message, "type": kind, "param": param, "code": code}}
    )


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    body = error_body(status, message, param, code)
    return Response(body, status, headers=headers, media_type="application/json")


def public_message(exc: RequestError) -> str:
    """What an HTTP client is told of a client-library error; a message that names the
    daemon's endpoint is logged and replaced."""
    public = _PUBLIC_MESSAGE.get(exc.code)
    if public is None:
        return exc.message
    log.warning("daemon request failed: %s: %s", exc.code, exc.message)
    return public


def split_path(
    message: str, rename: dict[str, str] | None = None, prefix: str = ""
) -> tuple[str, str | None]:
    """A msgspec validation message with its field path as ``param``: the path after
    ``prefix``, its first name renamed by ``rename`` (the daemon's names to the OpenAI names
    the client sent); the message names the same path."""
    found = _PATH.search(message)
    if found is None:
        return message, prefix or None
    key, path = found.group(1) or "", found.group(2)  # "max_tokens", "messages[0].content"
    name = re.split(r"[.\[]", path, maxsplit=1)[0]
    param = prefix + (rename or {}).get(name, name) + path[len(name) :]
    return f"{message[: found.start()]} - at {key}`$.{param}`", param or None


class Guard:
    """ASGI middleware, outermost: a client gone mid-read ends its request silently; any
    other exception becomes a 500 (when nothing was answered yet) and one log line."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._app(scope, receive, tracking_send)
        except ClientDisconnect:
            pass
        except Exception as exc:  # the last line of defence, logged
            detail = repr(exc)[:_DETAIL_CHARS]
            log.error("%s %s failed: %s", scope.get("method"), scope.get("path"), detail)
            if not started and scope["type"] == "http":
                await error_response(500, "internal error", code="internal_error")(
                    scope, receive, send
                )
