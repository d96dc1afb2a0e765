"""The HTTP front: an OpenAI-compatible server (Starlette on uvicorn) in its own process, one
more client of the daemon's ZeroMQ protocol (``AsyncClient``).

It is the daemon's third child (processes/children.py), under the same contract as the other two
(processes/child_runtime.py): it binds its HTTP socket at start and reports ``serving`` (or
``bind_failed``), heartbeats through its pipe, and once the daemon closes the pipe it stops
accepting connections, lets the responses in flight end (the daemon has drained by then: each
has had its final frame), and exits. While the daemon loads the model (its front door not bound
yet), ``/health`` and ``/health/ready`` answer 503 ``{"status": "loading"}``, at once where the
daemon's lock file tells (http/loading.py); while it drains, new requests are answered 503 (the
front door's ``shutting_down``).

Status codes from the daemon's error codes: ``invalid_request`` / ``unsupported`` 400,
``prompt_too_long`` 413, ``overloaded`` 429, ``shutting_down`` / ``connection_lost`` /
``timeout`` 503, anything else 500 (http/errors.py). A client that goes away aborts its
request, streamed or not.

Before a route runs, a request passes, outermost first: ``Guard`` (one 500 and one log line
for anything unexpected), ``Access`` (the access rule: Host, Origin, the API key;
http/access.py), ``BodyLimit`` (http/limits.py); the connection itself is held to
``LimitedHttpProtocol``'s read, send and connection limits. Since every HTTP request shares
one client connection, which the front door drops for a frame over ``--max-message-bytes``,
the body limit keeps every accepted request's frame under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import msgspec
import uvicorn
import zmq.asyncio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route, Router
from starlette.types import ASGIApp, Receive, Scope, Send

from outrider.daemon.http.access import Access, AccessRule
from outrider.daemon.http.choices import (
    close_all,
    every,
    first_chunk,
    rest_of,
    sse_events,
)
from outrider.daemon.http.config import HttpFrontConfig, bind_http
from outrider.daemon.http.errors import (
    STATUS_OF_CODE,
    Guard,
    error_response,
    public_message,
    split_path,
)
from outrider.daemon.http.limits import BodyLimit, ConnectionLimits, limited_protocol
from outrider.daemon.http.loading import LoadingWatch
from outrider.daemon.http.metrics import render_metrics
from outrider.daemon.http.openai import (
    DAEMON_FIELDS,
    ChatRequest,
    CompletionRequest,
    GenerateArgs,
    InvalidRequest,
    chat_args,
    completion_args,
    decode_request,
)
from outrider.daemon.http.responses import Shape, TokenTexts, new_id, now
from outrider.daemon.http.tokenize import Tokenization
from outrider.daemon.processes.child_runtime import ChildTasks, ParentPipe, child_setup, run_child
from outrider.daemon.processes.runtime import is_loopback
from outrider.protocol import (
    AsyncClient,
    AsyncTokenStream,
    GenerateResult,
    NotListening,
    RequestError,
)
from outrider.protocol.tool_calls import TOOL_CALL_FORMATS, ToolCallFormat

log = logging.getLogger("outrider.http")

T = TypeVar("T")
R = TypeVar("R", CompletionRequest, ChatRequest)

HEALTH_TIMEOUT_S = 2.0
# How often a non-streamed request checks whether its client is still there.
DISCONNECT_POLL_S = 0.25
GRACEFUL_SHUTDOWN_S = 1  # within child_runtime.FLUSH_LIMIT_S
# The status logged for a request whose client left before its answer (nginx's convention).
CLIENT_GONE = 499
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def run_http_front(cfg: HttpFrontConfig, parent_conn: Connection) -> None:
    """Entry point of the HTTP front process (``multiprocessing`` spawn target)."""
    child_setup("http", cfg.log_level)
    run_child(lambda ctx: _main(cfg, ParentPipe(parent_conn, "http"), ctx))


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # NOTE: children ignore SIGINT/SIGTERM (the daemon stops them by closing the pipe);
        # uvicorn would otherwise install its own handlers and re-raise the signal at exit.
        yield


async def _main(cfg: HttpFrontConfig, parent: ParentPipe, _ctx: zmq.asyncio.Context) -> None:
    try:
        sock = bind_http(cfg.host, cfg.port)
    except OSError as exc:
        parent.report("bind_failed", error=exc.strerror or str(exc))
        await ChildTasks(parent).run()
        return
    host, port = sock.getsockname()[:2]
    # NOTE: every HTTP request shares this connection. Its ZeroMQ thread takes every reply in
    # (reply_hwm=0) whatever this event loop does, so the front door never finds it behind
    # and no request ends another; each HTTP response has its own send timeout instead.
    client = AsyncClient(cfg.client_endpoint, max_message_bytes=cfg.max_message_bytes, reply_hwm=0)
    front = HttpFront(cfg, client)
    app = front.app()
    limits = ConnectionLimits(cfg.read_timeout_s, cfg.send_timeout_s, cfg.max_connections)
    server = _Server(
        uvicorn.Config(
            app,
            loop="none",
            http=limited_protocol(limits),
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
    )
    tasks = ChildTasks(parent)
    stopping = False

    async def serve() -> None:
        await server.serve(sockets=[sock])
        if not stopping:
            raise RuntimeError("the HTTP server stopped on its own")

    def parent_gone() -> None:
        nonlocal stopping
        stopping = True
        server.should_exit = True

    tasks.spawn(serve())
    parent.report("serving", endpoint=f"http://{host}:{port}")
    log.info("HTTP front on http://%s:%d (model %s)", host, port, cfg.served_model_name)
    log.info("%s", front.access.describe())
    try:
        await tasks.run(parent_gone=parent_gone, flushed=lambda: not server.server_state.tasks)
    finally:
        front.close()
        client.close()


def invalid_response(exc: InvalidRequest) -> Response:
    return error_response(exc.status, str(exc), param=exc.param, code=exc.code)


def request_error_response(exc: RequestError, rename: dict[str, str] = DAEMON_FIELDS) -> Response:
    """The answer to a daemon's refusal; a field it names is named as the client sent it."""
    message, param = split_path(public_message(exc), rename)
    return error_response(STATUS_OF_CODE.get(exc.code, 500), message, param, exc.code)


