"""Light checks of a draft model's config.json against the target's (no torch): what the
specs of draft-model plugins share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from outrider.plugins.api import CheckContext, Problem
from outrider.plugins.models.config import TENSOR_PARALLEL_FLAG, tensor_parallel_problems

DRAFT_FLAG = "--draft-model"


def read_config(path: str) -> dict[str, Any] | None:
    """A model directory's (or config.json path's) config; None when unreadable."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        loaded = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


def tokenizer_vocab(path: str) -> dict[str, int] | None:
    """The token -> id map of a model's tokenizer.json (added tokens included); None when
    the model has no readable tokenizer.json."""
    directory = Path(path)
    if not directory.is_dir():
        directory = directory.parent
    try:
        data = json.loads((directory / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    vocab: dict[str, int] = dict(data.get("model", {}).get("vocab", {}))
    vocab.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
    return vocab


def check_draft(
    name: str, architecture: str, ctx: CheckContext
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, list[Problem]]:
    """(draft config, target config, problems): the draft is readable, has
    ``architecture`` and the target's vocabulary. Either config is None when unreadable."""
    if not ctx.draft_model:
        return None, None, []
    draft = read_config(ctx.draft_model)
    if draft is None:
        return None, None, [Problem(DRAFT_FLAG, f"no readable config.json at {ctx.draft_model}")]
    problems = []
    architectures = draft.get("architectures") or []
    if architecture not in architectures:
        problems.append(
            Problem(DRAFT_FLAG, f"{name} needs a {architecture} draft, not {architectures}")
        )
    target = read_config(ctx.model) if ctx.model else None
    if target is not None and draft.get("vocab_size") != target.get("vocab_size"):
        problems.append(
            Problem(
                DRAFT_FLAG,
                f"the draft's vocab_size {draft.get('vocab_size')} is not the target's "
                f"{target.get('vocab_size')}",
            )
        )
    return draft, target, problems


def feature_size_problem(draft: dict[str, Any], target: dict[str, Any] | None) -> list[Problem]:
    """The draft reads target features of ``target_hidden_size`` (default its hidden size)."""
    if target is None:
        return []
    hidden = draft.get("target_hidden_size") or draft.get("hidden_size")
    if hidden == target.get("hidden_size"):
        return []
    return [
        Problem(
            DRAFT_FLAG,
            f"the draft reads target features of size {hidden}, the target's hidden_size is "
            f"{target.get('hidden_size')}",
        )
    ]


# What tensor parallelism divides in every decoder layer (as ModelConfig.layer_shares).
_LAYER_KEYS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def sharding_problems(
    draft: dict[str, Any], ctx: CheckContext, whose: str, vocab_key: str = ""
) -> list[Problem]:
    """What keeps a draft of config.json ``draft`` from being sharded as the target is, over
    ``ctx.tensor_parallel_size`` ranks: its layers' heads, KV heads and MLP rows, and its own
    head's vocabulary ``vocab_key`` when it has one (a draft that shares the target's head has
    none). The same rule as the draft's build, refused before anything loads."""
    keys = (*_LAYER_KEYS, vocab_key) if vocab_key else _LAYER_KEYS
    shares = {key: draft[key] for key in keys if key in draft}
    size = ctx.tensor_parallel_size
    found = tensor_parallel_problems(shares, size, whose, vocab_key or "vocab_size")
    flag = f"{TENSOR_PARALLEL_FLAG} "
    return [Problem(TENSOR_PARALLEL_FLAG, message.removeprefix(flag)) for message in found]
