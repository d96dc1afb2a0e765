"""``ClientCore``: what a call does on either client apart from waiting, and ``StreamState``,
what either token stream keeps.

A call is: build its request (``GenerateCall`` and the queries of ``_client_common.py``),
send it inside ``_sending`` (refused unsent when closed, oversized or a duplicate id; released
when the send fails), then take replies inside ``_awaiting_reply`` until the final one. A
client supplies only the waiting: how it waits to send, and how it waits for each limit
``_awaiting_reply`` hands it.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from outrider.protocol._client_common import GenerateResult, TokenChunk, to_chunk, to_result
from outrider.protocol._connection import Connection, Inbox
from outrider.protocol.messages import Chunk, ClientReply, ClientRequest


@dataclass(frozen=True)
class Outgoing:
    """A request registered and encoded, not sent yet."""

    inbox: Inbox
    frame: bytes


class ClientCore(Connection):
    """The part of a call both clients share: sending and receiving around their waits."""

    @contextlib.contextmanager
    def _sending(self, msg: ClientRequest) -> Iterator[Outgoing]:
        """Register and encode ``msg``; the block sends the frame. Raises ``RuntimeError``
        when closed, ``RequestError`` for an oversized request or an id already live; an
        exception from the block releases the request."""
        self._check_open()
        self._start_reading()
        frame = self._encode(msg)
        inbox = self._register(msg.request_id)
        try:
            yield Outgoing(inbox, frame)
        except BaseException:
            self._release(inbox, abort=False)
            raise
        self._mark_sent(inbox, msg)

    @contextlib.contextmanager
    def _awaiting_reply(
        self, inbox: Inbox, deadline: float | None
    ) -> Iterator[Iterator[float | None]]:
        """The limits, on ``_now``'s clock (None: none), to wait up to and look again until
        ``inbox`` holds a reply; ``Timeout`` once the deadline or the idle limit passes. An
        exception from the block (``Timeout``, ``KeyboardInterrupt``, cancellation) releases
        the request, aborting a Generate."""
        try:
            yield self._wait_limits(inbox, deadline)
        except BaseException:
            self._release(inbox, abort=True)
            raise

    def _wait_limits(self, inbox: Inbox, deadline: float | None) -> Iterator[float | None]:
        since = time.monotonic()
        while not inbox.replies:
            yield self._wait_limit(deadline, since, inbox.request_id)


C = TypeVar("C", bound=ClientCore)


class StreamState(Generic[C]):
    """What ``TokenStream`` and ``AsyncTokenStream`` keep: the request's inbox (None until
    sent), its deadline, the result once finished, and whether iteration is over."""

    def __init__(self, client: C, request_id: str, deadline: float | None) -> None:
        self.request_id = request_id
        self.result: GenerateResult | None = None
        self._client = client
        self._inbox: Inbox | None = None
        self._deadline = deadline
        self._done = False

    def _track(self, inbox: Inbox) -> Inbox:
        """Adopt ``inbox``; a stream collected unfinished hands it to its client to abort."""
        self._inbox = inbox
        weakref.finalize(self, self._client._abandoned.append, inbox)
        return inbox

    def _step(self, reply: ClientReply) -> TokenChunk | None:
        """The chunk ``reply`` carries; None once finished (``result`` set). Raises
        ``RequestError`` for an error reply."""
        if isinstance(reply, Chunk):
            return to_chunk(reply)
        self._done = True
        self.result = to_result(reply)
        return None

    def close(self) -> None:
        """Stop iterating; a request still running is aborted (best effort)."""
        self._done = True
        if self._inbox is not None:
            self._client._release(self._inbox, abort=True)
