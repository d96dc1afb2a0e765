"""Who the HTTP front serves: the access rule, checked before any route runs.

The daemon's ipc socket is mode 0600: only its own user may drive it. A TCP port on loopback
is open to every local user and, through a browser, to every web page, so the HTTP front
applies a rule as strict as it can without a key, and requires a key beyond loopback:

- loopback, no key: the Host header must name a loopback host (``localhost``,
  ``127.0.0.0/8``, ``[::1]``, any port), since a DNS-rebinding page sends its own name;
- ``--api-key`` (on loopback or beyond): every path but the open ones needs
  ``Authorization: Bearer KEY``; beyond loopback the key is required (a start error);
- always: a request with an ``Origin`` header (a browser's) is refused unless
  ``--http-allow-origins`` names that origin; CORS preflight is answered for those origins
  only (CORS is off unless asked for).

Other local users can still reach a loopback port without a key (TCP has no owner check):
the log says so at start; ``--api-key`` closes it.

Open paths: ``/health`` and ``/health/ready`` answer without a key, so that a load balancer's
health check (which has no key) can reach them; they say only whether the daemon serves.
Everything else, ``/metrics`` and ``/tokenize`` included, needs the key (a Prometheus scrape
can send a bearer token).

The key is compared in constant time (of a digest, so not even its length leaks); the scheme
``Bearer`` is case-insensitive (RFC 7235).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outrider.daemon.http.errors import error_response
from outrider.daemon.processes.runtime import is_loopback

OPEN_PATHS = frozenset({"/health", "/health/ready"})
PREFLIGHT_MAX_AGE_S = 600
_ALLOWED_HEADERS = "Authorization, Content-Type"


@dataclass(frozen=True)
class AccessRule:
    """The access rule of one HTTP front (see the module docstring)."""

    loopback: bool  # bound to a loopback address
    api_key: str = ""  # "": no key checked
    allow_origins: frozenset[str] = frozenset()

    @property
    def checks_host(self) -> bool:
        return self.loopback and not self.api_key

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.api_key:
            who = "requests with the API key (health checks without)"
        else:
            who = (
                "any local user without a key (loopback TCP has no owner check: set "
                "--api-key to restrict it); Host must name a loopback host"
            )
        origins = ", ".join(sorted(self.allow_origins)) or "none (CORS off)"
        return f"HTTP access: {who}; browser origins allowed: {origins}"


def is_loopback_host(host: str) -> bool:
    """Whether a Host header value (``name[:port]`` or ``[v6][:port]``) names a loopback
    host."""
    if host.startswith("["):
        name, sep, _ = host[1:].partition("]")
        if not sep:
            return False
    else:
        name = host.rpartition(":")[0] if ":" in host else host
    return is_loopback(name.lower().removesuffix("."))


def bearer_token(value: bytes) -> bytes | None:
    """The token of an ``Authorization: Bearer TOKEN`` value, the scheme in any case."""
    scheme, _, token = value.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip()


class Access:
    """ASGI middleware enforcing an ``AccessRule``."""

    def __init__(self, app: ASGIApp, rule: AccessRule) -> None:
        self._app = app
        self._rule = rule
        self._key_digest = hashlib.sha256(rule.api_key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        hosts = [value for name, value in headers if name == b"host"]
        origins = [value.decode("latin-1") for name, value in headers if name == b"origin"]
        refusal = self._refusal(hosts, origins)
        if refusal is not None:
            await error_response(403, refusal, code="forbidden")(scope, receive, send)
            return
        origin = origins[0] if origins else None
        if origin is not None and scope["method"] == "OPTIONS":
            await self._preflight(origin)(scope, receive, send)
            return
        if self._rule.api_key and scope["path"] not in OPEN_PATHS and not self._has_key(headers):
            response = error_response(
                401,
                "invalid or missing API key",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        if origin is None:
            await self._app(scope, receive, send)
            return

        async def cors_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = [(b"access-control-allow-origin", origin.encode()), (b"vary", b"Origin")]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self._app(scope, receive, cors_send)

    def _refusal(self, hosts: list[bytes], origins: list[str]) -> str | None:
        if self._rule.checks_host and not all(
            is_loopback_host(host.decode("latin-1")) for host in hosts
        ):
            return "the Host header does not name a loopback host"
        if len(origins) > 1 or any(o not in self._rule.allow_origins for o in origins):
            return "requests from this origin are not allowed (--http-allow-origins)"
        return None

    def _has_key(self, headers: list[tuple[bytes, bytes]]) -> bool:
        given = next((value for name, value in headers if name == b"authorization"), b"")
        token = bearer_token(given)
        digest = hashlib.sha256(token or b"").digest()
        return token is not None and hmac.compare_digest(digest, self._key_digest)

    @staticmethod
    def _preflight(origin: str) -> ASGIApp:
        return Response(
            status_code=204,
            headers={
                "Access-Control-Allow-Origin": origin,
                "Access-Control-Allow-Methods": "GET, POST",
                "Access-Control-Allow-Headers": _ALLOWED_HEADERS,
                "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
                "Vary": "Origin",
            },
        )
