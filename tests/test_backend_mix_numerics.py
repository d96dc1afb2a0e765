"""Every attention backend set of the benchmark matrix (`outrider bench sweep`: fa4, triton,
flashinfer where it serves the phases, and the Hopper mix) against the eager torch backend, on
CUDA in bf16: the embedded family greedy with each speculative algorithm, CUDA graphs on,
against the target alone on torch, under ARCHITECTURE.md 4.4's rule (numeric_rule.py):
teacher-forced log-probabilities up to each request's first divergence, and a divergence only
where the reference's two best nearly tie."""

from __future__ import annotations

import pytest
from engine_harness import ENGINE_ALGORITHMS, engine_for, request, run
from numeric_rule import MAX_DIFF, assert_within_rule

from outrider.daemon.config import ConfigError
from outrider.daemon.family import embedded_family
from outrider.protocol.messages import TokenLogprob

NEW_TOKENS = 32
# The sweep's backend sets (daemon/bench/sweep.py), flags as engine settings.
BACKEND_SETS: dict[str, dict[str, str]] = {
    "fa4": {"attention_backend": "fa4"},
    "triton": {"attention_backend": "triton"},
    "flashinfer": {"attention_backend": "flashinfer"},
    "mix": {
        "prefill_attention_backend": "fa4",
        "decode_attention_backend": "auto",
        "verify_attention_backend": "auto",
        "draft_attention_backend": "auto",
    },
}
ALGORITHMS = {**ENGINE_ALGORITHMS, "eagle3 chain": {"speculative_algorithm": "eagle3"}}


def _serve(**settings: object) -> dict[int, list[TokenLogprob]]:
    family = embedded_family()
    assert family is not None, "the family package is installed with the test extra"
    name = str(settings.get("speculative_algorithm", "none"))
    if name in family.drafts:
        settings["draft_model"] = str(family.drafts[name])
    prompts = [[3 + (13 * i + 7 * j) % 4000 for j in range(4 + 23 * i)] for i in range(6)]
    requests = [request(i, p, max_new_tokens=NEW_TOKENS, logprobs=2) for i, p in enumerate(prompts)]
    try:
        engine = engine_for(
            str(family.target), device="cuda", dtype="bfloat16", max_running=8, **settings
        )
    except ConfigError as exc:
        if "is not installed (pip install" in str(exc):
            pytest.skip(str(exc))
        raise
    outcomes = run(engine, requests, stagger=2)
    return {
        rid: [lp for update in outcome.updates for lp in update.logprobs or []]
        for rid, outcome in outcomes.items()
    }


@pytest.fixture(scope="module")
def reference() -> dict[int, list[TokenLogprob]]:
    return _serve(attention_backend="torch")


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("backends", BACKEND_SETS)
def test_backend_sets_follow_the_torch_backend_under_the_rule(
    reference: dict[int, list[TokenLogprob]], backends: str, algorithm: str
) -> None:
    got = _serve(**BACKEND_SETS[backends], **ALGORITHMS[algorithm])
    assert got.keys() == reference.keys()
    assert all(len(tokens) == NEW_TOKENS for tokens in got.values())
    for rid, tokens in got.items():
        assert_within_rule(reference[rid], tokens, MAX_DIFF["bfloat16"])
