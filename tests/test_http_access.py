"""The HTTP front's access rule (http/access.py) and its error guard (http/errors.py),
driven through ASGI with no daemon: which Host, Origin and Authorization headers get in."""

from __future__ import annotations

import logging

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router

from outrider.daemon.http.access import Access, AccessRule, is_loopback_host
from outrider.daemon.http.errors import Guard


async def _ok(request: Request) -> Response:
    await request.body()
    return JSONResponse({"ok": True})


async def _boom(_request: Request) -> Response:
    raise KeyError("x" * 10_000)


def _app(rule: AccessRule) -> Guard:
    routes = [
        Route(path, _ok, methods=["GET", "POST"])
        for path in ("/health", "/health/ready", "/metrics", "/tokenize", "/v1/models")
    ]
    return Guard(Access(Router([*routes, Route("/boom", _boom)]), rule))


def _client(rule: AccessRule) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=_app(rule))
    return httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000")


def test_loopback_host_names() -> None:
    for host in ("localhost", "LOCALHOST:8000", "127.0.0.1", "127.8.9.1:80", "[::1]", "[::1]:9"):
        assert is_loopback_host(host), host
    for host in ("evil.example", "evil.example:8000", "10.0.0.1", "[::2]:8000", "[::1", ""):
        assert not is_loopback_host(host), host


async def test_without_a_key_only_loopback_hosts_and_no_browsers_are_served() -> None:
    async with _client(AccessRule(loopback=True)) as client:
        assert (await client.get("/v1/models")).status_code == 200
        for host in ("localhost:8000", "[::1]:8000", "127.0.0.2"):
            assert (await client.get("/v1/models", headers={"Host": host})).status_code == 200
        # DNS rebinding: a page on evil.example that resolves its name to 127.0.0.1.
        rebound = await client.get("/v1/models", headers={"Host": "evil.example:8000"})
        assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "forbidden"
        # A "simple" cross-origin POST a browser sends with no preflight.
        simple = await client.post(
            "/v1/models",
            content=b'{"prompt": "x"}',
            headers={"Content-Type": "text/plain", "Origin": "http://evil.example"},
        )
        assert simple.status_code == 403
        assert "access-control-allow-origin" not in simple.headers
        preflight = await client.options(
            "/v1/models",
            headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert preflight.status_code == 403


async def test_allowed_origins_get_cors() -> None:
    rule = AccessRule(loopback=True, allow_origins=frozenset({"http://app.example"}))
    async with _client(rule) as client:
        origin = {"Origin": "http://app.example"}
        preflight = await client.options(
            "/v1/models", headers=origin | {"Access-Control-Request-Method": "POST"}
        )
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == "http://app.example"
        assert "Authorization" in preflight.headers["access-control-allow-headers"]
        served = await client.get("/v1/models", headers=origin)
        assert served.status_code == 200
        assert served.headers["access-control-allow-origin"] == "http://app.example"
        other = await client.get("/v1/models", headers={"Origin": "http://other.example"})
        assert other.status_code == 403


async def test_the_key_guards_every_path_but_health() -> None:
    rule = AccessRule(loopback=False, api_key="s3cret")
    async with _client(rule) as client:
        for path in ("/health", "/health/ready"):
            assert (await client.get(path, headers={"Host": "lb.example"})).status_code == 200
        for path in ("/metrics", "/tokenize", "/v1/models"):
            refused = await client.get(path)
            assert refused.status_code == 401, path
            assert refused.headers["www-authenticate"] == "Bearer"
        for value in ("Bearer s3cret", "bearer s3cret", "BEARER  s3cret "):
            answered = await client.get("/tokenize", headers={"Authorization": value})
            assert answered.status_code == 200, value
        for value in ("Bearer s3cre", "Basic s3cret", "s3cret", "Bearer", "Bearer s3cret2"):
            answered = await client.get("/tokenize", headers={"Authorization": value})
            assert answered.status_code == 401, value
        # With a key, a proxy's Host is fine.
        proxied = {"Authorization": "Bearer s3cret", "Host": "api.example"}
        assert (await client.get("/v1/models", headers=proxied)).status_code == 200


async def test_an_unexpected_exception_is_one_line_and_a_500(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    async with _client(AccessRule(loopback=True)) as client:
        for _ in range(3):
            answer = await client.get("/boom")
            assert answer.status_code == 500
            assert answer.json()["error"]["type"] == "internal_error"
    records = [r for r in caplog.records if r.name == "outrider.http"]
    assert len(records) == 3
    assert all(r.exc_info is None and len(r.getMessage()) < 300 for r in records)
    assert "KeyError" in records[0].getMessage()