def json_response(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status, media_type="application/json")


class _Stream(StreamingResponse):
    """An SSE response that aborts its requests (one a choice) when it ends unfinished, however
    it ends (a client that went away makes the next send fail, or cancels the task)."""

    def __init__(self, body: AsyncIterator[bytes], streams: list[AsyncTokenStream]) -> None:
        super().__init__(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._streams:
                stream.close()


class HttpFront:
    """The routes; every request goes to the daemon through one shared ``AsyncClient``."""

    def __init__(self, cfg: HttpFrontConfig, client: AsyncClient) -> None:
        self._cfg = cfg
        self._client = client
        self._texts = TokenTexts(cfg.model_dir)
        self._tokenization = Tokenization(cfg.model_dir, cfg.max_tokenize_tokens)
        self.access = AccessRule(
            loopback=is_loopback(cfg.host),
            api_key=cfg.api_key,
            allow_origins=frozenset(cfg.allow_origins),
        )
        self._daemon_configuration: dict[str, Any] | None = None  # once asked
        self._created = now()
        self._loading = LoadingWatch(cfg.client_endpoint)

    def app(self) -> ASGIApp:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/health/ready", self.ready, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ]
        return Guard(Access(BodyLimit(Router(routes), self._cfg.max_body_bytes), self.access))

    async def health(self, _request: Request) -> Response:
        """200 when the daemon answers ``health`` at all (serving, not serving or draining);
        503 ``{"status": "loading"}`` while it loads the model."""
        return await self._health_response(serving_only=False)

    async def ready(self, _request: Request) -> Response:
        """200 only while the daemon serves (not loading, not draining)."""
        return await self._health_response(serving_only=True)

    async def _health_response(self, *, serving_only: bool) -> Response:
        if self._loading.loading():
            return json_response({"status": "loading"}, 503)
        try:
            health = await self._client.health(timeout=HEALTH_TIMEOUT_S)
        except RequestError as exc:
            if isinstance(exc, NotListening) and self._loading.loading_if_not_listening():
                return json_response({"status": "loading"}, 503)
            message = f"the daemon does not answer: {public_message(exc)}"
            return error_response(503, message, code=exc.code)
        self._loading.answered()
        status = 503 if serving_only and health.status != "serving" else 200
        return json_response({"status": health.status}, status)

    def close(self) -> None:
        self._tokenization.close()

    async def metrics(self, _request: Request) -> Response:
        """The daemon's counters (one ``server_info``) in the Prometheus text format."""
        try:
            info = await self._client.server_info(timeout=HEALTH_TIMEOUT_S)
        except RequestError as exc:
            message = f"the daemon does not answer: {public_message(exc)}"
            return error_response(503, message, code=exc.code)
        body = render_metrics(info, self._cfg.served_model_name)
        return Response(body, media_type=PROMETHEUS_TEXT)

    async def tokenize(self, request: Request) -> Response:
        try:
            tokens = await self._tokenization.tokenize(await request.body(), self._check_model)
            max_model_len = await self._context_length()
        except InvalidRequest as exc:
            return invalid_response(exc)
        except RequestError as exc:
            return request_error_response(exc)
        return json_response(
            {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens}
        )

    async def detokenize(self, request: Request) -> Response:
        try:
            text = await self._tokenization.detokenize(await request.body(), self._check_model)
        except InvalidRequest as exc:
            return invalid_response(exc)
        return json_response({"prompt": text})

    async def _context_length(self) -> int:
        return int((await self._configuration())["context_length"])

    async def _tool_format(self) -> ToolCallFormat | None:
        fmt = (await self._configuration()).get("tool_call_format")
        return fmt if fmt in TOOL_CALL_FORMATS else None

    async def _configuration(self) -> dict[str, Any]:
        """The daemon's configuration (``server_info``), asked once."""
        if self._daemon_configuration is None:
            info = await self._client.server_info(timeout=HEALTH_TIMEOUT_S)
            self._daemon_configuration = info.configuration
        return self._daemon_configuration

    async def version(self, _request: Request) -> Response:
        return json_response({"version": self._cfg.version})

    async def models(self, _request: Request) -> Response:
        card = {
            "id": self._cfg.served_model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "outrider",
        }
        return json_response({"object": "list", "data": [card]})

    async def completions(self, request: Request) -> Response:
        try:
            req = decode_request(await request.body(), CompletionRequest)
            return await self._answer(request, req, completion_args, chat=False)
        except InvalidRequest as exc:
            return invalid_response(exc)

    async def chat_completions(self, request: Request) -> Response:
        try:
            req = decode_request(await request.body(), ChatRequest)
            return await self._answer(request, req, chat_args, chat=True)
        except InvalidRequest as exc:
            return invalid_response(exc)

    async def _answer(
        self, request: Request, req: R, to_args: Callable[[R], GenerateArgs], *, chat: bool
    ) -> Response:
        """``req`` checked and run; raises ``InvalidRequest`` before anything is sent."""
        self._check_model(req.model)
        args = to_args(req)
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        rename = DAEMON_FIELDS
        if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
            rename = DAEMON_FIELDS | {"max_new_tokens": "max_completion_tokens"}
        return await self._run(request, args, chat, req.stream, include_usage, rename)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self._cfg.served_model_name:
            raise InvalidRequest(
                f"model {model!r} is not served here (this is {self._cfg.served_model_name!r})",
                "model",
                status=404,
                code="model_not_found",
            )

    async def _run(
        self,
        request: Request,
        args: GenerateArgs,
        chat: bool,
        streamed: bool,
        include_usage: bool,
        rename: dict[str, str],
    ) -> Response:
        shape = Shape(
            chat=chat,
            request_id=new_id("chatcmpl" if chat else "cmpl"),
            model=self._cfg.served_model_name,
            created=now(),
            top_logprobs=args.top_logprobs,
            texts=self._texts,
            tool_format=await self._tool_format() if args.calls_tools else None,
        )
        # NOTE: choices that arrive together would each compute the prompt: the first goes
        # alone until its first chunk, and the others find its prompt in the prefix cache.
        choices = args.choice_kwargs()
        if not streamed:
            calls: list[Awaitable[GenerateResult]] = []
            leads = [self._client.stream(**choices[0])] if len(choices) > 1 else []
            try:
                for lead in leads:
                    await first_chunk(lead)
                    calls.append(rest_of(lead))
                calls += [self._client.generate(**kwargs) for kwargs in choices[len(leads) :]]
                results = await _unless_gone(request, asyncio.ensure_future(every(calls)))
            except RequestError as exc:
                return request_error_response(exc, rename)
            finally:
                close_all(leads)
            if results is None:  # nobody reads this answer: the requests were aborted
                return Response(status_code=CLIENT_GONE)
            return json_response(shape.full(results))
        streams = [self._client.stream(**kwargs) for kwargs in choices]
        # The first chunks are awaited here, so that a refused request gets its status code.
        try:
            firsts = [await first_chunk(streams[0])]
            firsts += await every([first_chunk(stream) for stream in streams[1:]])
        except RequestError as exc:
            close_all(streams)
            return request_error_response(exc, rename)
        return _Stream(sse_events(shape, streams, firsts, include_usage), streams)


async def _unless_gone(request: Request, call: asyncio.Future[T]) -> T | None:
    """``call``'s result, or None once the client has gone away: ``call`` is then cancelled,
    which aborts its request (``AsyncClient``)."""
    while True:
        done, _ = await asyncio.wait({call}, timeout=DISCONNECT_POLL_S)
        if done:
            return call.result()
        if await request.is_disconnected():
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError, RequestError):
                await call
            return None
