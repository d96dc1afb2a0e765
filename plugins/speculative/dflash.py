"""The built-in ``dflash`` speculative plugin's spec: a DFlash draft drafts a whole block in
one non-causal forward, its context K/V materialised from target features."""

from __future__ import annotations

from typing import Any

from outrider.plugins.api import (
    CheckContext,
    PluginSpec,
    Problem,
    SpeculativeCapabilities,
)
from outrider.plugins.speculative.draft_config import (
    DRAFT_FLAG,
    check_draft,
    feature_size_problem,
    sharding_problems,
    tokenizer_vocab,
)
from outrider.plugins.speculative.draft_options import DraftOptions

ARCHITECTURE = "DFlashDraftModel"
_WIDTH_FLAG = "--speculative-num-draft-tokens"


def _check(spec: PluginSpec, ctx: CheckContext) -> list[Problem]:
    draft, target, problems = check_draft(spec.name, ARCHITECTURE, ctx)
    if draft is None:
        return problems
    problems += feature_size_problem(draft, target)
    problems += sharding_problems(draft, ctx, "the DFlash draft's")
    block = draft.get("block_size")
    if not isinstance(block, int) or block < 2:
        problems.append(Problem(DRAFT_FLAG, f"the draft's block_size {block!r} is not an int >= 2"))
    else:
        width = ctx.speculative_width or block
        if width != block:
            problems.append(
                Problem(
                    _WIDTH_FLAG,
                    f"dflash verifies whole blocks: the draft's block_size is {block}, not {width}",
                )
            )
    layers = draft.get("num_target_layers")
    if target is not None and layers is not None and layers != target.get("num_hidden_layers"):
        problems.append(
            Problem(
                DRAFT_FLAG,
                f"the draft was made for a {layers}-layer target, this one has "
                f"{target.get('num_hidden_layers')}",
            )
        )
    problems += _mask_problems(draft, ctx)
    return problems


def _mask_problems(draft: dict[str, Any], ctx: CheckContext) -> list[Problem]:
    """A mask token id, or a mask token string the target's tokenizer knows."""
    dflash = draft.get("dflash_config") or {}
    if dflash.get("mask_token_id") is not None:
        return []
    token = dflash.get("mask_token", draft.get("mask_token"))
    if not token:
        return [
            Problem(DRAFT_FLAG, "the draft names no dflash_config.mask_token_id nor mask_token")
        ]
    if resolve_mask_token(token, ctx.model) is None:
        return [Problem(DRAFT_FLAG, f"the target's tokenizer has no mask token {token!r}")]
    return []


def resolve_mask_token(token: str, model: str) -> int | None:
    """The id of the draft's mask token string in the target's tokenizer."""
    vocab = tokenizer_vocab(model) if model else None
    return None if vocab is None else vocab.get(token)


SPEC = PluginSpec(
    name="dflash",
    kind="speculative",
    summary="DFlash: block drafting in one non-causal forward over target-feature context",
    implementation="outrider.plugins.speculative.dflash_impl:DFlashWorker",
    options=DraftOptions,
    speculative=SpeculativeCapabilities(
        needs_draft_model=True,
        non_causal_draft=True,
        draft_phases=frozenset({"draft_decode"}),  # the context K/V is projected, not attended
        width_key="block_size",
    ),
    check=_check,
)
