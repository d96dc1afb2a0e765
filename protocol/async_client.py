"""``AsyncClient``: the asyncio twin of ``Client`` (``client.py``), with ``AsyncTokenStream``.

Everything but the waiting is shared with ``Client`` (``_client_common.py``,
``_connection.py``, ``_client_core.py``); this module adds only the awaiting: one reader task
per client routes replies to the waiting tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType

import zmq
import zmq.asyncio

from outrider.protocol._client_common import (
    GenerateCall,
    GenerateResult,
    TokenChunk,
    abort_request,
    expect,
    health_query,
    server_info_query,
    takes_generate_arguments,
    to_result,
)
from outrider.protocol._client_core import ClientCore, StreamState
from outrider.protocol._connection import Inbox
from outrider.protocol.messages import (
    Ack,
    Chunk,
    ClientReply,
    ClientRequest,
    Generate,
    Health,
    ServerInfo,
)


class AsyncClient(ClientCore):
    """asyncio client of one daemon, bound to the event loop of its first call.

    Any number of tasks may call it at once: one reader task (started on the first call)
    routes every reply to its caller by ``request_id``. Arguments, timeouts and errors as for
    ``Client``; cancelling a call releases its request (a Generate is aborted, best effort).
    """

    # Set by the first call (_start_reading).
    _loop: asyncio.AbstractEventLoop | None = None
    _reader: asyncio.Task[None] | None = None

    @takes_generate_arguments
    async def generate(self, call: GenerateCall) -> GenerateResult:
        """As ``Client.generate``."""
        msg = call.request(stream=False)
        deadline = self._deadline(call.timeout)
        inbox = await self._submit(msg, deadline)
        while True:
            reply = await self._receive(inbox, deadline)
            if not isinstance(reply, Chunk):
                return to_result(reply)

    @takes_generate_arguments
    def stream(self, call: GenerateCall) -> AsyncTokenStream:
        """As ``Client.stream``, but the request is sent when iteration starts, and
        ``timeout`` counts from then."""
        return AsyncTokenStream(self, call.request(stream=True), call.timeout)

    async def abort(self, request_id: str, *, timeout: float | None = None) -> None:
        """As ``Client.abort``."""
        expect(await self._call(abort_request(request_id), timeout), Ack)

    async def health(self, timeout: float | None = 5.0) -> Health:
        """As ``Client.health``."""
        return expect(await self._call(health_query(), timeout), Health)

    async def server_info(self, timeout: float | None = None) -> ServerInfo:
        """As ``Client.server_info``."""
        return expect(await self._call(server_info_query(), timeout), ServerInfo)

    def close(self) -> None:
        """Close the socket and stop the reader; calls in flight end with ``connection_lost``.
        Call it on the client's event loop (``async with`` does)."""
        self._shutdown()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
        if self._reader is not None:
            await asyncio.wait([self._reader])

    def _open_sockets(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        ctx = zmq.asyncio.Context.instance()
        # The owners, used to wait and to send; NOBLOCK reads and best-effort aborts go
        # through the blocking views.
        self._asock = ctx.socket(zmq.DEALER)
        self._amonitor = ctx.socket(zmq.PAIR)
        return self._asock, self._amonitor

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _start_reading(self) -> None:
        loop = asyncio.get_running_loop()
        if self._reader is None:
            self._loop = loop
            self._reader = loop.create_task(self._read_replies(), name="outrider-client-reader")
        elif loop is not self._loop:
            raise RuntimeError("an AsyncClient serves the event loop of its first call only")
        elif self._reader.done():
            raise RuntimeError("the reply reader of this AsyncClient has stopped")

    def _stop_reading(self) -> None:
        if self._reader is not None:
            self._reader.cancel()

    async def _read_replies(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._asock, zmq.POLLIN)
        poller.register(self._amonitor, zmq.POLLIN)
        try:
            while True:
                await poller.poll()
                self._pump()
        except Exception as exc:
            self._fail_all("internal", f"the reply reader failed: {exc!r}")
            raise

    async def _call(self, msg: ClientRequest, timeout: float | None) -> ClientReply:
        deadline = self._deadline(timeout)
        return await self._receive(await self._submit(msg, deadline), deadline)

    async def _submit(self, msg: ClientRequest, deadline: float | None) -> Inbox:
        with self._sending(msg) as outgoing:
            inbox = outgoing.inbox
            sent = asyncio.ensure_future(self._asock.send(outgoing.frame))
            # NOTE: as in Client._submit, a link lost while the send waits ends the request:
            # the reader puts its final connection_lost in the inbox, which wakes this wait.
            try:
                async with asyncio.timeout_at(deadline):
                    while not (sent.done() or inbox.final):
                        inbox.waiter = asyncio.get_running_loop().create_future()
                        await asyncio.wait(
                            (sent, inbox.waiter), return_when=asyncio.FIRST_COMPLETED
                        )
                if sent.done():
                    sent.result()  # a send that failed raises here
            except TimeoutError:
                raise self._timeout_error(msg.request_id) from None
            finally:
                inbox.waiter = None
                # A send still waiting is dropped unsent (pyzmq skips cancelled sends).
                sent.cancel()
        return inbox

    async def _receive(self, inbox: Inbox, deadline: float | None) -> ClientReply:
        """As ``Client._receive``; cancellation releases the request too."""
        with self._awaiting_reply(inbox, deadline) as limits:
            for limit in limits:
                inbox.waiter = asyncio.get_running_loop().create_future()
                # NOTE: a limit that passes only means "look again": frames heard meanwhile
                # move the idle limit, and _wait_limit raises once one has really passed.
                try:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout_at(limit):
                            await inbox.waiter
                finally:
                    inbox.waiter = None
        return self._take(inbox)


class AsyncTokenStream(StreamState[AsyncClient]):
    """Async iterator over the chunks of one streamed request (``AsyncClient.stream``);
    otherwise as ``TokenStream``."""

    def __init__(self, client: AsyncClient, msg: Generate, timeout: float | None) -> None:
        super().__init__(client, msg.request_id, None)
        self._msg = msg
        self._timeout = timeout

    def __aiter__(self) -> AsyncTokenStream:
        return self

    async def __anext__(self) -> TokenChunk:
        if self._done:
            raise StopAsyncIteration
        try:
            inbox = self._inbox
            if inbox is None:
                self._deadline = self._client._deadline(self._timeout)
                inbox = self._track(await self._client._submit(self._msg, self._deadline))
            chunk = self._step(await self._client._receive(inbox, self._deadline))
        except BaseException:
            self._done = True
            raise
        if chunk is None:
            raise StopAsyncIteration
        return chunk
