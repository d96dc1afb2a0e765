"""The built-in ``eagle3`` speculative plugin's spec: an EAGLE-3 draft (one decoder layer over
three tapped target layers) drafting a chain."""

from __future__ import annotations

import json
from pathlib import Path

from outrider.plugins.api import (
    CheckContext,
    NoOptions,
    PluginSpec,
    Problem,
    SpeculativeCapabilities,
    default_check,
)

ARCHITECTURE = "LlamaForCausalLMEagle3"


def _config_json(path: str) -> dict[str, object] | None:
    """A model directory's (or config.json path's) config, None when unreadable."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        loaded = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


def _check(spec: PluginSpec, ctx: CheckContext) -> list[Problem]:
    problems = default_check(spec, ctx)
    if not ctx.draft_model:
        return problems
    draft = _config_json(ctx.draft_model)
    if draft is None:
        return [
            *problems,
            Problem("--draft-model", f"no readable config.json at {ctx.draft_model}"),
        ]
    architectures = draft.get("architectures") or []
    if ARCHITECTURE not in architectures:  # type: ignore[operator]
        problems.append(
            Problem("--draft-model", f"eagle3 needs a {ARCHITECTURE} draft, not {architectures}")
        )
    target = _config_json(ctx.model) if ctx.model else None
    if target is not None:
        if draft.get("vocab_size") != target.get("vocab_size"):
            problems.append(
                Problem(
                    "--draft-model",
                    f"the draft's vocab_size {draft.get('vocab_size')} is not the target's "
                    f"{target.get('vocab_size')}",
                )
            )
        hidden = draft.get("target_hidden_size") or draft.get("hidden_size")
        if hidden != target.get("hidden_size"):
            problems.append(
                Problem(
                    "--draft-model",
                    f"the draft reads target features of size {hidden}, the target's "
                    f"hidden_size is {target.get('hidden_size')}",
                )
            )
    return problems


SPEC = PluginSpec(
    name="eagle3",
    kind="speculative",
    summary="EAGLE-3: a one-layer draft over three tapped target layers, drafting a chain",
    implementation="outrider.plugins.speculative.eagle3_impl:Eagle3Worker",
    options=NoOptions,
    speculative=SpeculativeCapabilities(needs_draft_model=True, default_width=4),
    check=_check,
)
