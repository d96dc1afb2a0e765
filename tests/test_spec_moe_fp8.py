"""Speculative decoding on a mixture-of-experts target and on its FP8 checkpoint (block-scaled
attention projections and experts), float32 on CPU: with every draft algorithm
(DRAFT_ALGORITHMS) a batch of greedy requests gets the target-only tokens, through the overlap
loop and the serial one; so do EAGLE-3 chains and trees that repeat the last token, accepted in
the targets' runs; the target as its own standalone draft (an MoE or FP8 MoE draft) has every
draft accepted; sampled EAGLE-3 trees on an MoE target commit tokens distributed as the
target's (spec_stats.py); the drafting policy's start-up timing routes the tokens it verifies
to experts as text is routed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import spec_stats
import torch
from engine_harness import (
    DRAFT_ALGORITHMS,
    debug_checks_fixture,
    engine_for,
    requests_for,
    run,
    tokens_of,
)
from fp8_fixtures import block_config, write_fp8_checkpoint
from model_fixtures import mixed_prompts, save_drafts, save_repeating_eagle3, save_tiny_model
from spec_stats import (
    BIG_BATCHES,
    SIGNIFICANCE,
    chi_square_p_value,
    joint_distribution,
    sampled_joint_counts,
)

from outrider.daemon.config import ConfigError
from outrider.daemon.engine import drafting_setup
from outrider.daemon.engine.cycle_cost import timing_prompts
from outrider.plugins.models.fp8.experts import Fp8Experts
from outrider.plugins.models.fp8.layers import Fp8Linear
from outrider.plugins.models.moe.block import Experts, Router, Routing, SparseMoeBlock
from outrider.plugins.models.registry import SUPPORTED_ARCHITECTURES

debug_checks = debug_checks_fixture()

NEW_TOKENS = 10


PROMPTS = mixed_prompts(2, 4)


# Three layers: DFlash's taps stay off the last layer.
MOE_LAYERS = {"num_hidden_layers": 3}


def _save_moe(directory: Path) -> None:
    save_tiny_model("qwen3_moe", directory, config_overrides=MOE_LAYERS)


def _save_fp8_moe(directory: Path) -> None:
    """The MoE target in the block format: FP8 attention projections and FP8 experts."""
    save_tiny_model("qwen3_moe", directory / "source", config_overrides=MOE_LAYERS)
    write_fp8_checkpoint(directory / "source", directory / "fp8", block_config((16, 32)))


TARGETS = {"qwen3_moe": (_save_moe, ""), "fp8 moe block": (_save_fp8_moe, "fp8")}


class Target:
    """A target checkpoint, a random draft for it per algorithm and a repeating EAGLE-3 one,
    its target-only tokens."""

    def __init__(self, root: Path, name: str) -> None:
        save, sub = TARGETS[name]
        with torch.no_grad():
            save(root / "target")
        self.directory = str(root / "target" / sub)
        self.drafts = save_drafts(root / "drafts", Path(self.directory))
        self.repeating = str(save_repeating_eagle3(root / "repeating", Path(self.directory)))
        plain = engine_for(self.directory)
        self.expected = tokens_of(run(plain, requests_for(PROMPTS, max_new_tokens=NEW_TOKENS)))

    def settings(self, algorithm: str) -> dict[str, object]:
        settings = dict(DRAFT_ALGORITHMS[algorithm])
        name = str(settings["speculative_algorithm"])
        if name in self.drafts:
            settings["draft_model"] = self.drafts[name]
        return settings


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Target]:
    return {name: Target(tmp_path_factory.mktemp(name), name) for name in TARGETS}


def test_the_targets_run_experts_and_fp8_projections(targets: dict[str, Target]) -> None:
    moe = engine_for(targets["qwen3_moe"].directory).loop.runner.model
    sparse = sum(isinstance(m, SparseMoeBlock) for m in moe.modules())
    assert sparse == MOE_LAYERS["num_hidden_layers"]
    fp8 = engine_for(targets["fp8 moe block"].directory).loop.runner.model
    assert any(isinstance(m, Fp8Linear) for m in fp8.modules())
    experts = [m for m in fp8.modules() if isinstance(m, Experts)]
    assert len(experts) == MOE_LAYERS["num_hidden_layers"]
    assert all(isinstance(m, Fp8Experts) for m in experts)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("algorithm", DRAFT_ALGORITHMS)
@pytest.mark.parametrize("target", TARGETS)
def test_drafts_keep_the_targets_greedy_tokens(
    targets: dict[str, Target], target: str, algorithm: str, overlap: bool
) -> None:
    t = targets[target]
    engine = engine_for(t.directory, no_overlap=not overlap, **t.settings(algorithm))
    outcomes = run(engine, requests_for(PROMPTS, max_new_tokens=NEW_TOKENS))
    assert tokens_of(outcomes) == t.expected
    assert engine.scheduler.counters().spec_drafts > 0


@pytest.mark.parametrize("target", TARGETS)
def test_the_target_drafting_for_itself_is_always_accepted(
    targets: dict[str, Target], target: str
) -> None:
    """A standalone draft of the target's own checkpoint: each step commits its 3 drafts and
    the target's next token, through the MoE or FP8 model on both sides."""
    t = targets[target]
    engine = engine_for(t.directory, speculative_algorithm="standalone", draft_model=t.directory)
    outcomes = run(engine, requests_for(PROMPTS, max_new_tokens=NEW_TOKENS))
    assert tokens_of(outcomes) == t.expected
    counters = engine.scheduler.counters()
    assert counters.spec_accepted_tokens == 3 * counters.spec_drafts > 0


