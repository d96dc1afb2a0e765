"""The running daemon: owns the device and runs the engine loop, relays between the engine
and its two children over the internal pipes (``DaemonSockets``), sends heartbeats, and
stops. SIGTERM or a first SIGINT: STOPPING=1, "draining", let running requests finish until
``--drain-timeout``, abort the rest with a final frame, stop the children (detokenizer first,
so every final frame reaches the front door), exit 0. A SIGINT during the drain (a second
Ctrl-C) aborts every request at once instead, then stops the children the same way and exits
``EXIT_INTERRUPTED``. How it gets here: ``start.py``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import zmq
import zmq.asyncio

from outrider.daemon.config import ServeConfig
from outrider.daemon.engine.build import Engine
from outrider.daemon.grammar.compiler import GrammarRefused, Grammars
from outrider.daemon.grammar.queue import GrammarQueue
from outrider.daemon.internal import (
    AbortRid,
    Control,
    ErrorInfo,
    FinishInfo,
    Heartbeat,
    InfoQuery,
    InfoReply,
    Outputs,
    RequestUpdate,
    StateChange,
    ToDaemon,
    TokenizedRequest,
    control_codec,
    outputs_codec,
    to_daemon_codec,
)
from outrider.daemon.processes.children import Children
from outrider.daemon.processes.ranks import LocalRanks
from outrider.daemon.processes.sdnotify import Notifier
from outrider.daemon.processes.start_signals import StartSignals
from outrider.protocol.frames import FrameError
from outrider.protocol.messages import Usage

log = logging.getLogger("outrider.daemon")

HEARTBEAT_SECONDS = 1.0
# How often an idle daemon looks for a finished grammar compile (daemon/grammar/queue.py).
GRAMMAR_POLL_S = 0.002
# How long the final frames of a drained daemon may take to reach the children at exit.
FLUSH_LINGER_MS = 5000
# The exit status after a SIGINT during the drain (128 + SIGINT, as a shell reports it).
EXIT_INTERRUPTED = 128 + signal.SIGINT


class Daemon:
    def __init__(
        self,
        config: ServeConfig,
        engine: Engine,
        children: Children,
        notifier: Notifier,
        sockets: DaemonSockets,
        start_signals: StartSignals,
        ranks: LocalRanks | None = None,
    ) -> None:
        self.config = config
        self.start_signals = start_signals
        self.engine = engine
        self.children = children
        self.ranks = ranks
        self.notifier = notifier
        self.sockets = sockets
        self.draining = False
        self.drain_deadline = 0.0
        self.interrupted = False  # a SIGINT came during the drain: stop at once
        self._last_heartbeat = 0.0
        self._last_watchdog = 0.0
        self._watchdog_interval = notifier.watchdog_interval()
        self._unhealthy = ""
        self.grammars = GrammarQueue(_grammars(config, engine))

    async def run(self) -> int:
        """Serve until drained; the exit status (``EXIT_INTERRUPTED`` after a forced stop)."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._start_drain, "SIGTERM")
        loop.add_signal_handler(signal.SIGINT, self._on_sigint)
        stopped = self.start_signals.received
        if stopped is not None:  # a signal the start could not act on (StartSignals)
            log.info("%s while starting: stopping", stopped)
            self._start_drain(stopped)
        engine_loop = self.engine.loop
        while True:
            self.children.raise_if_exited()
            if self.ranks is not None:
                self.ranks.raise_if_exited()
            self._receive()
            self._add_compiled()
            self._tick()
            if self.draining and self._drained():
                break
            if engine_loop.has_work:
                self._send_updates(engine_loop.iterate())
                await asyncio.sleep(0)
            else:
                engine_loop.idle_check()
                # A compile in flight ends without a message: look again soon.
                wait = GRAMMAR_POLL_S if self.grammars else HEARTBEAT_SECONDS / 2
                await self.sockets.wait_inbox(wait)
        self.grammars.close()
        return EXIT_INTERRUPTED if self.interrupted else 0

    def _drained(self) -> bool:
        scheduler = self.engine.scheduler
        if not self.engine.loop.has_work and not self.grammars:
            return True
        if time.monotonic() >= self.drain_deadline:
            reason = "a second SIGINT" if self.interrupted else "drain deadline"
            for rid in [*scheduler.requests, *self.grammars.rids()]:
                self._abort(rid, reason)
            self._send_updates(scheduler.take_updates())
            return not self.engine.loop.has_work and not self.grammars
        return False

    def _on_sigint(self) -> None:
        if not self.draining:
            self._start_drain("SIGINT")
        elif not self.interrupted:
            self.interrupted = True
            self.drain_deadline = 0.0  # the next _drained() aborts everything
            log.warning(
                "SIGINT during the drain: aborting %d running and %d waiting requests, "
                "stopping now",
                *self._load(),
            )

    def _start_drain(self, cause: str) -> None:
        if self.draining:
            return
        running, waiting = self._load()
        log.info(
            "%s: draining: %d running, %d waiting, for at most %g s (--drain-timeout); "
            "a second SIGINT (Ctrl-C) stops at once",
            cause,
            running,
            waiting,
            self.config.drain_timeout,
        )
        self.draining = True
        self.drain_deadline = time.monotonic() + self.config.drain_timeout
        self.notifier.stopping()
        self.sockets.send_control(StateChange("draining"))

    def _load(self) -> tuple[int, int]:
        scheduler = self.engine.scheduler
        return len(scheduler.running), len(scheduler.waiting)

    def _receive(self) -> None:
        scheduler = self.engine.scheduler
        for msg in self.sockets.receive():
            if isinstance(msg, TokenizedRequest):
                problem = self._recheck(msg)
                if problem is not None:
                    self._send_updates([RequestUpdate(msg.rid, [], error=problem)])
                elif self.draining:
                    error = ErrorInfo("shutting_down", "the daemon is shutting down")
                    self._send_updates([RequestUpdate(msg.rid, [], error=error)])
                else:
                    self._add(msg)
            elif isinstance(msg, AbortRid):
                self._abort(msg.rid, msg.reason)
                self._send_updates(scheduler.take_updates())
            elif isinstance(msg, InfoQuery):
                self.sockets.send_control(InfoReply(msg.query_id, scheduler.counters()))

    def _add(self, msg: TokenizedRequest) -> None:
        """Queue ``msg``; one with a grammar or tools waits for its compile
        (``GrammarQueue``)."""
        if msg.grammar is None and msg.tools is None:
            self.engine.scheduler.add(msg)
        else:
            self.grammars.submit(msg)

    def _add_compiled(self) -> None:
        """Queue the requests whose grammars compiled; refuse those whose could not
        (``invalid_request``, the compiler's reason)."""
        for msg, compiled in self.grammars.ready():
            if isinstance(compiled, GrammarRefused):
                error = ErrorInfo("invalid_request", str(compiled))
                self._send_updates([RequestUpdate(msg.rid, [], error=error)])
            else:
                self.engine.scheduler.add(msg, compiled)

    def _abort(self, rid: int, reason: str) -> None:
        """End ``rid`` with ``abort``, whether it waits for its grammar or the scheduler
        has it."""
        waiting = self.grammars.cancel(rid)
        if waiting is None:
            self.engine.scheduler.abort(rid, reason)
            return
        usage = Usage(prompt_tokens=len(waiting.input_ids))
        finish = FinishInfo("abort", None, usage)
        self._send_updates([RequestUpdate(rid, [], finish=finish)])

    def _recheck(self, msg: TokenizedRequest) -> ErrorInfo | None:
        """The front door validated ``msg``; check again what device work relies on."""
        facts = self.engine.facts
        if not msg.input_ids:
            return ErrorInfo("invalid_request", "input_ids: empty prompt")
        if len(msg.input_ids) >= facts.context_length:
            return ErrorInfo(
                "prompt_too_long",
                f"input_ids: {len(msg.input_ids)} tokens, the context length is "
                f"{facts.context_length}",
            )
        if min(msg.input_ids) < 0 or max(msg.input_ids) >= facts.vocab_size:
            return ErrorInfo(
                "invalid_request", f"input_ids: ids must be in [0, {facts.vocab_size})"
            )
        return None

    def _send_updates(self, updates: list[RequestUpdate]) -> None:
        if updates:
            self.sockets.send_outputs(Outputs(updates))

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last_heartbeat >= HEARTBEAT_SECONDS:
            self._last_heartbeat = now
            self.children.check()
            self.sockets.send_control(Heartbeat(self.engine.scheduler.counters()))
        interval = self._watchdog_interval
        if interval is not None and now - self._last_watchdog >= interval and self._healthy(now):
            self._last_watchdog = now
            self.notifier.watchdog()

    def _healthy(self, now: float) -> bool:
        """The watchdog condition: no step older than --step-timeout, every child heard from
        lately. Once unhealthy, the pings stop and systemd's watchdog restarts the unit."""
        started = self.engine.loop.oldest_step_started
        problem = ""
        if started != 0.0 and now - started >= self.config.step_timeout:
            problem = f"a step has run longer than --step-timeout ({self.config.step_timeout} s)"
        elif hung := self.children.hung():
            problem = f"no heartbeat from the {' and the '.join(hung)} process"
        if problem and problem != self._unhealthy:
            log.error("%s: the watchdog pings stop", problem)
        self._unhealthy = problem
        return not problem


