"""The front door's live requests: who owns each rid, and the client frames its updates become.

A request is live from the moment it is accepted for tokenizing until its final frame: given
by the front door when the daemon never saw it (refused after tokenizing, aborted while
tokenized, ``max_new_tokens=0``), else made from its final update (daemon -> detokenizer ->
front door), even after an abort or after its client vanished. It counts against the global
in-flight limit until then. A ``request_id`` is its client's own (another client may use the
same one at once); it stays taken until the request's final frame, or until the request is
orphaned (its client vanished, or was answered ``slow_consumer`` for it).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field

from outrider.daemon.harmony import ChannelSplit
from outrider.daemon.internal import RequestUpdate
from outrider.protocol.messages import (
    Chunk,
    ClientReply,
    Error,
    Finished,
    TokenLogprob,
    ToolCall,
)
from outrider.protocol.tool_calls import new_call_id


@dataclass(eq=False)
class LiveRequest:
    rid: int
    request_id: str
    identity: bytes | None  # None: the client is gone; its frames are dropped
    stream: bool
    want_logprobs: bool
    forwarded: bool = False  # the daemon has it (else it is being tokenized)
    aborting: bool = False  # aborted: an AbortRid went to the daemon once it was forwarded
    arrived_at: float = 0.0  # time.monotonic() when its Generate was accepted
    arrived_wall: float = 0.0  # time.time() then: against the daemon's first-token time
    last_tokens_at: float | None = None  # when its last update with tokens arrived (streamed)
    # A chat request to a model whose outputs have channels: its tokens split into answer,
    # reasoning and calls (daemon/harmony.py); None: the detokenizer's text is the answer.
    split: ChannelSplit | None = None
    output_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    reasoning_parts: list[str] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def replies(self, update: RequestUpdate) -> list[ClientReply]:
        """The client frames for one update; when it is final, the final frame comes last.

        NOTE: for a streamed request the final update's own tokens go out as a Chunk before
        ``Finished``, so the concatenated chunks equal ``Finished.output_ids`` / ``text``.
        """
        if update.error is not None:
            return [Error(self.request_id, update.error.code, update.error.message)]
        self.output_ids += update.token_ids
        text, reasoning, calls = self._parts(update)
        self.text_parts.append(text)
        self.reasoning_parts.append(reasoning)
        self.tool_calls += calls
        if update.logprobs:
            self.logprobs += update.logprobs
        frames: list[ClientReply] = []
        if self.stream and (update.token_ids or text or reasoning or calls):
            chunk_logprobs = update.logprobs if self.want_logprobs else None
            frames.append(
                Chunk(self.request_id, update.token_ids, text, chunk_logprobs, reasoning, calls)
            )
        finish = update.finish
        if finish is not None:
            frames.append(
                Finished(
                    self.request_id,
                    self.output_ids,
                    "".join(self.text_parts),
                    finish.reason,
                    finish.matched_stop,
                    finish.usage,
                    self.logprobs if self.want_logprobs else None,
                    "".join(self.reasoning_parts),
                    self.tool_calls,
                )
            )
        return frames

    def _parts(self, update: RequestUpdate) -> tuple[str, str, list[ToolCall]]:
        """The answer's text, the reasoning's and the calls ``update`` adds: the
        detokenizer's text alone, or its tokens split into channels (the rest of a cut
        message with the final update)."""
        if self.split is None:
            return update.text, "", []
        delta = self.split.feed(update.token_ids)
        if update.finish is not None:
            delta += self.split.finish()
        calls = [
            ToolCall(new_call_id(), call.name, json.dumps(call.arguments)) for call in delta.calls
        ]
        return delta.content, delta.reasoning, calls


class LiveRequests:
    """Live requests by rid, by (client, request id) and by client."""

    def __init__(self) -> None:
        self._by_rid: dict[int, LiveRequest] = {}
        self._rid_of: dict[tuple[bytes, str], int] = {}  # of requests that have a client
        self._of_client: dict[bytes, set[int]] = {}
        self._next_rid = 0

    def __len__(self) -> int:
        return len(self._by_rid)

    def new_rid(self) -> int:
        self._next_rid += 1
        return self._next_rid

    def add(self, req: LiveRequest) -> None:
        assert req.identity is not None
        key = (req.identity, req.request_id)
        assert key not in self._rid_of
        self._by_rid[req.rid] = req
        self._rid_of[key] = req.rid
        self._of_client.setdefault(req.identity, set()).add(req.rid)

    def get(self, rid: int) -> LiveRequest | None:
        return self._by_rid.get(rid)

    def by_request_id(self, identity: bytes, request_id: str) -> LiveRequest | None:
        """Client ``identity``'s live request ``request_id``."""
        rid = self._rid_of.get((identity, request_id))
        return None if rid is None else self._by_rid[rid]

    def clients(self) -> Collection[bytes]:
        """The identities of the clients with live requests."""
        return self._of_client.keys()

    def client_count(self, identity: bytes) -> int:
        return len(self._of_client.get(identity, ()))

    def pop(self, rid: int) -> LiveRequest:
        req = self._by_rid.pop(rid)
        if req.identity is not None:
            self._detach(req)
        return req

    def orphan_client(self, identity: bytes) -> list[LiveRequest]:
        """Detach every live request of a client (vanished, or answered for them); returns
        them, still live until their final updates. Their request ids are free again."""
        reqs = [self._by_rid[rid] for rid in self._of_client.pop(identity, ())]
        for req in reqs:
            del self._rid_of[identity, req.request_id]
            req.identity = None
        return reqs

    def _detach(self, req: LiveRequest) -> None:
        assert req.identity is not None
        del self._rid_of[req.identity, req.request_id]
        rids = self._of_client[req.identity]
        rids.discard(req.rid)
        if not rids:
            del self._of_client[req.identity]