@dataclass(frozen=True)
class SmallVocab:
    """A Qwen3-MoE target of vocabulary ``spec_stats.VOCAB``, where sampled random drafts are
    often accepted: its directory, its random drafts, the joint distribution of its next 3
    tokens."""

    directory: str
    drafts: dict[str, str]
    joint: torch.Tensor


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory: pytest.TempPathFactory) -> SmallVocab:
    root = tmp_path_factory.mktemp("moe16")
    with torch.no_grad():
        model = save_tiny_model(
            "qwen3_moe", root / "target", vocab_size=spec_stats.VOCAB, seed=1,
            config_overrides=MOE_LAYERS,
        )  # fmt: skip
        joint = joint_distribution(model)
    return SmallVocab(str(root / "target"), save_drafts(root / "drafts", root / "target"), joint)


@pytest.mark.parametrize("algorithm", ["eagle3 chain", "eagle3 tree"])
@pytest.mark.parametrize("target", TARGETS)
def test_accepted_drafts_keep_the_greedy_tokens(
    targets: dict[str, Target], target: str, algorithm: str
) -> None:
    """A draft that repeats the last token, accepted in the target's runs: the accepted
    tokens' K/V and features come from the verify's batch through the experts or FP8
    projections."""
    t = targets[target]
    engine = engine_for(t.directory, **(t.settings(algorithm) | {"draft_model": t.repeating}))
    assert tokens_of(run(engine, requests_for(PROMPTS, max_new_tokens=NEW_TOKENS))) == t.expected
    assert engine.scheduler.counters().spec_accepted_per_position[-1] > 0  # whole chains too


def test_sampled_tree_drafts_on_an_moe_target_are_distributed_as_the_target(
    small_vocab: SmallVocab,
) -> None:
    """Every row of 20,000 seeded requests verifies a tree of 6 through the experts."""
    engine = engine_for(
        small_vocab.directory, draft_model=small_vocab.drafts["eagle3"],
        **DRAFT_ALGORITHMS["eagle3 tree"], speculative_config=json.dumps({"sample": "coupled"}),
        **BIG_BATCHES,
    )  # fmt: skip
    counts, tau = sampled_joint_counts(engine)
    assert tau > 1.1  # drafts are kept often enough for the rule to matter
    assert chi_square_p_value(counts, small_vocab.joint) > SIGNIFICANCE


def test_timing_prompts_share_all_but_their_last_token() -> None:
    prompts = timing_prompts(4, 9, 50)
    assert [len(p) for p in prompts] == [9] * 4
    assert all(p[:-1] == prompts[0][:-1] for p in prompts)
    assert len({p[-1] for p in prompts}) == 4 and len(set(prompts[0])) > 4
    assert all(0 <= t < 50 for p in prompts for t in p)
    assert timing_prompts(2, 9, 50) == prompts[:2]


def test_the_break_even_timing_routes_a_verify_to_many_experts(
    targets: dict[str, Target], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At batch 1 the verified tokens of a drafting step (root and drafts) reach 3.6 distinct
    experts on average, not the top 2 of a single token: a timing whose rows and tokens are
    alike (as a prompt of one repeated id makes them) routes every token of a step to the same
    experts and times a verify as cheap as a plain step."""
    timing = False
    experts_hit: dict[int, list[int]] = {}  # tokens in the forward -> distinct experts
    route = Router.forward

    def spy(self: Router, x: torch.Tensor) -> Routing:
        routing = route(self, x)
        if timing:
            experts_hit.setdefault(x.shape[0], []).append(routing.ids.unique().numel())
        return routing

    def measured(*args: object) -> object:
        nonlocal timing
        timing = True
        try:
            return measure(*args)
        finally:
            timing = False

    measure = drafting_setup.measure_break_even
    monkeypatch.setattr(Router, "forward", spy)
    monkeypatch.setattr(drafting_setup, "measure_break_even", measured)
    engine = engine_for(
        targets["qwen3_moe"].directory, speculative_min_acceptance=-1.0, **DRAFT_ALGORITHMS["ngram"]
    )
    verifies = experts_hit[engine.loop.runner.shape.width]
    assert sum(verifies) / len(verifies) > 3.0


def test_standalone_drafts_are_any_served_architecture(
    targets: dict[str, Target], tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError) as refused:
        engine_for(
            targets["qwen3_moe"].directory,
            speculative_algorithm="standalone",
            draft_model=str(tmp_path),
        )
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    assert f"--draft-model: standalone drafts with {supported}, not ['GPT2LMHeadModel']" in str(
        refused.value
    )
    assert "Qwen3MoeForCausalLM" in supported