class DaemonSockets:
    """The daemon's ends of the internal pipes (it binds the one it reads)."""

    def __init__(self, ctx: zmq.asyncio.Context, inbox: str, outputs: str, control: str) -> None:
        self._inbox = ctx.socket(zmq.PULL)
        self._inbox.bind(inbox)
        # A synchronous view of the same socket for non-blocking draining.
        self._inbox_sync: zmq.Socket[bytes] = zmq.Socket.shadow(self._inbox.underlying)
        sync_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(ctx.underlying)
        self._outputs = sync_ctx.socket(zmq.PUSH)
        self._outputs.connect(outputs)
        self._control = sync_ctx.socket(zmq.PUSH)
        self._control.connect(control)
        for sock in (self._outputs, self._control):
            sock.setsockopt(zmq.LINGER, FLUSH_LINGER_MS)
        self._poller = zmq.asyncio.Poller()
        self._poller.register(self._inbox, zmq.POLLIN)
        self._to_daemon = to_daemon_codec()
        self._outputs_codec = outputs_codec()
        self._control_codec = control_codec()

    def receive(self) -> list[ToDaemon]:
        messages: list[ToDaemon] = []
        while True:
            try:
                frame = self._inbox_sync.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return messages
            try:
                messages.append(self._to_daemon.decode(frame))
            except FrameError as exc:
                # Only the front door writes this pipe: a bad frame is a bug there, not input.
                log.error("dropping an undecodable internal frame: %s", exc)

    def close(self) -> None:
        self._inbox.close(linger=0)
        self._outputs.close()
        self._control.close()

    def drop_unsent(self) -> None:
        """Let ``close`` drop what the pipes still hold instead of lingering to deliver it."""
        for sock in (self._outputs, self._control):
            sock.setsockopt(zmq.LINGER, 0)

    def wake_on(self, fds: list[int]) -> None:
        """Let ``wait_inbox`` also return once one of ``fds`` is readable."""
        for fd in fds:
            self._poller.register(fd, zmq.POLLIN)

    async def wait_inbox(self, timeout: float) -> None:
        await self._poller.poll(int(timeout * 1000))

    def send_outputs(self, outputs: Outputs) -> None:
        self._outputs.send(self._outputs_codec.encode(outputs))

    def send_control(self, msg: Control) -> None:
        self._control.send(self._control_codec.encode(msg))


def _grammars(config: ServeConfig, engine: Engine) -> Grammars | None:
    """The model's grammars (None without a tokenizer), compiled in a child process within
    the configured limits unless ``--grammar-compile-timeout`` is 0."""
    facts = engine.facts
    if facts.tokenizer_dir is None:
        return None
    return Grammars(
        facts.tokenizer_dir,
        facts.vocab_size,
        facts.eos_token_ids,
        mask_limit_ms=config.grammar_mask_limit_ms,
        compile_timeout=config.grammar_compile_timeout,
        compile_memory_bytes=config.grammar_compile_memory_mb << 20,
    )
