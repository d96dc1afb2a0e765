"""A verify backend that plans on the host (``AttentionCapabilities.host_plans``): every
speculative cycle's layout carries the exact lengths, under the overlap loop too, and the
tokens are those of a backend that needs none. The backend here is the torch one declaring
``host_plans`` and checking each layout's host lengths against its device lengths."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
from engine_harness import engine_for, request, run, tokens_of

from outrider.plugins.attention import torch_backend
from outrider.plugins.attention.torch_impl import TorchAttention, TorchAttentionMetadata
from outrider.plugins.device import BatchLayout


class HostCheckedAttention(TorchAttention):
    """The torch backend; asserts that a layout's host lengths, when it has them, are its
    device lengths, and counts the multi-token (verify) layouts that had them."""

    verify_builds: ClassVar[int] = 0

    def build(self, layout: BatchLayout) -> TorchAttentionMetadata:
        if layout.host is not None:
            q_lens = (layout.q_start[1:] - layout.q_start[:-1]).tolist()
            assert list(layout.host.q_lens) == q_lens
            assert list(layout.host.seq_lens) == layout.seq_lens.tolist()
            if layout.max_q > 1 and all(q == layout.max_q for q in q_lens):
                HostCheckedAttention.verify_builds += 1
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
    HostCheckedAttention.verify_builds = 0


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_speculative_cycles_carry_exact_host_lengths(
    llama_dir: str, eagle3_dir: str, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EAGLE-3 chains on the tiny llama, requests arriving one by one (so that cycles of
    different rows and accepted lengths follow each other): with the verify backend planning
    on the host, every verify layout has the device's lengths and the tokens do not change."""
    prompts = [[5 + (11 * i + j) % 200 for j in range(3 + 4 * i)] for i in range(5)]

    def serve() -> dict[int, list[int]]:
        engine = engine_for(
            llama_dir, speculative_algorithm="eagle3", draft_model=eagle3_dir,
            speculative_num_steps=3, no_overlap=not overlap,
        )  # fmt: skip
        requests = [request(i, p, max_new_tokens=10 + i) for i, p in enumerate(prompts)]
        return tokens_of(run(engine, requests, stagger=3))

    plain = serve()
    with monkeypatch.context() as patch:
        declare_host_plans(patch)
        checked = serve()
        builds = HostCheckedAttention.verify_builds
    assert checked == plain
    assert builds >= max(len(t) for t in plain.values()) // 4  # cycles ran with host lengths
