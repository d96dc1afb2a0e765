"""Where the tensor-parallel ranks run and with how many torch threads: the placement serve
flags (``--tensor-parallel-size``, ``--nnodes``, ``--node-rank``, ``--dist-init-addr``,
``--disable-peer-all-reduce``, ``--threads``), their help and their checks, and the values
derived from them. The fields stay in the one flag table (daemon/config.py's
``ServeConfig``); daemon/flags.py gathers this help and runs these checks.

Invariant (once checked): ``--nnodes`` divides ``--tensor-parallel-size``, every host runs
``ranks_per_node`` ranks, and more than one host needs a rendezvous address.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from outrider.plugins.models.peer_reduce import ONE_SHOT_UNMEASURED_BYTES, one_shot_max_bytes

if TYPE_CHECKING:
    from outrider.daemon.config import ServeConfig

# The children (front door, detokenizer, HTTP front) run one thread each; under load they take
# about one core between them, which the automatic --threads leaves to them.
CHILDREN_CORES = 1

PLACEMENT_HELP: dict[str, str] = {
    "tensor_parallel_size": (
        "ranks the model is sharded over (alias --tp); it must divide the attention and KV "
        "heads, the MLP rows and the vocabulary; one process per rank, on CUDA one GPU each "
        "(local rank r takes visible device r)"
    ),
    "nnodes": "hosts the ranks are spread over, --tensor-parallel-size / --nnodes on each",
    "node_rank": (
        "this host's place among --nnodes: 0 runs the scheduler and serves clients; the "
        "others run only their ranks (start them with the same model flags)"
    ),
    "dist_init_addr": (
        "HOST:PORT where rank 0 (on node 0) listens for the other ranks to join "
        "(torch.distributed's TCP rendezvous); needed with --nnodes > 1"
    ),
    "disable_peer_all_reduce": (
        "sum every tensor-parallel all-reduce through NCCL; by default one host's ranks sum "
        f"messages up to {one_shot_max_bytes(2) // 2**20} MiB "
        f"({ONE_SHOT_UNMEASURED_BYTES // 2**10} KiB past two ranks) with one kernel over "
        "their GPUs' peer memory"
    ),
    "threads": (
        "torch CPU threads of the daemon (of each rank with --tensor-parallel-size); 0: the "
        "CPUs it may use (affinity, cgroup quota) less one for the front door and "
        "detokenizer, which run one thread each, shared by this host's ranks; at least 1"
    ),
}

PLACEMENT_SHOWN_DEFAULTS: dict[str, str] = {
    "threads": "automatic",
    "dist_init_addr": "a free loopback port (one host)",
}


def placement_problems(config: ServeConfig) -> list[str]:
    """What keeps the placement flags of ``config`` from running, each naming its flag."""
    problems = ["--threads must be >= 0 (0: automatic)"] if config.threads < 0 else []
    ranks = _ranks_problem(config)
    return problems if ranks is None else [*problems, ranks]


def _ranks_problem(config: ServeConfig) -> str | None:
    size, nodes = config.tensor_parallel_size, config.nnodes
    if size < 1:
        return "--tensor-parallel-size must be at least 1"
    if nodes < 1 or size % nodes:
        return f"--nnodes {nodes} must divide --tensor-parallel-size {size}"
    if not 0 <= config.node_rank < nodes:
        return f"--node-rank must be in [0, {nodes}) (--nnodes {nodes}), not {config.node_rank}"
    if nodes > 1 and not config.dist_init_addr:
        return "--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)"
    if config.dist_init_addr and not _is_host_port(config.dist_init_addr):
        return f"--dist-init-addr must be HOST:PORT, not {config.dist_init_addr!r}"
    return None


def _is_host_port(value: str) -> bool:
    host, _, port = value.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def ranks_per_node(config: ServeConfig) -> int:
    """The tensor-parallel ranks this host runs."""
    return config.tensor_parallel_size // config.nnodes


def torch_threads(config: ServeConfig, cpus: int | None = None) -> int:
    """The torch intra-op threads of the daemon and of each rank process: ``--threads``, or
    for 0 the CPUs it may use (``cpus``, default ``available_cpus()``) less ``CHILDREN_CORES``,
    shared by this host's ranks, at least 1. NOTE: torch's
    own default takes every core; on a small host its threads then wait for one another at
    every operation whenever anything else runs (on 2 cores under load: first tokens after
    seconds instead of 0.1 s, a tenth of the tokens per second; README, ``--threads``)."""
    if config.threads:
        return config.threads
    free = (available_cpus() if cpus is None else cpus) - CHILDREN_CORES
    return max(1, free // ranks_per_node(config))


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity mask, capped by its cgroup (v2) CPU
    quota rounded down, at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        group = next(line[3:] for line in lines if line.startswith("0::"))
        quota, period = (Path("/sys/fs/cgroup") / group.lstrip("/") / "cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, int(quota) // int(period))
    except (OSError, StopIteration, ValueError):
        pass  # no cgroup v2 or no quota: the affinity mask alone
    return max(1, cpus)
