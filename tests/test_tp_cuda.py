"""Two GPUs: the daemon over two tensor-parallel ranks (NCCL, CUDA graphs, bf16) against the
daemon over one, within the numeric rule of DESIGN.md 4.4.

The ranks sum their partial products in another order than one GPU does, so tokens may part
where the reference's two best candidates are nearly tied. Over the same prefix (teacher-forced:
every position before the first divergence) the chosen token's log-probability differs by at
most ``MAX_DIFF``; at the first divergence, the reference's top-2 gap is at most twice that.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from daemon_harness import Daemon

from outrider.daemon.family import embedded_family
from outrider.protocol import Client, GenerateResult

MAX_DIFF = 0.25  # bf16
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
        pairs = zip(reference.output_ids, ranked.output_ids, strict=True)
        diverged = next((i for i, (a, b) in enumerate(pairs) if a != b), NEW_TOKENS)
        same += diverged == NEW_TOKENS
        for i in range(diverged):
            gap = abs(reference.logprobs[i].logprob - ranked.logprobs[i].logprob)
            assert gap <= MAX_DIFF, (i, gap)
        if diverged < NEW_TOKENS:
            top = reference.logprobs[diverged].top
            assert top[0][1] - top[1][1] <= 2 * MAX_DIFF, (diverged, top)
    print(f"{algorithm}: {same} of {len(one)} requests token for token")
