"""The built-in ``eagle3`` speculative plugin's spec: an EAGLE-3 draft (one decoder layer over
three tapped target layers) drafting a chain, or a top-K tree."""

from __future__ import annotations

from outrider.plugins.api import (
    CheckContext,
    PluginSpec,
    Problem,
    SpeculativeCapabilities,
)
from outrider.plugins.speculative.draft_config import (
    check_draft,
    feature_size_problem,
    sharding_problems,
)
from outrider.plugins.speculative.draft_options import DraftOptions, tree_sample_problems

ARCHITECTURE = "LlamaForCausalLMEagle3"


def _check(spec: PluginSpec, ctx: CheckContext) -> list[Problem]:
    draft, target, problems = check_draft(spec.name, ARCHITECTURE, ctx)
    if draft is not None:
        problems += feature_size_problem(draft, target)
        problems += sharding_problems(draft, ctx, "the EAGLE-3 draft's", "draft_vocab_size")
    return problems + tree_sample_problems(ctx)


SPEC = PluginSpec(
    name="eagle3",
    kind="speculative",
    summary="EAGLE-3: a one-layer draft over three tapped target layers; chains and trees",
    implementation="outrider.plugins.speculative.eagle3_impl:Eagle3Worker",
    options=DraftOptions,
    speculative=SpeculativeCapabilities(needs_draft_model=True, tree=True, default_width=4),
    check=_check,
)
