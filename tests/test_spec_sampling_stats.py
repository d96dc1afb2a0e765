"""Sampled requests with drafts drawn from a draft's own distribution: the committed tokens are
distributed as the target's. A chi-square test of the joint distribution of three generated
tokens (20,000 seeded requests through the in-process engine, a target with a vocabulary of
16) against the probabilities enumerated from the target, for every sampled path: chains kept
with min(1, p/q) (``"sample": "rejection"``, a request's draft cap included) and coupled
drafts (the default), trees included.
The same test must reject a deliberately wrong rule (an argmax draft verified with its softmax
as q). Greedy rows of a mixed batch stay exact, and coupled drafts give the target-only seeded
outputs token for token."""

from __future__ import annotations

import json

import pytest
import torch
from engine_harness import engine_for, request, run, tokens_of
from model_fixtures import save_random_dflash, save_random_eagle3, save_tiny_model
from spec_stats import (
    BIG_BATCHES,
    SIGNIFICANCE,
    VOCAB,
    chi_square_p_value,
    joint_distribution,
    sampled_joint_counts,
)

from outrider.daemon.config import ConfigError
from outrider.daemon.engine.build import Engine
from outrider.plugins.speculative import standalone_impl
from outrider.plugins.speculative.dflash import SPEC as DFLASH

TREE = {"speculative_num_steps": 3, "speculative_topk": 2, "speculative_num_draft_tokens": 6}
# name -> (algorithm, mode, extra flags, floor on the acceptance length at temperature 1)
PATHS: dict[str, tuple[str, str, dict[str, object], float]] = {
    "standalone rejection": ("standalone", "rejection", {"speculative_num_draft_tokens": 4}, 1.1),
    "dflash rejection": ("dflash", "rejection", {}, 1.1),
    "dflash coupled": ("dflash", "coupled", {}, 1.1),
    "eagle3 chain rejection": ("eagle3", "rejection", {"speculative_num_steps": 3}, 1.1),
    "eagle3 tree coupled": ("eagle3", "coupled", TREE, 1.1),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str], torch.Tensor]:
    """(target dir, draft dir per algorithm, the target's joint distribution of 3 tokens
    [16, 16, 16])."""
    target_dir = tmp_path_factory.mktemp("target16")
    drafts = {name: tmp_path_factory.mktemp(name) for name in ("standalone", "dflash", "eagle3")}
    with torch.no_grad():
        target = save_tiny_model("llama", target_dir, vocab_size=VOCAB, seed=1)
        save_tiny_model("qwen2", drafts["standalone"], vocab_size=VOCAB, seed=2)
        save_random_dflash(drafts["dflash"], block_size=4, target=target_dir)
        save_random_eagle3(drafts["eagle3"], target_dir)
        return str(target_dir), {k: str(v) for k, v in drafts.items()}, joint_distribution(target)


def _engine(target_dir: str, drafts: dict[str, str], path: str, **overrides: object) -> Engine:
    algorithm, mode, flags, _floor = PATHS[path]
    settings: dict[str, object] = {
        "speculative_algorithm": algorithm,
        "draft_model": drafts[algorithm],
        "speculative_config": json.dumps({"sample": mode}),
        **flags,
    }
    return engine_for(target_dir, **(settings | overrides))


# dflash coupled: its outputs equal the target alone's (test_mixed_batches_keep_greedy_rows_exact).
@pytest.mark.parametrize("path", [p for p in PATHS if p != "dflash coupled"])
def test_sampled_drafts_are_distributed_as_the_target(
    models: tuple[str, dict[str, str], torch.Tensor], path: str
) -> None:
    target_dir, drafts, joint = models
    counts, tau = sampled_joint_counts(_engine(target_dir, drafts, path, **BIG_BATCHES))
    assert tau > PATHS[path][3]  # drafts are kept often enough for the rule to matter
    assert chi_square_p_value(counts, joint) > SIGNIFICANCE


def test_a_capped_chain_under_rejection_is_distributed_as_the_target(
    models: tuple[str, dict[str, str], torch.Tensor],
) -> None:
    """A draft cap of 1 cuts each commit after the token at the first draft: the kept draft or
    the residual's, which is the target's distribution."""
    target_dir, drafts, joint = models
    engine = _engine(target_dir, drafts, "standalone rejection", **BIG_BATCHES)
    counts, tau = sampled_joint_counts(engine, max_drafts=1)
    assert 1.1 < tau <= 2.0  # drafts kept, one a step at most
    assert chi_square_p_value(counts, joint) > SIGNIFICANCE


def test_an_argmax_draft_verified_with_its_softmax_is_rejected(
    models: tuple[str, dict[str, str], torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wrong rule: drafts are the draft's argmax, but q is its softmax."""
    target_dir, drafts, joint = models

    def argmax(probs: torch.Tensor, *_: object) -> torch.Tensor:
        return probs.argmax(dim=-1)

    monkeypatch.setattr(standalone_impl, "sample_probs", argmax)
    engine = _engine(target_dir, drafts, "standalone rejection", **BIG_BATCHES)
    counts, _tau = sampled_joint_counts(engine)
    assert chi_square_p_value(counts, joint) < SIGNIFICANCE


@pytest.mark.parametrize("path", PATHS)
def test_mixed_batches_keep_greedy_rows_exact(
    models: tuple[str, dict[str, str], torch.Tensor], path: str
) -> None:
    """Greedy and sampled requests share batches: greedy outputs equal the target alone;
    coupled drafts give the target-only seeded outputs too."""
    target_dir, drafts, _joint_probs = models
    prompts = [[(3 * i + j) % VOCAB for j in range(5 + i % 7)] for i in range(16)]
    reqs = [
        request(i, p, max_new_tokens=20, temperature=0.9 * (i % 2), top_k=8 * (i % 4 == 1), seed=i)
        for i, p in enumerate(prompts)
    ]
    expected = tokens_of(run(engine_for(target_dir), reqs))
    got = tokens_of(run(_engine(target_dir, drafts, path), reqs))
    greedy = [r.rid for r in reqs if r.sampling.temperature == 0]
    assert {rid: got[rid] for rid in greedy} == {rid: expected[rid] for rid in greedy}
    if PATHS[path][1] == "coupled":
        assert got == expected


def test_a_tree_refuses_rejection_drafts(models: tuple[str, dict[str, str], torch.Tensor]) -> None:
    target_dir, drafts, _joint_probs = models
    with pytest.raises(ConfigError, match='--speculative-config: "sample": "rejection" drafts'):
        _engine(
            target_dir, drafts, "eagle3 tree coupled", speculative_config='{"sample": "rejection"}'
        )


def test_coupled_drafts_are_the_default() -> None:
    assert DFLASH.parse_options(None) == DFLASH.parse_options('{"sample": "coupled"}')
