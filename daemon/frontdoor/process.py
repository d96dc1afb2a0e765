"""The front door (the "tokenizer process"): the only process that talks to clients.

```
client DEALER --> [client ROUTER] --TokenizedRequest/AbortRid/InfoQuery--> daemon (PUSH connect)
daemon --Control--> [control PULL]          detokenizer --Outputs--> [outputs PULL]
```
It owns client identities and live request ids, validates and tokenizes requests
(frontdoor/validation.py), and turns the detokenizer's updates into client frames
(frontdoor/requests.py), sent without ever blocking (frontdoor/clients.py).

- The client socket exists only once the daemon has sent ``ModelFacts`` and then
  ``StateChange("ready")``; the front door then reports ``serving`` to its parent.
- Every request gets exactly one final frame: an ``Error`` here, ``Finished`` for
  ``max_new_tokens=0`` or for one aborted while its prompt was tokenized, or the one its
  final update becomes. Anything for a rid after its
  final update is dropped.
- Whatever a client does, each of its requests gets its final frame, or the client is gone:
  one that vanishes (a send to it, a reply or a probe, answers EHOSTUNREACH) has its live
  requests aborted in the daemon; one that does not keep up for ``slow_consumer_timeout``
  has them aborted too, each answered ``Error("slow_consumer")``, queued behind the finals
  it has not read yet (frontdoor/clients.py: and cut off if it still floods).
- Request ids are a client's own: two clients may use the same one at once.
- ``health`` says ``serving`` only while both the daemon's heartbeat and the detokenizer's
  beat (an empty ``Outputs`` batch) are fresh: requests need both to finish.
- No client input can stop the front door: a message whose handling raises is answered
  ``internal`` and logged, and the front door goes on.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Literal, cast

import zmq
import zmq.asyncio

from outrider.daemon.frontdoor.clients import ClientPort
from outrider.daemon.frontdoor.config import FrontDoorConfig
from outrider.daemon.frontdoor.info import server_info
from outrider.daemon.frontdoor.metrics import FrontDoorMetrics
from outrider.daemon.frontdoor.requests import LiveRequest, LiveRequests
from outrider.daemon.frontdoor.validation import (
    Checked,
    PromptTokenizer,
    Rejected,
    Validator,
    speculative_request_check,
)
from outrider.daemon.harmony import ChannelSplit, harmony_encoding
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
from outrider.daemon.processes.child_runtime import (
    EXIT_LINGER_MS,
    ChildTasks,
    ParentPipe,
    child_setup,
    internal_receiver,
    internal_sender,
    run_child,
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
    ServerInfoQuery,
    Usage,
    is_final,
)

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding

log = logging.getLogger("outrider.frontdoor")

HEARTBEAT_FRESH_S = 5.0  # health() says "serving" only with heartbeats younger than this
# Sent to clients with requests in flight to learn whether they are still connected; no
# request has an empty id, so every client drops it.
PROBE = Ack("")


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
        self._prompts: PromptTokenizer | None = None
        # The harmony encoding where chat outputs are split into channels (daemon/harmony.py).
        self._harmony: HarmonyEncoding | None = None
        self._state: Literal["loading", "ready", "draining"] = "loading"
        self._heartbeat_at = -math.inf  # the daemon's last Heartbeat
        self._detokenizer_at = -math.inf  # the detokenizer's last frame
        self._info_queries: dict[int, tuple[bytes, str]] = {}  # query id -> (client, id)
        self._next_query = 0
        # Finals given here without the daemon (max_new_tokens=0, aborted while tokenized).
        self._finished_here: Counter[str] = Counter()
        self._metrics = FrontDoorMetrics()
        self._tasks = ChildTasks(parent)

    async def run(self) -> None:
        self._tasks.spawn(self._control_loop())
        self._tasks.spawn(self._outputs_loop())
        self._parent.report("started")
        log.info("front door started; waiting for the model")
        try:
            await self._tasks.run(parent_gone=self._parent_gone, flushed=self._replies_delivered)
        finally:
            if self._client is not None:
                self._client.close(EXIT_LINGER_MS)

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
        self._validator = Validator(facts, tokenizer, check, self.cfg.sampling_defaults)
        # The worker thread's own instance: one tokenizer must not serve two threads.
        worker = load_tokenizer(facts.tokenizer_dir) if facts.tokenizer_dir else None
        self._prompts = PromptTokenizer(tokenizer, worker)
        if self._validator.channels and tokenizer is not None:
            # One encoding for both threads: its methods run holding the GIL.
            self._harmony = tokenizer.harmony = harmony_encoding(tokenizer)
            if worker is not None:
                worker.harmony = self._harmony
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
        try:
            port = ClientPort(
                self._ctx, self.cfg, self._on_client_message, self._client_slow, self._client_gone
            )
        except zmq.ZMQError as exc:
            # The daemon checked the endpoint before loading; another process took it since.
            reason = zmq.strerror(exc.errno) if exc.errno is not None else str(exc)
            log.error("cannot bind %s: %s", self.cfg.client_endpoint, reason)
            self._parent.report("bind_failed", error=reason)
            return
        self._client = port
        self._tasks.spawn(port.receive_loop())
        self._tasks.spawn(port.flush_loop())
        self._tasks.spawn(port.probe_loop(self._watched, self._replies_codec.encode(PROBE)))
        self._parent.report("serving", port.endpoint)
        log.info("serving on %s", port.endpoint)

    # --- clients ------------------------------------------------------------------------

    def _on_client_message(self, identity: bytes, parts: list[zmq.Frame]) -> None:
        try:
            self._handle(identity, parts)
        except Exception as exc:
            # NOTE: a bug met by one message must cost that message, not every client.
            log.exception("a message from client %s failed", identity.hex())
            self._reply(identity, Error("", "internal", f"{type(exc).__name__}: {exc}"))

    def _handle(self, identity: bytes, parts: list[zmq.Frame]) -> None:
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
        # The client socket exists only after ModelFacts.
        assert self._validator is not None and self._prompts is not None
        try:
            self._check_room(identity, msg.request_id)
            checked = self._validator.check(msg)
            self._prompts.check_room(checked.prompt)
        except Rejected as exc:
            self._reply(identity, Error(msg.request_id, exc.code, exc.message))
            return
        req = LiveRequest(
            self._live.new_rid(),
            msg.request_id,
            identity,
            msg.stream,
            msg.logprobs > 0,
            arrived_at=time.monotonic(),
            arrived_wall=time.time(),
            split=(
                ChannelSplit(self._harmony)
                if self._harmony is not None and msg.messages is not None
                else None
            ),
        )
        self._live.add(req)  # from here its request_id is taken, also while it is tokenized
        self._prompts.tokenize(msg, checked.prompt, lambda ids: self._admit(req, msg, checked, ids))

    def _watched(self) -> set[bytes]:
        """The clients with calls in flight: live requests or pending ``server_info``."""
        return set(self._live.clients()).union(asker for asker, _ in self._info_queries.values())

    def _check_room(self, identity: bytes, request_id: str) -> None:
        cfg = self.cfg
        if self._state == "draining":
            raise Rejected("shutting_down", "the daemon is shutting down (draining)")
        if self._live.by_request_id(identity, request_id) is not None:
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
            message = f"{cfg.max_inflight} requests in flight (the global limit)"
            raise Rejected("overloaded", message)

    def _admit(
        self,
        req: LiveRequest,
        msg: Generate,
        checked: Checked,
        input_ids: asyncio.Future[list[int]],
    ) -> None:
        """Forward ``req`` once its prompt is tokenized, or end it here with its final frame."""
        assert self._validator is not None
        if req.aborting:  # aborted, or its client vanished, while it was tokenized
            self._end_here(req, Finished(req.request_id, [], "", "abort"))
            return
        try:
            admitted = self._validator.admit(msg, checked, input_ids.result())
        except Rejected as exc:
            self._end_here(req, Error(req.request_id, exc.code, exc.message))
            return
        except Exception as exc:  # tokenizer code on client input: fail the request only
            log.exception("request %r failed validation with an internal error", req.request_id)
            message = f"{type(exc).__name__}: {exc}"
            self._end_here(req, Error(req.request_id, "internal", message))
            return
        if admitted.max_new_tokens == 0:
            usage = Usage(prompt_tokens=len(admitted.input_ids))
            self._end_here(req, Finished(req.request_id, [], "", "length", usage=usage))
            return
        req.forwarded = True
        self._send_daemon(
            TokenizedRequest(
                rid=req.rid,
                request_id=req.request_id,
                input_ids=admitted.input_ids,
                sampling=admitted.sampling,
                max_new_tokens=admitted.max_new_tokens,
                stop=msg.stop,
                stop_token_ids=msg.stop_token_ids,
                ignore_eos=msg.ignore_eos,
                stream=msg.stream,
                want_logprobs=req.want_logprobs,
                arrival=time.time(),
                grammar=msg.grammar,
                tools=admitted.tools,
                max_drafts=msg.max_drafts,
                harmony=req.split is not None,
            )
        )

    def _end_here(self, req: LiveRequest, final: Error | Finished) -> None:
        """End ``req``, which the daemon never saw, with ``final``."""
        self._live.pop(req.rid)
        if isinstance(final, Finished):
            self._finished_here[final.finish_reason] += 1
            self._metrics.on_finished_here(req, final, time.monotonic())
        if req.identity is not None:
            self._reply(req.identity, final)

    def _on_abort(self, identity: bytes, msg: Abort) -> None:
        # Only the owner may abort: another client's request is "unknown" to this one.
        req = self._live.by_request_id(identity, msg.target_id)
        if req is None:
            message = f"target_id {msg.target_id!r} is not a request in flight"
            self._reply(identity, Error(msg.request_id, "unknown_request", message))
            return
        self._abort(req, "client abort")
        self._reply(identity, Ack(msg.request_id))

    def _health(self, request_id: str) -> Health:
        now = time.monotonic()
        fresh = now - min(self._heartbeat_at, self._detokenizer_at) < HEARTBEAT_FRESH_S
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
        assert self._facts is not None and self._validator is not None
        identity, request_id = asked
        info = server_info(
            request_id,
            self.cfg.boot_id,
            self._facts,
            c,
            self._finished_here,
            self._validator.defaults,
            self._metrics,
        )
        self._reply(identity, info)

    def _reply(self, identity: bytes, reply: ClientReply) -> bool:
        """Send one frame to a client; False if the client turned out to be gone."""
        assert self._client is not None
        return self._client.send(identity, self._replies_codec.encode(reply), is_final(reply))

    def _client_slow(self, identity: bytes, why: str) -> None:
        """A client did not keep up: each of its live requests is aborted and answered
        ``slow_consumer`` (its pending ``server_info`` answers still come)."""
        reqs = self._live.orphan_client(identity)
        message = f"this client read its replies too slowly ({why}): the request was aborted"
        for req in reqs:
            self._abort(req, "slow consumer")
        for req in reqs:
            if not self._reply(identity, Error(req.request_id, "slow_consumer", message)):
                break
        if reqs:
            log.info("slow consumer: aborted %d requests of client %s", len(reqs), identity.hex())

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
        if req.aborting:
            return
        req.aborting = True
        if req.forwarded:
            self._send_daemon(AbortRid(req.rid, reason))
        # else it is being tokenized, and _admit ends it once that is done

    def _send_daemon(self, msg: ToDaemon) -> None:
        # An internal pipe is unbounded: the send completes at once, in call order (an abort
        # never overtakes its request).
        self._to_daemon.send(self._to_daemon_codec.encode(msg), zmq.DONTWAIT)

    # --- detokenizer -> front door ------------------------------------------------------

    async def _outputs_loop(self) -> None:
        while True:
            frame = await self._outputs.recv(copy=False)
            self._tasks.touch()
            now = self._detokenizer_at = time.monotonic()
            for update in self._outputs_codec.decode(frame.buffer).updates:
                self._on_update(update, now)

    def _on_update(self, update: RequestUpdate, now: float) -> None:
        req = self._live.get(update.rid)
        if req is None:
            return  # after its final update: dropped
        self._metrics.on_update(req, update, now)
        if update.is_final:
            self._live.pop(update.rid)
        if req.identity is None:
            return
        for reply in req.replies(update):
            if not self._reply(req.identity, reply):
                break
