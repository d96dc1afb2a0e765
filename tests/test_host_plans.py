"""A backend that plans on the host (``AttentionCapabilities.host_plans``) routed to the
speculative cycle: every cycle's layouts (the verify, the draft's steps and its catch-ups, in
the cycle and deferred) carry the exact lengths, under the overlap loop too, and the tokens are
those of a backend that needs none. The backend here is the torch one declaring ``host_plans`` and
checking each layout's host lengths against its device lengths."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
from engine_harness import DRAFT_ALGORITHMS, engine_for, request, run, tokens_of

from outrider.daemon.engine.build import Engine
from outrider.plugins.attention import torch_backend
from outrider.plugins.attention.torch_impl import TorchAttention, TorchAttentionMetadata
from outrider.plugins.device import BatchLayout


class HostCheckedAttention(TorchAttention):
    """The torch backend; asserts that a layout's host lengths, when it has them, are its
    device lengths, and counts the layouts it built with and without them, and the tree and
    non-causal ones with them."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.builds: Counter[str] = Counter()

    def build(self, layout: BatchLayout) -> TorchAttentionMetadata:
        if layout.host is None:
            self.builds["without"] += 1
        else:
            q_lens = (layout.q_start[1:] - layout.q_start[:-1]).tolist()
            assert list(layout.host.q_lens) == q_lens
            assert list(layout.host.seq_lens) == layout.seq_lens.tolist()
            self.builds["with"] += 1
            self.builds["trees"] += layout.tree_mask is not None
            self.builds["non-causal"] += not layout.causal
        return super().build(layout)


def declare_host_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry's ``torch`` backend becomes ``HostCheckedAttention`` with ``host_plans``."""
    spec = torch_backend.SPEC
    assert spec.attention is not None
    checked = dataclasses.replace(
        spec,
        implementation=f"{__name__}:HostCheckedAttention",
        attention=dataclasses.replace(spec.attention, host_plans=True),
    )
    monkeypatch.setattr(torch_backend, "SPEC", checked)


@pytest.mark.parametrize("algorithm", ["eagle3 chain", "eagle3 tree", "dflash"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_speculative_cycles_carry_exact_host_lengths(
    speculative_dirs: dict[str, str],
    algorithm: str,
    overlap: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tiny llama, requests arriving one by one (so that cycles of different rows and
    accepted lengths follow each other): with every phase planning on the host, every layout
    of a cycle has the device's lengths, trees and DFlash's non-causal blocks included, and
    the tokens do not change."""
    prompts = [[5 + (11 * i + j) % 200 for j in range(3 + 4 * i)] for i in range(5)]
    settings = DRAFT_ALGORITHMS[algorithm]

    def serve() -> tuple[dict[int, list[int]], Engine]:
        engine = engine_for(
            speculative_dirs["target"],
            draft_model=speculative_dirs[str(settings["speculative_algorithm"])],
            no_overlap=not overlap,
            **settings,
        )
        requests = [request(i, p, max_new_tokens=10 + i) for i, p in enumerate(prompts)]
        return tokens_of(run(engine, requests, stagger=3)), engine

    plain, _ = serve()
    with monkeypatch.context() as patch:
        declare_host_plans(patch)
        checked, engine = serve()
    assert checked == plain
    cycles = max(len(t) for t in plain.values()) // 4  # at most 4 tokens a cycle

    def builds(backend: object) -> Counter[str]:
        assert isinstance(backend, HostCheckedAttention)
        return backend.builds

    runner = engine.loop.runner
    target = builds(runner.backends["verify"])  # prompts and verify blocks
    assert target["without"] == 0 and target["with"] >= cycles
    worker: Any = runner.worker
    if algorithm == "dflash":
        draft = builds(worker.backend)  # the blocks
        assert draft["without"] == 0 and draft["non-causal"] >= cycles
        return
    steps = builds(worker.decode_backend)
    assert steps["without"] == 0 and steps["with"] >= 2 * cycles  # S = 3: two steps attend
    # The prompts, the catch-up inside each cycle, and the deferred catch-ups (of short
    # prompt endings), each of the slots' exact starts.
    catch_ups = builds(worker.extend_backend)
    assert catch_ups["without"] == 0 and catch_ups["with"] >= cycles
    if algorithm == "eagle3 tree":
        assert target["trees"] >= cycles and steps["trees"] >= 2 * cycles
