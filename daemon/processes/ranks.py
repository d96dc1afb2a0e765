"""The tensor-parallel ranks as processes: placed, started, watched, stopped.

``--tensor-parallel-size N`` over ``--nnodes M``: each host runs ``N / M`` ranks, rank
``node_rank * N / M + local``. The process ``outrider serve`` starts is its host's local rank
0; the others are spawned here, one process each (on CUDA local rank ``l`` takes visible
device ``l``). On node 0 local rank 0 is rank 0: it owns the scheduler, the sockets and
systemd notification (processes/start.py, server.py). Every other rank builds a follower and
runs rank 0's plans (engine/ranks.py) until rank 0 stops them::

    node 0: outrider serve (rank 0: daemon)      node k: outrider serve --node-rank k
              ├── rank 1 (follower)                        (rank k*L: follower)
              └── ...                                        ├── rank k*L + 1
                                                             └── ...

Supervision. A rank process sees EOF on its pipe when its parent closes it or dies, and then
exits at once (whatever collective it waits in): no rank outlives its parent. The parent
watches its ranks' sentinels: its loop raises ``RankDied`` between steps (the orderly exit of
processes/server.py, status 1), and a watch thread covers what the loop cannot see: a rank that
dies while the others wait in a collective that will never finish (NCCL waits for good; gloo
fails the step, which also ends the process). If the main thread has not taken the death over
within ``DEATH_GRACE_S``, the thread kills the other ranks and exits the process with status 1,
so that the front door's clients get their final frames (``connection_lost``) and systemd
restarts the unit. Rank 0 learns of another host's death only from its collectives (gloo
raises; NCCL hangs until the systemd watchdog, which the stuck loop stops pinging).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import select
import signal
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, NoReturn

import torch

from outrider.daemon.config import ConfigError, ServeConfig
from outrider.daemon.processes.children import ChildDied
from outrider.daemon.processes.collector import freeze_start_up
from outrider.daemon.processes.logs import configure_logging
from outrider.daemon.processes.placement import ranks_per_node, torch_threads
from outrider.plugins.models.parallel import SINGLE, TPGroup, init_tensor_parallel

if TYPE_CHECKING:
    from outrider.daemon.engine.build import Engine

log = logging.getLogger("outrider.daemon")

DEATH_GRACE_S = 5.0
# A rank killed from outside may take this long to exit (a CUDA context's teardown).
DYING_S = 2.0
# A rank whose plans ended (rank 0 stopped them) exits within this.
STOP_TIMEOUT_S = 30.0


class RankDied(ChildDied):
    pass


@dataclass(frozen=True)
class Placement:
    """Where this host's ranks sit in the world, and how they meet."""

    world: int
    per_node: int
    node_rank: int
    init_method: str  # tcp://HOST:PORT, rank 0's rendezvous
    backend: str  # "nccl" on CUDA, "gloo" on CPU
    device: str
    peer_all_reduce: bool  # small all-reduces over peer memory (one host's GPUs)

    def rank(self, local: int) -> int:
        return self.node_rank * self.per_node + local

    def join(self, local: int) -> TPGroup:
        """Join the world as this host's rank ``local`` (blocks until every rank joined)."""
        if self.device == "cuda":
            torch.cuda.set_device(local)
        peers = range(self.per_node) if self.peer_all_reduce else None
        return init_tensor_parallel(
            self.rank(local), self.world, self.init_method, self.backend, peers
        )


def placement(config: ServeConfig) -> Placement:
    """This host's ranks from the flags; a single host's rendezvous takes a free loopback
    port. Raises ConfigError when the host has fewer GPUs than ranks."""
    per_node = ranks_per_node(config)
    if config.device == "cuda" and torch.cuda.device_count() < per_node:
        raise ConfigError(
            f"--tensor-parallel-size {config.tensor_parallel_size} over --nnodes "
            f"{config.nnodes} needs {per_node} GPUs on this host, "
            f"{torch.cuda.device_count()} visible"
        )
    address = config.dist_init_addr or f"127.0.0.1:{_free_loopback_port()}"
    return Placement(
        world=config.tensor_parallel_size,
        per_node=per_node,
        node_rank=config.node_rank,
        init_method=f"tcp://{address}",
        backend="nccl" if config.device == "cuda" else "gloo",
        device=config.device,
        peer_all_reduce=(
            config.device == "cuda" and config.nnodes == 1 and not config.disable_peer_all_reduce
        ),
    )


