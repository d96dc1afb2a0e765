"""The daemon process: owns the device, runs the engine loop, supervises the two children and
is the only process that talks to systemd.

Start-up order: check that the client endpoint and the ``--http`` address are free
(endpoint_checks.py) and the files (model, draft, CURVE keys), lock the client socket, make
the runtime directory, spawn the front door and the detokenizer, load the model and warm up,
send the model facts, say "ready" (the front door binds the client socket only then),
READY=1. SIGTERM or a first SIGINT: STOPPING=1, "draining", let running requests finish until
``--drain-timeout``, abort the rest with a final frame, stop the children (detokenizer first,
so every final frame reaches the front door), exit 0. A SIGINT during the drain (a second
Ctrl-C) aborts every request at once instead, then stops the children the same way and exits
``EXIT_INTERRUPTED``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
import uuid

import torch
import uvloop
import zmq
import zmq.asyncio

from outrider.daemon.config import EXIT_CONFIG, ConfigError, ServeConfig
from outrider.daemon.detokenizer import DetokenizerConfig
from outrider.daemon.engine.build import Engine, build_engine
from outrider.daemon.family import embedded_family
from outrider.daemon.frontdoor.config import FrontDoorConfig
from outrider.daemon.frontdoor.curve_auth import CurveKeyError, load_client_keys, load_server_keys
from outrider.daemon.http.config import HttpFrontConfig, parse_host_port
from outrider.daemon.internal import (
    AbortRid,
    Control,
    ErrorInfo,
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
from outrider.daemon.processes.children import ChildDied, Children, ClientBindFailed
from outrider.daemon.processes.endpoint_checks import endpoint_problems
from outrider.daemon.processes.placement import (
    CHILDREN_CORES,
    available_cpus,
    ranks_per_node,
    torch_threads,
)
from outrider.daemon.processes.preflight import preflight
from outrider.daemon.processes.ranks import (
    LocalRanks,
    serve_follower_host,
    start_leader,
    stop_leader,
)
from outrider.daemon.processes.runtime import (
    EndpointError,
    RuntimeDir,
    lock_client_endpoint,
)
from outrider.daemon.processes.sdnotify import Notifier, strip_notify_env
from outrider.daemon.sampling_defaults import SamplingDefaults, resolve_sampling_defaults
from outrider.daemon.scheduler.loop import StepFailed
from outrider.daemon.tokenizer import TOKENIZER_FILES
from outrider.daemon.version import installed_version
from outrider.plugins.models.config import model_dir
from outrider.plugins.models.weights import LoadProgress, default_progress
from outrider.protocol.endpoints import default_endpoint
from outrider.protocol.frames import FrameError

log = logging.getLogger("outrider.daemon")

VERSION = installed_version()
HEARTBEAT_SECONDS = 1.0
# How long the final frames of a drained daemon may take to reach the children at exit.
FLUSH_LINGER_MS = 5000
# While loading, ask systemd for this much more start time before each window ends.
_LOAD_EXTEND_USEC = 120_000_000
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
            self._tick()
            if self.draining and self._drained():
                break
            if engine_loop.has_work:
                self._send_updates(engine_loop.iterate())
                await asyncio.sleep(0)
            else:
                engine_loop.idle_check()
                await self.sockets.wait_inbox(HEARTBEAT_SECONDS / 2)
        return EXIT_INTERRUPTED if self.interrupted else 0

    def _drained(self) -> bool:
        scheduler = self.engine.scheduler
        if not self.engine.loop.has_work:
            return True
        if time.monotonic() >= self.drain_deadline:
            reason = "a second SIGINT" if self.interrupted else "drain deadline"
            for rid in list(scheduler.requests):
                scheduler.abort(rid, reason)
            self._send_updates(scheduler.take_updates())
            return not self.engine.loop.has_work
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
                    scheduler.add(msg)
            elif isinstance(msg, AbortRid):
                scheduler.abort(msg.rid, msg.reason)
                self._send_updates(scheduler.take_updates())
            elif isinstance(msg, InfoQuery):
                self.sockets.send_control(InfoReply(msg.query_id, scheduler.counters()))

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


def _load_progress(notifier: Notifier) -> LoadProgress:
    shown = default_progress()

    def progress(index: int, count: int, name: str) -> None:
        shown(index, count, name)
        notifier.status(f"loading weights: shard {index}/{count}")
        notifier.extend_timeout(_LOAD_EXTEND_USEC)

    return progress


def _tokenizer_dir(model: str) -> str | None:
    path = model_dir(model)
    return str(path) if any((path / name).is_file() for name in TOKENIZER_FILES) else None


class _StopWhileStarting(Exception):
    """SIGTERM or SIGINT arrived before the event loop took the signals over."""


class StartSignals:
    """SIGTERM and SIGINT before the event loop takes them over: the handler raises
    ``_StopWhileStarting`` to cut the start short. Where Python cannot propagate an exception
    (the handler ran inside a weakref callback or a finaliser, e.g. importlib's module-lock
    cleanup while the model's code is imported) it reports it as unraisable instead and the
    start goes on: the signal is remembered (``received``), that report silenced, and the
    event loop stops as soon as it has taken the signals over (``Daemon.run``)."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._hook = sys.unraisablehook

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._raise)
        sys.unraisablehook = self._unraisable

    def ignore(self) -> None:
        """Stopping takes a moment (children flush): a second signal must not cut it short."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        sys.unraisablehook = self._hook

    def _raise(self, signum: int, _frame: object) -> None:
        self.received = signal.Signals(signum).name
        raise _StopWhileStarting(self.received)

    def _unraisable(self, unraisable: sys.UnraisableHookArgs) -> None:
        if unraisable.exc_type is not _StopWhileStarting:
            self._hook(unraisable)


def serve(config: ServeConfig) -> int:
    """Run the daemon until SIGTERM and return the exit code (on ``--node-rank`` > 0: this
    host's tensor-parallel ranks until rank 0 stops them, then the process exits)."""
    notifier = Notifier()
    strip_notify_env(os.environ)  # children must not talk to systemd
    if config.node_rank > 0:
        problems = preflight(config)
        if problems:
            raise ConfigError("; ".join(problems))
        _set_torch_threads(config)
        serve_follower_host(config)
    endpoint = config.listen or default_endpoint()
    problems = endpoint_problems(config) + preflight(config)
    if problems:
        raise ConfigError("; ".join(problems))
    defaults = resolve_sampling_defaults(config)
    log.log(
        logging.WARNING if defaults.ignored else logging.INFO,
        "sampling defaults: %s",
        defaults.describe(),
    )
    _set_torch_threads(config)
    # NOTE: callbacks run last-registered first: sockets flush to the still running
    # children, then the children stop, then the runtime directory and the lock go.
    with contextlib.ExitStack() as cleanup:
        lock = lock_client_endpoint(endpoint)
        if lock is not None:
            cleanup.callback(lock.release)
        runtime = RuntimeDir()
        cleanup.callback(runtime.cleanup)
        start_signals = StartSignals()
        start_signals.install()
        try:
            return _serve(config, defaults, notifier, endpoint, runtime, cleanup, start_signals)
        except _StopWhileStarting as exc:
            log.info("%s while starting: stopping", exc)
            notifier.stopping()
            return 0
        except StepFailed:
            log.exception("fatal device error")
            notifier.watchdog_trigger()
            return 1
        except ChildDied as exc:
            log.error("%s; exiting so that the service is restarted", exc)
            return 1
        finally:
            start_signals.ignore()


def _serve(
    config: ServeConfig,
    defaults: SamplingDefaults,
    notifier: Notifier,
    endpoint: str,
    runtime: RuntimeDir,
    cleanup: contextlib.ExitStack,
    start_signals: StartSignals,
) -> int:
    pipes = runtime.internal_endpoints()
    boot_id = uuid.uuid4().hex
    notifier.status("starting")
    notifier.extend_timeout(_LOAD_EXTEND_USEC)
    secret_file, clients_dir = config.curve_secret_key_file, config.curve_client_keys
    children = Children.spawn(
        FrontDoorConfig(
            client_endpoint=endpoint,
            daemon_endpoint=pipes.to_daemon,
            outputs_endpoint=pipes.to_front_door,
            control_endpoint=pipes.control,
            boot_id=boot_id,
            version=VERSION,
            max_message_bytes=config.max_message_bytes,
            curve_server_keys=load_server_keys(secret_file) if secret_file else None,
            curve_client_keys=load_client_keys(clients_dir) if clients_dir else (),
            socket_mode=config.socket_mode,
            max_inflight_per_client=config.max_inflight_per_client,
            max_inflight=config.max_inflight,
            log_level=config.log_level,
            sampling_defaults=defaults,
        ),
        DetokenizerConfig(
            inputs_endpoint=pipes.to_detokenizer,
            frontdoor_endpoint=pipes.to_front_door,
            tokenizer_dir=_tokenizer_dir(config.model),
            log_level=config.log_level,
        ),
        _http_front_config(config, endpoint),
    )
    cleanup.callback(children.stop)
    ranks, tp = start_leader(config)
    if ranks is not None:
        # NOTE: registered after the children's: on a failure the ranks go first (killed),
        # then the children pass on their last frames.
        cleanup.callback(ranks.stop)
    ctx = zmq.asyncio.Context()
    cleanup.callback(ctx.term)
    sockets = DaemonSockets(ctx, pipes.to_daemon, pipes.to_detokenizer, pipes.control)
    cleanup.callback(sockets.close)
    notifier.status("loading the model")
    engine = build_engine(config, progress=_load_progress(notifier), tp=tp)
    sockets.send_control(engine.facts)
    # health() says "serving" only with a fresh heartbeat: one goes out before "ready".
    sockets.send_control(Heartbeat(engine.scheduler.counters()))
    sockets.send_control(StateChange("ready"))
    sockets.wake_on(children.sentinels + (ranks.sentinels if ranks is not None else []))
    try:
        bound = children.wait_status("frontdoor", "serving", timeout=60.0).endpoint
        if config.http:
            try:
                http_bound = children.wait_status("http", "serving", timeout=60.0).endpoint
            except ClientBindFailed as exc:
                raise EndpointError(f"--http: cannot listen on {config.http}: {exc}") from None
            log.info("OpenAI-compatible HTTP API on %s", http_bound)
        notifier.ready(f"serving {config.model} on {bound}")
        log.info("serving %s on %s (boot %s)", config.model, bound, boot_id)
        daemon = Daemon(config, engine, children, notifier, sockets, start_signals, ranks)
        code = uvloop.run(daemon.run())
    except ClientBindFailed as exc:
        raise EndpointError(f"cannot listen on {endpoint}: {exc}") from None
    except ChildDied:
        # NOTE: a dead child never reads its pipe: lingering there would hold the exit, and
        # the clients' connection_lost (the front door stops after), for the whole linger.
        sockets.drop_unsent()
        raise
    stop_leader(engine, ranks)
    return code


def _set_torch_threads(config: ServeConfig) -> None:
    threads = torch_threads(config)
    torch.set_num_threads(threads)
    if config.threads:
        how = "--threads"
    else:
        how = f"automatic: {available_cpus()} CPUs, {CHILDREN_CORES} left to the other processes"
        if (local := ranks_per_node(config)) > 1:
            how += f", the rest shared by this host's {local} ranks"
    log.info("torch threads: %d (%s)", threads, how)


def served_model_name(config: ServeConfig) -> str:
    """``--served-model-name``, else the embedded family's name, else the directory's."""
    if config.served_model_name:
        return config.served_model_name
    family = embedded_family()
    if family is not None and model_dir(config.model) == family.target:
        return "outrider-family"
    return model_dir(config.model).name


def _http_front_config(config: ServeConfig, endpoint: str) -> HttpFrontConfig | None:
    if not config.http:
        return None
    host, port = parse_host_port(config.http)
    return HttpFrontConfig(
        host=host,
        port=port,
        client_endpoint=endpoint,
        served_model_name=served_model_name(config),
        version=VERSION,
        model_dir=_tokenizer_dir(config.model),
        max_message_bytes=config.max_message_bytes,
        max_body_bytes=config.http_body_bytes,
        max_tokenize_tokens=config.http_max_tokenize_tokens,
        read_timeout_s=config.http_read_timeout,
        send_timeout_s=config.http_send_timeout,
        max_connections=config.http_max_connections,
        api_key=config.api_key,
        allow_origins=config.http_origins,
        log_level=config.log_level,
    )


def main(config: ServeConfig) -> int:
    try:
        return serve(config)
    except (ConfigError, EndpointError, CurveKeyError) as exc:
        print(f"outrider serve: {exc}", file=sys.stderr)
        return EXIT_CONFIG
