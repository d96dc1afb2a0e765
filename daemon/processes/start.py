"""The daemon's start: ``serve`` checks that the client endpoint and the ``--http`` address are
free (endpoint_checks.py) and the files (model, draft, CURVE keys), locks the client socket,
makes the runtime directory, spawns the front door and the detokenizer, loads the model and
warms up, sends the model facts, says "ready" (the front door binds the client socket only
then), READY=1, and hands over to the running daemon (``server.Daemon``). A signal before
that stops the start (``start_signals.py``); the cleanup stack undoes what was set up, last
first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import uuid

import torch
import uvloop
import zmq
import zmq.asyncio

from outrider.daemon.config import EXIT_CONFIG, ConfigError, ServeConfig
from outrider.daemon.detokenizer import DetokenizerConfig
from outrider.daemon.engine.build import build_engine
from outrider.daemon.family import embedded_family
from outrider.daemon.frontdoor.config import FrontDoorConfig
from outrider.daemon.frontdoor.curve_auth import CurveKeyError, load_client_keys, load_server_keys
from outrider.daemon.http.config import HttpFrontConfig, parse_host_port
from outrider.daemon.internal import Heartbeat, StateChange
from outrider.daemon.processes.children import ChildDied, Children, ClientBindFailed
from outrider.daemon.processes.collector import freeze_start_up
from outrider.daemon.processes.endpoint_checks import endpoint_problems
from outrider.daemon.processes.placement import (
    CHILDREN_CORES,
    available_cpus,
    ranks_per_node,
    torch_threads,
)
from outrider.daemon.processes.preflight import preflight
from outrider.daemon.processes.ranks import serve_follower_host, start_leader, stop_leader
from outrider.daemon.processes.runtime import EndpointError, RuntimeDir, lock_client_endpoint
from outrider.daemon.processes.sdnotify import Notifier, strip_notify_env
from outrider.daemon.processes.server import Daemon, DaemonSockets
from outrider.daemon.processes.start_signals import StartSignals, StopWhileStarting
from outrider.daemon.sampling_defaults import SamplingDefaults, resolve_sampling_defaults
from outrider.daemon.scheduler.loop import StepFailed
from outrider.daemon.tokenizer import TOKENIZER_FILES
from outrider.daemon.version import installed_version
from outrider.plugins.models.config import model_dir
from outrider.plugins.models.weights import LoadProgress, default_progress
from outrider.protocol.endpoints import default_endpoint

log = logging.getLogger("outrider.daemon")

VERSION = installed_version()
# While loading, ask systemd for this much more start time before each window ends.
_LOAD_EXTEND_USEC = 120_000_000


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
        except StopWhileStarting as exc:
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
    freeze_start_up()
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
    engine.loop.close()
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