def _free_loopback_port() -> int:
    # NOTE: free now; rank 0 binds it a moment later (another process could take it first:
    # the start then fails with "address in use" and systemd retries).
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass(frozen=True)
class RankSpec:
    """What a spawned rank process is started with."""

    config: ServeConfig
    placement: Placement
    local: int


def run_rank(spec: RankSpec, parent_conn: Connection) -> None:
    """A spawned rank's entry point: join the world, build the follower over this rank's
    shard, run rank 0's plans until it stops them."""
    from outrider.daemon.engine.build import build_follower

    rank = spec.placement.rank(spec.local)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops its ranks
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fmt = f"%(asctime)s rank{rank}[%(process)d] %(levelname)s %(name)s: %(message)s"
    configure_logging(spec.config.log_level, fmt)
    _exit_when_parent_goes(parent_conn)
    torch.set_num_threads(torch_threads(spec.config))
    tp = spec.placement.join(spec.local)
    follower = build_follower(spec.config, tp)
    freeze_start_up()
    steps = follower.run()
    log.info("rank %d stopped after %d steps", rank, steps)
    logging.shutdown()
    os._exit(0)  # no teardown of the group (stop_leader)


def _exit_when_parent_goes(conn: Connection) -> None:
    """A thread that ends the process once ``conn`` reads EOF (the parent closed it or
    died): a rank waiting in a collective with a dead peer never returns by itself."""

    def watch() -> None:
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN | select.POLLHUP)
        poller.poll()
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class LocalRanks:
    """This host's ranks other than the calling process (its local rank 0), spawned and
    watched. ``stop`` after rank 0 stopped the plans (``Engine.stop_ranks``) lets them exit;
    at any other time it kills them."""

    def __init__(self, config: ServeConfig, where: Placement) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.placement = where
        self.procs: dict[int, BaseProcess] = {}
        self._pipes: list[Connection] = []
        for local in range(1, where.per_node):
            child_end, parent_end = ctx.Pipe(duplex=True)
            rank = where.rank(local)
            proc = ctx.Process(
                target=run_rank,
                args=(RankSpec(config, where, local), child_end),
                name=f"outrider-rank{rank}",
            )
            proc.start()
            child_end.close()
            self.procs[rank] = proc
            self._pipes.append(parent_end)
        self._released = False  # rank 0 ended the plans: exits are expected
        # The main thread took over (a death seen by its loop, or stopping the ranks).
        self._taken_over = threading.Event()
        self._reported: set[int] = set()  # ranks whose death is logged
        self._report_lock = threading.Lock()
        if self.procs:
            threading.Thread(target=self._watch_deaths, name="rank-watch", daemon=True).start()

    @property
    def sentinels(self) -> list[int]:
        """File descriptors that become readable when a rank exits."""
        return [proc.sentinel for proc in self.procs.values()]

    def raise_if_exited(self) -> None:
        """Raise RankDied if a rank exited (cheap: for every turn of the daemon's loop)."""
        for rank, proc in self.procs.items():
            if proc.exitcode is not None:
                self._taken_over.set()
                with self._report_lock:
                    self._reported.add(rank)  # the exception is the report
                raise RankDied(f"tensor-parallel rank {rank} exited with code {proc.exitcode}")

    def release(self) -> None:
        """Rank 0 sent the stop: the ranks now exit by themselves."""
        self._released = True

    def stop(self) -> None:
        """Wait for released ranks to exit (``STOP_TIMEOUT_S``; otherwise ``DYING_S`` for
        those already on their way out, whose deaths are then logged), kill the rest, close
        the pipes."""
        self._taken_over.set()
        deadline = time.monotonic() + (STOP_TIMEOUT_S if self._released else DYING_S)
        for proc in self.procs.values():
            proc.join(max(deadline - time.monotonic(), 0.0))
        if not self._released:
            self._report_deaths()
        for rank, proc in self.procs.items():
            if proc.is_alive():
                if self._released:
                    log.warning("tensor-parallel rank %d did not exit; killing it", rank)
                proc.kill()
            proc.join()
        for pipe in self._pipes:
            pipe.close()
        self._pipes.clear()

    def _report_deaths(self) -> list[int]:
        """Log each rank that has exited, once; returns the ranks that have."""
        with self._report_lock:
            dead = [rank for rank, proc in self.procs.items() if not proc.is_alive()]
            for rank in sorted(set(dead) - self._reported):
                code = self.procs[rank].exitcode
                log.error("tensor-parallel rank %d exited with code %s", rank, code)
            self._reported.update(dead)
            return dead

    def _watch_deaths(self) -> None:
        wait(self.sentinels)
        if self._taken_over.is_set() or self._released:
            return
        dead = self._report_deaths()
        if not dead or self._taken_over.wait(DEATH_GRACE_S):
            return
        log.error(
            "the other ranks cannot finish their collectives without rank %d: exiting now",
            min(dead),
        )
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
        logging.shutdown()
        os._exit(1)


