"""The front door (the "tokenizer process"): the only process that talks to clients.

```
client DEALER --> [client ROUTER] --TokenizedRequest/AbortRid/InfoQuery--> daemon (PUSH connect)
daemon --Control--> [control PULL]          detokenizer --Outputs--> [outputs PULL]
```
It owns client identities and live request ids, validates and tokenizes requests
(frontdoor_validation.py), and turns the detokenizer's updates into client frames
(frontdoor_requests.py), sent without ever blocking (frontdoor_clients.py).

- The client socket exists only once the daemon has sent ``ModelFacts`` and then
  ``StateChange("ready")``; the front door then reports ``serving`` to its parent.
- Every request gets exactly one final frame: an ``Error`` here, ``Finished`` for
  ``max_new_tokens=0``, or the one its final update becomes. Anything for a rid after its
  final update is dropped.
- A client that vanishes (its connection closes, or a send answers EHOSTUNREACH) or stops
  reading for ``slow_consumer_timeout`` has its live requests aborted in the daemon.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Literal, cast

import zmq
import zmq.asyncio

from outrider.daemon.child_runtime import (
    ChildTasks,
    ParentPipe,
    child_setup,
    internal_receiver,
    internal_sender,
    run_child,
)
from outrider.daemon.frontdoor_clients import ClientPort
from outrider.daemon.frontdoor_requests import LiveRequest, LiveRequests
from outrider.daemon.frontdoor_validation import Rejected, Validator, speculative_request_check
from outrider.daemon.internal import (
    AbortRid,
    Control,
    Counters,
    Heartbeat,
    InfoQuery,
    InfoReply,
    ModelFacts,
    RequestUpdate,
    StateChange,
    ToDaemon,
    TokenizedRequest,
    control_codec,
    outputs_codec,
    to_daemon_codec,
)
from outrider.daemon.tokenizer import load_tokenizer
from outrider.protocol.frames import FrameError, reply_codec, request_codec
from outrider.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    Ack,
    ClientReply,
    Error,
    ErrorCode,
    Finished,
    Generate,
    Health,
    HealthQuery,
    ServerInfo,
    ServerInfoQuery,
    Usage,
)

log = logging.getLogger("outrider.frontdoor")

FINISH_REASONS = ("stop", "length", "abort")
HEARTBEAT_FRESH_S = 5.0  # health() says "serving" only with a heartbeat younger than this


@dataclass(frozen=True)
class FrontDoorConfig:
    """What the daemon hands the front door at spawn. It binds the outputs and control
    pipes at once and connects to the daemon's pipe; the client endpoint is bound only after
    ``ModelFacts`` and ``StateChange("ready")`` (reported as ``ChildStatus("serving")``)."""

    client_endpoint: str  # bound (ROUTER) once the daemon is ready
    daemon_endpoint: str  # PUSH connect: ToDaemon (InternalEndpoints.to_daemon)
    outputs_endpoint: str  # PULL bind: Outputs from the detokenizer (.to_front_door)
    control_endpoint: str  # PULL bind: Control from the daemon (.control)
    boot_id: str
    version: str
    max_message_bytes: int = 64 * 2**20  # ZMQ_MAXMSGSIZE: a larger frame drops the client
    curve_server_keys: tuple[bytes, bytes] | None = None  # (public, secret), Z85
    max_inflight_per_client: int = 1024
    max_inflight: int = 4096
    slow_consumer_timeout: float = 2.0
    client_hwm: int = 1000  # frames queued per client pipe, each direction
    heartbeat_ivl_ms: int = 5000  # ZMTP heartbeats: a silent peer is dropped, then aborted
    log_level: str = "info"


def run_frontdoor(cfg: FrontDoorConfig, parent_conn: Connection) -> None:
    """Entry point of the front door process (``multiprocessing`` spawn target)."""
    child_setup("frontdoor", cfg.log_level)
    run_child(lambda ctx: FrontDoor(cfg, ParentPipe(parent_conn, "frontdoor"), ctx).run())


class FrontDoor:
    def __init__(self, cfg: FrontDoorConfig, parent: ParentPipe, ctx: zmq.asyncio.Context) -> None:
        self.cfg = cfg
        self._parent = parent
        self._ctx = ctx
        self._to_daemon = internal_sender(self._ctx, cfg.daemon_endpoint)
        self._outputs = internal_receiver(self._ctx, cfg.outputs_endpoint)
        self._control = internal_receiver(self._ctx, cfg.control_endpoint)
        self._client: ClientPort | None = None
        self._requests_codec = request_codec()
        self._replies_codec = reply_codec()
        self._to_daemon_codec = to_daemon_codec()
        self._outputs_codec = outputs_codec()
        self._control_codec = control_codec()
        self._live = LiveRequests()
        self._facts: ModelFacts | None = None
        self._validator: Validator | None = None
        self._state: Literal["loading", "ready", "draining"] = "loading"
        self._heartbeat_at = -math.inf
        self._info_queries: dict[int, tuple[bytes, str]] = {}  # query id -> (client, id)
        self._next_query = 0
        # Finals answered here without the daemon (max_new_tokens=0), by finish reason.
        self._finished_here: Counter[str] = Counter()
        self._tasks = ChildTasks(parent)

    async def run(self) -> None:
        self._tasks.spawn(self._control_loop())
        self._tasks.spawn(self._outputs_loop())
        self._parent.report("started")
        log.info("front door started; waiting for the model")
        await self._tasks.run(parent_gone=self._parent_gone, flushed=self._replies_delivered)

    def _parent_gone(self) -> None:
        # No daemon to run new requests: refuse them while the last replies go out.
        self._state = "draining"
        log.info("the daemon closed its pipe: passing on the last replies, then exiting")

    def _replies_delivered(self) -> bool:
        return self._client is None or not self._client.backlogged

    # --- daemon -> front door -----------------------------------------------------------

    async def _control_loop(self) -> None:
        while True:
            frame = await self._control.recv(copy=False)
            self._tasks.touch()
            msg: Control = self._control_codec.decode(frame.buffer)
            if isinstance(msg, Heartbeat):
                self._heartbeat_at = time.monotonic()
            elif isinstance(msg, InfoReply):
                self._on_info_reply(msg.query_id, msg.counters)
            elif isinstance(msg, StateChange):
                self._on_state(msg.state)
            else:
                self._on_facts(msg)

    def _on_facts(self, facts: ModelFacts) -> None:
        tokenizer = load_tokenizer(facts.tokenizer_dir) if facts.tokenizer_dir else None
        check = speculative_request_check(facts.speculative_algorithm)
        self._facts = facts
        self._validator = Validator(facts, tokenizer, check)
        log.info(
            "model %s: vocab_size %d, context %d, %s",
            facts.model,
            facts.vocab_size,
            facts.context_length,
            "tokenizer loaded" if tokenizer is not None else "no tokenizer: token ids only",
        )

    def _on_state(self, state: Literal["ready", "draining"]) -> None:
        if state == "ready" and self._facts is None:
            raise RuntimeError("the daemon sent StateChange(ready) before ModelFacts")
        self._state = state
        if state == "ready" and self._client is None:
            self._bind_client()
        log.info("state: %s", state)

    def _bind_client(self) -> None:
        port = ClientPort(self._ctx, self.cfg, self._on_client_message, self._client_gone)
        self._client = port
        self._tasks.spawn(port.receive_loop())
        self._tasks.spawn(port.flush_loop())
        self._parent.report("serving", port.endpoint)
        log.info("serving on %s", port.endpoint)

    # --- clients ------------------------------------------------------------------------

    def _on_client_message(self, identity: bytes, parts: list[zmq.Frame]) -> None:
        if len(parts) != 1:
            # Requests are one frame: message buffers of the wire format are for replies.
            message = f"expected one message frame after the routing id, got {len(parts)}"
            self._reply(identity, Error("", "malformed", message))
            return
        try:
            msg = self._requests_codec.decode(parts[0].buffer)
        except FrameError as exc:
            self._reply(identity, Error(exc.request_id, cast(ErrorCode, exc.code), exc.message))
            return
        if isinstance(msg, Generate):
            self._on_generate(identity, msg)
        elif isinstance(msg, Abort):
            self._on_abort(identity, msg)
        elif isinstance(msg, HealthQuery):
            self._reply(identity, self._health(msg.request_id))
        else:
            self._on_info_query(identity, msg)

    def _on_generate(self, identity: bytes, msg: Generate) -> None:
        assert self._validator is not None  # the client socket exists only after ModelFacts
        request_id = msg.request_id
        cfg = self.cfg
        try:
            if self._state == "draining":
                raise Rejected("shutting_down", "the daemon is shutting down (draining)")
            if self._live.by_request_id(request_id) is not None:
                raise Rejected(
                    "duplicate_request_id", f"request_id {request_id!r} is already in flight"
                )
            if self._live.client_count(identity) >= cfg.max_inflight_per_client:
                raise Rejected(
                    "overloaded",
                    f"this client has {cfg.max_inflight_per_client} requests in flight "
                    "(the per-client limit)",
                )
            if len(self._live) >= cfg.max_inflight:
                raise Rejected(
                    "overloaded", f"{cfg.max_inflight} requests in flight (the global limit)"
                )
            admitted = self._validator.admit(msg)
        except Rejected as exc:
            self._reply(identity, Error(request_id, exc.code, exc.message))
            return
        except Exception as exc:  # tokenizer code on client input: fail the request only
            log.exception("request %r failed validation with an internal error", request_id)
            self._reply(identity, Error(request_id, "internal", f"{type(exc).__name__}: {exc}"))
            return
        if admitted.max_new_tokens == 0:
            usage = Usage(prompt_tokens=len(admitted.input_ids))
            self._finished_here["length"] += 1
            self._reply(identity, Finished(request_id, [], "", "length", usage=usage))
            return
        req = LiveRequest(self._live.new_rid(), request_id, identity, msg.stream, msg.logprobs > 0)
        self._live.add(req)
        self._send_daemon(
            TokenizedRequest(
                rid=req.rid,
                request_id=request_id,
                input_ids=admitted.input_ids,
                sampling=admitted.sampling,
                max_new_tokens=admitted.max_new_tokens,
                stop=msg.stop,
                stop_token_ids=msg.stop_token_ids,
                ignore_eos=msg.ignore_eos,
                stream=msg.stream,
                want_logprobs=req.want_logprobs,
                arrival=time.time(),
            )
        )

    def _on_abort(self, identity: bytes, msg: Abort) -> None:
        # Only the owner may abort: another client's request is "unknown" to this one.
        req = self._live.by_request_id(msg.target_id)
        if req is None or req.identity != identity:
            message = f"target_id {msg.target_id!r} is not a request in flight"
            self._reply(identity, Error(msg.request_id, "unknown_request", message))
            return
        self._abort(req, "client abort")
        self._reply(identity, Ack(msg.request_id))

    def _health(self, request_id: str) -> Health:
        fresh = time.monotonic() - self._heartbeat_at < HEARTBEAT_FRESH_S
        status: Literal["serving", "not_serving", "draining"] = "not_serving"
        if self._state == "draining":
            status = "draining"
        elif self._state == "ready" and fresh:
            status = "serving"
        return Health(request_id, status, self.cfg.boot_id, self.cfg.version, PROTOCOL_VERSION)

    def _on_info_query(self, identity: bytes, msg: ServerInfoQuery) -> None:
        if len(self._info_queries) >= self.cfg.max_inflight:
            message = f"{self.cfg.max_inflight} server_info queries pending (the global limit)"
            self._reply(identity, Error(msg.request_id, "overloaded", message))
            return
        self._next_query += 1
        self._info_queries[self._next_query] = (identity, msg.request_id)
        self._send_daemon(InfoQuery(self._next_query))

    def _on_info_reply(self, query_id: int, c: Counters) -> None:
        asked = self._info_queries.pop(query_id, None)
        if asked is None:
            return  # its client is gone
        facts = self._facts
        assert facts is not None
        identity, request_id = asked
        info = ServerInfo(
            request_id=request_id,
            boot_id=self.cfg.boot_id,
            model=facts.model,
            configuration=facts.configuration,
            plugins=facts.plugins,
            running=c.running,
            waiting=c.waiting,
            kv_used_tokens=c.kv_used_tokens,
            kv_total_tokens=c.kv_total_tokens,
            prefix_cache_queries=c.prefix_cache_queries,
            prefix_cache_hits=c.prefix_cache_hits,
            requests_finished=self._requests_finished(c),
            spec_drafts=c.spec_drafts,
            spec_draft_tokens=c.spec_draft_tokens,
            spec_accepted_tokens=c.spec_accepted_tokens,
            spec_accepted_per_position=c.spec_accepted_per_position,
        )
        self._reply(identity, info)

    def _requests_finished(self, c: Counters) -> dict[str, int]:
        """The daemon's count plus the finals answered here.

        NOTE: the daemon counts a request when it emits its final update, before any client
        can receive that final, and a client asks only after receiving it; so whatever final
        frame the caller has received is counted, and so is a request whose client vanished.
        """
        counts = dict.fromkeys(FINISH_REASONS, 0)
        for source in (c.requests_finished, self._finished_here):
            for reason, count in source.items():
                counts[reason] = counts.get(reason, 0) + count
        return counts

    def _reply(self, identity: bytes, reply: ClientReply) -> bool:
        """Send one frame to a client; False if the client turned out to be gone."""
        assert self._client is not None
        return self._client.send(identity, self._replies_codec.encode(reply))

    def _client_gone(self, identity: bytes, reason: str) -> None:
        """A client vanished: abort its live requests, forget its pending queries."""
        reqs = self._live.orphan_client(identity)
        for req in reqs:
            self._abort(req, reason)
        for query_id, (asker, _) in list(self._info_queries.items()):
            if asker == identity:
                del self._info_queries[query_id]
        if reqs:
            log.info("%s: aborted %d requests of client %s", reason, len(reqs), identity.hex())

    def _abort(self, req: LiveRequest, reason: str) -> None:
        if not req.aborting:
            req.aborting = True
            self._send_daemon(AbortRid(req.rid, reason))

    def _send_daemon(self, msg: ToDaemon) -> None:
        # An internal pipe is unbounded: the send completes at once, in call order (an abort
        # never overtakes its request).
        self._to_daemon.send(self._to_daemon_codec.encode(msg), zmq.DONTWAIT)

    # --- detokenizer -> front door ------------------------------------------------------

    async def _outputs_loop(self) -> None:
        while True:
            frame = await self._outputs.recv(copy=False)
            self._tasks.touch()
            for update in self._outputs_codec.decode(frame.buffer).updates:
                self._on_update(update)

    def _on_update(self, update: RequestUpdate) -> None:
        req = self._live.get(update.rid)
        if req is None:
            return  # after its final update: dropped
        if update.is_final:
            self._live.pop(update.rid)
        if req.identity is None:
            return
        for reply in req.replies(update):
            if not self._reply(req.identity, reply):
                break
