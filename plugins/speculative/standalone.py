"""The built-in ``standalone`` speculative plugin's spec: any small causal LM the engine serves
(a mixture of experts and an FP8 checkpoint included) whose tokenizer gives every token the
target's id drafts a chain (argmax for greedy requests; sampled requests:
``DraftOptions.sample``)."""

from __future__ import annotations

from outrider.plugins.api import (
    CheckContext,
    PluginSpec,
    Problem,
    SpeculativeCapabilities,
)
from outrider.plugins.models.registry import SUPPORTED_ARCHITECTURES
from outrider.plugins.speculative.draft_config import (
    DRAFT_FLAG,
    read_config,
    sharding_problems,
    tokenizer_vocab,
)
from outrider.plugins.speculative.draft_options import DraftOptions


def _check(spec: PluginSpec, ctx: CheckContext) -> list[Problem]:
    if not ctx.draft_model:
        return []
    draft = read_config(ctx.draft_model)
    if draft is None:
        return [Problem(DRAFT_FLAG, f"no readable config.json at {ctx.draft_model}")]
    problems = sharding_problems(draft, ctx, "the draft model's", "vocab_size")
    architectures = draft.get("architectures") or []
    if not set(architectures) & set(SUPPORTED_ARCHITECTURES):
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        problems.append(
            Problem(DRAFT_FLAG, f"standalone drafts with {supported}, not {architectures}")
        )
    target_vocab, draft_vocab = tokenizer_vocab(ctx.model), tokenizer_vocab(ctx.draft_model)
    if (target_vocab is None) != (draft_vocab is None):
        problems.append(
            Problem(
                DRAFT_FLAG, "one of the target and the draft has a tokenizer.json, the other not"
            )
        )
    elif target_vocab is not None and draft_vocab is not None and target_vocab != draft_vocab:
        differing = sorted(
            t for t in target_vocab.keys() | draft_vocab.keys()
            if target_vocab.get(t) != draft_vocab.get(t)
        )  # fmt: skip
        first = differing[0]
        problems.append(
            Problem(
                DRAFT_FLAG,
                f"the draft's tokenizer maps tokens to other ids ({len(differing)} differ, e.g. "
                f"{first!r}: target {target_vocab.get(first)}, draft {draft_vocab.get(first)})",
            )
        )
    return problems


SPEC = PluginSpec(
    name="standalone",
    kind="speculative",
    summary="a small causal LM with the target's tokenizer drafts a chain",
    implementation="outrider.plugins.speculative.standalone_impl:StandaloneWorker",
    options=DraftOptions,
    speculative=SpeculativeCapabilities(
        needs_draft_model=True,
        default_width=4,
        # The catch-up feeds each row's last accepted token at its accepted length.
        exact_draft_lengths=False,
    ),
    check=_check,
)