def start_leader(config: ServeConfig) -> tuple[LocalRanks | None, TPGroup]:
    """Rank 0's side, on node 0: this host's other ranks spawned, and the group once every
    rank joined (None and a world of one without tensor parallelism). The caller builds the
    engine with the group and ends with ``stop_leader``."""
    if config.tensor_parallel_size == 1:
        return None, SINGLE
    where = placement(config)
    log.info("tensor parallelism: %d ranks, rendezvous at %s", where.world, where.init_method)
    ranks = LocalRanks(config, where)
    try:
        return ranks, where.join(0)
    except BaseException:
        ranks.stop()
        raise


def stop_leader(engine: Engine, ranks: LocalRanks | None) -> None:
    """After rank 0's last step: end the other ranks' plans and wait for this host's to exit.
    NOTE: no rank destroys the process group: with NCCL (2.28, torch 2.11, after CUDA graphs
    captured its collectives) ``destroy_process_group`` blocked the stop for good. The ranks'
    processes end instead, which frees what the group holds."""
    if ranks is None:
        return
    engine.stop_ranks()
    ranks.release()
    ranks.stop()


def serve_follower_host(config: ServeConfig) -> NoReturn:
    """``--node-rank`` > 0: this host's ranks and nothing else (no sockets, no children),
    until rank 0 stops them; then the process exits: 0 once stopped, 1 when rank 0 went
    away."""
    from outrider.daemon.engine.build import build_follower

    where = placement(config)
    log.info(
        "host %d of %d: ranks %d..%d of %d, joining rank 0 at %s",
        config.node_rank, config.nnodes, where.rank(0), where.rank(where.per_node - 1),
        where.world, where.init_method,
    )  # fmt: skip
    ranks = LocalRanks(config, where)
    status = 0
    try:
        tp = where.join(0)
        follower = build_follower(config, tp)
        freeze_start_up()
        log.info("rank %d ready: running rank 0's plans", tp.rank)
        steps = follower.run()
        ranks.release()
        log.info("rank 0 stopped the ranks after %d steps", steps)
    except RuntimeError as exc:  # torch.distributed's errors: a peer went away
        log.error("tensor-parallel rank %d stopped: %s", where.rank(0), exc)
        status = 1
    finally:
        ranks.stop()
    # NOTE: as a spawned rank does (run_rank), exit without the interpreter's teardown: the
    # group is never destroyed (stop_leader), and destroying its objects at exit can abort the
    # process ("terminate called without an active exception", status -6, seen once in CI).
    logging.shutdown()
    os._exit(status)
