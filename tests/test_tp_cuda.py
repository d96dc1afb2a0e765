"""Two GPUs: the daemon over two tensor-parallel ranks (NCCL, CUDA graphs, bf16) against the
daemon over one, within the numeric rule of ARCHITECTURE.md 4.4 (numeric_rule.py): the ranks sum
their partial products in another order than one GPU does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from daemon_harness import Daemon
from numeric_rule import MAX_DIFF, assert_within_rule

from outrider.daemon.family import embedded_family
from outrider.protocol import Client, GenerateResult

NEW_TOKENS = 48

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.e2e,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


def _prompts() -> list[list[int]]:
    return [[3 + (7 * i + 5 * j) % 4000 for j in range(6 + 13 * i)] for i in range(12)]


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[Daemon]]:
    daemons: list[Daemon] = []
    yield daemons
    for daemon in daemons:
        daemon.kill_all()


def _serve(daemons: list[Daemon], workdir: Path, name: str, *flags: str) -> list[GenerateResult]:
    family = embedded_family()
    assert family is not None, "the family package is installed with the test extra"
    daemon = Daemon(
        family.target, workdir / name, "--device", "cuda", "--dtype", "bfloat16",
        "--kv-cache-tokens", "16384", *flags, name=name,
        env={"OUTRIDER_DEBUG_SYNC_CHECK": "1"},
    )  # fmt: skip
    daemons.append(daemon)
    daemon.wait_serving(timeout=300)
    with Client(daemon.endpoint, timeout=120) as client:
        results = [
            client.generate(
                input_ids=p,
                max_new_tokens=NEW_TOKENS,
                temperature=0.0,
                ignore_eos=True,
                logprobs=2,
            )
            for p in _prompts()
        ]
    assert daemon.stop() == 0, daemon.log()[-4000:]
    return results


@pytest.mark.parametrize("algorithm", ["none", "dflash"])
def test_two_gpus_serve_within_the_numeric_rule(
    algorithm: str, tmp_path: Path, started: list[Daemon]
) -> None:
    family = embedded_family()
    assert family is not None
    flags: tuple[str, ...] = ("--speculative-algorithm", algorithm)
    if algorithm == "dflash":
        flags += ("--draft-model", str(family.drafts["dflash"]))
        flags += ("--speculative-min-acceptance", "0")  # every step drafts
    one = _serve(started, tmp_path, "tp1", *flags)
    two = _serve(started, tmp_path, "tp2", *flags, "--tp", "2")
    same = 0
    for reference, ranked in zip(one, two, strict=True):
        assert reference.logprobs is not None and ranked.logprobs is not None
        assert len(ranked.output_ids) == NEW_TOKENS
        same += assert_within_rule(reference.logprobs, ranked.logprobs, MAX_DIFF["bfloat16"])
    print(f"{algorithm}: {same} of {len(one)} requests token for token")
