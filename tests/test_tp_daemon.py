"""The daemon over tensor-parallel rank processes (gloo, CPU, float32), end to end.

One host: ``outrider serve --tp 2`` spawns rank 1 and serves the tokens of the in-process
engine over one rank; killing rank 1 mid-stream stops the daemon with status 1 and ends the
client's stream with a final frame. Two hosts (two processes on this one):
``--nnodes 2 --node-rank 0|1`` meet at ``--dist-init-addr``, serve the same tokens, and both
exit 0 when node 0 is stopped.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from daemon_harness import TEST_DEVICE, Daemon, build_model_dir, daemons, free_port
from engine_harness import engine_for, request, run, tokens_of

from outrider.daemon.cli.main import main
from outrider.daemon.config import EXIT_CONFIG, ConfigError, ServeConfig
from outrider.daemon.processes.ranks import placement
from outrider.protocol import Client, RequestError

PAGE_SIZE = 4  # the harness's --page-size

if TEST_DEVICE == "cuda" and torch.cuda.device_count() < 2:
    pytest.skip("two ranks on CUDA need two GPUs", allow_module_level=True)
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(16)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 17, 40, 9)]


@pytest.fixture(scope="module")
def expected(model_dir: Path, prompts: list[list[int]]) -> dict[int, list[int]]:
    """Greedy tokens of the in-process engine over one rank."""
    engine = engine_for(str(model_dir), page_size=PAGE_SIZE)
    requests = [
        request(i, p, max_new_tokens=NEW_TOKENS, ignore_eos=True) for i, p in enumerate(prompts)
    ]
    return tokens_of(run(engine, requests))


@pytest.fixture
def spawn(model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Starts daemons of this test (``spawn(name, *flags, ...)``, daemon_harness.daemons)."""
    with daemons(model_dir, tmp_path) as start:
        yield start


def _served(daemon: Daemon, prompts: list[list[int]]) -> dict[int, list[int]]:
    with Client(daemon.endpoint, timeout=60) as client:
        return {
            i: client.generate(
                input_ids=p, max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True
            ).output_ids
            for i, p in enumerate(prompts)
        }


@pytest.mark.e2e
def test_two_ranks_serve_the_tokens_of_one_and_a_dead_rank_stops_the_daemon(
    spawn: Callable[..., Daemon], prompts: list[list[int]], expected: dict[int, list[int]]
) -> None:
    daemon = spawn("tp2", "--tp", "2")
    daemon.wait_serving()
    assert _served(daemon, prompts) == expected
    rank1 = daemon.child_pid("rank1")
    with Client(daemon.endpoint, timeout=60) as client:
        stream = client.stream(input_ids=[5, 6, 7], max_new_tokens=1500, ignore_eos=True)
        assert next(stream).token_ids
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(RequestError) as lost:
            list(stream)
        waited = time.monotonic() - killed
    assert lost.value.code == "connection_lost"
    assert waited < 10.0, (waited, daemon.log())
    # Never serve half the model: the daemon exits non-zero so that systemd restarts it.
    assert daemon.wait_exit(30) == 1, daemon.log()
    daemon.wait_group_gone()
    assert "tensor-parallel rank 1 exited with code -9" in daemon.log()
    # Rank 0 and the spawned rank 1 froze their start-up objects, each once.
    assert daemon.log().count(" start-up objects frozen ") == 2, daemon.log()


@pytest.mark.e2e
def test_ranks_on_two_hosts_meet_at_the_init_address(
    spawn: Callable[..., Daemon], prompts: list[list[int]], expected: dict[int, list[int]]
) -> None:
    hosts = ("--tp", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}")
    # Each host's rank takes its first visible GPU: on one machine, two different ones.
    daemon = spawn("host0", *hosts, "--node-rank", "0", env={"CUDA_VISIBLE_DEVICES": "0"})
    other = spawn("host1", *hosts, "--node-rank", "1", env={"CUDA_VISIBLE_DEVICES": "1"})
    daemon.wait_serving()
    assert _served(daemon, prompts) == expected
    assert daemon.stop() == 0, daemon.log()
    assert other.wait_exit(30) == 0, other.log()
    log = other.log()
    assert "host 1 of 2: ranks 1..1 of 2" in log, log
    assert "rank 0 stopped the ranks after" in log, log
    assert log.count(" start-up objects frozen ") == 1, log
    assert "Traceback" not in daemon.log() + log


def test_placement_flags_are_checked(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refusals = {
        ("--tp", "2", "--nnodes", "2"): "--nnodes > 1 needs --dist-init-addr HOST:PORT",
        ("--tp", "3", "--nnodes", "2", "--dist-init-addr", "h:1"): (
            "--nnodes 2 must divide --tensor-parallel-size 3"
        ),
        ("--tp", "2", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"): (
            "--node-rank must be in [0, 2) (--nnodes 2), not 2"
        ),
        ("--tp", "2", "--dist-init-addr", "nohost"): (
            "--dist-init-addr must be HOST:PORT, not 'nohost'"
        ),
    }
    for flags, message in refusals.items():
        assert main(["serve", "--model", str(model_dir), *flags]) == EXIT_CONFIG, flags
        err = capsys.readouterr().err
        assert message in err, (flags, err)


def test_a_host_needs_a_gpu_per_rank(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = ServeConfig(model=str(model_dir), device="cuda", tensor_parallel_size=4, nnodes=2)
    with pytest.raises(ConfigError) as refused:
        placement(dataclasses.replace(config, dist_init_addr="10.0.0.1:29500"))
    assert str(refused.value) == (
        "--tensor-parallel-size 4 over --nnodes 2 needs 2 GPUs on this host, 1 visible"
    )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    where = placement(dataclasses.replace(config, dist_init_addr="10.0.0.1:29500", node_rank=1))
    assert (where.world, where.per_node, where.backend) == (4, 2, "nccl")
    assert (where.rank(0), where.rank(1), where.init_method) == (2, 3, "tcp://10.0.0.1:29500")
