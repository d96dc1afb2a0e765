"""Trees under the overlap loop on CUDA, for every installed attention backend that declares
tree masks: the embedded family with its EAGLE-3 tree (S 5, K 4, N 8) in bf16, every phase on
the backend (prompts on triton where the backend serves no extend phase: auto routes the
others), CUDA graphs on, greedy outputs of the overlap loop against the serial loop within
the numeric rule (numeric_rule.py: the two loops batch the requests differently, and the
kernels round differently per batch size)."""

from __future__ import annotations

import pytest
from engine_harness import engine_for, request, run, tau_of
from numeric_rule import MAX_DIFF, assert_within_rule

from outrider.daemon.config import ConfigError
from outrider.daemon.engine.build import Engine
from outrider.daemon.family import embedded_family
from outrider.plugins.registry import discover
from outrider.protocol.messages import TokenLogprob

NEW_TOKENS = 40


def _tree_backends() -> dict[str, str]:
    """Each backend with tree masks on CUDA -> the backend of its prompt (EXTEND) batches."""
    backends = {}
    for entry in discover().entries("attention"):
        spec = entry.spec.attention if entry.spec is not None else None
        if spec is not None and spec.tree_mask and "cuda" in spec.devices:
            backends[entry.name] = entry.name if "extend" in spec.phases else "triton"
    return dict(sorted(backends.items()))


def _engine(model: str, **settings: object) -> Engine:
    """The engine, or a skip where the backend's own check finds it not installed here."""
    try:
        return engine_for(model, **settings)
    except ConfigError as exc:
        if "is not installed (pip install" in str(exc):
            pytest.skip(str(exc))
        raise


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "prefill"), list(_tree_backends().items()))
def test_trees_under_overlap_follow_the_serial_loop(backend: str, prefill: str) -> None:
    family = embedded_family()
    assert family is not None, "the family package is installed with the test extra"
    prompts = [[3 + (11 * i + 5 * j) % 4000 for j in range(5 + 9 * i)] for i in range(10)]
    requests = [request(i, p, max_new_tokens=NEW_TOKENS, logprobs=2) for i, p in enumerate(prompts)]

    def serve(overlap: bool) -> tuple[dict[int, list[TokenLogprob]], float]:
        engine = _engine(
            str(family.target), device="cuda", dtype="bfloat16", attention_backend=backend,
            prefill_attention_backend=prefill,
            speculative_algorithm="eagle3", draft_model=str(family.drafts["eagle3"]),
            speculative_num_steps=5, speculative_topk=4, speculative_num_draft_tokens=8,
            no_overlap=not overlap, max_running=8,
        )  # fmt: skip
        outcomes = run(engine, requests, stagger=2)
        logprobs = {
            rid: [lp for u in o.updates for lp in u.logprobs or []] for rid, o in outcomes.items()
        }
        return logprobs, tau_of(engine.scheduler.counters())

    overlapped, tau = serve(overlap=True)
    serial, _ = serve(overlap=False)
    same = sum(
        assert_within_rule(serial[rid], overlapped[rid], MAX_DIFF["bfloat16"]) for rid in serial
    )
    assert all(len(lps) == NEW_TOKENS for lps in overlapped.values())
    assert tau > 1.5, f"{backend}: the tree accepted {tau:.2f} per cycle"
    print(f"{backend}: {same} of {len(serial)} requests token for token, tau {tau:.2f}")
