"""The embedded model family: the ``outrider-family`` distribution (built from ``family/`` in
this repository) holds a tiny target and its drafts. Without ``--model`` the daemon serves it:
the target with DFlash speculation; ``--speculative-algorithm eagle3`` takes the embedded
EAGLE-3 draft, ``none`` turns speculation off, and every flag can still be overridden.
Requests that leave sampling values out get the target's generation_config.json values."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PACKAGE = "outrider_family"
DEFAULT_ALGORITHM = "dflash"


@dataclass(frozen=True)
class Family:
    target: Path
    drafts: Mapping[str, Path]  # speculative algorithm -> its draft directory


def embedded_family() -> Family | None:
    """The installed family's directories, or None when the package is not installed. The
    package is data only: nothing of it is imported."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    drafts = {
        name: root / name
        for name in ("dflash", "eagle3")
        if (root / name / "config.json").is_file()
    }
    return Family(root / "target", drafts)


def family_defaults(values: Mapping[str, Any]) -> dict[str, Any] | None:
    """The settings that make ``values`` (the flags given, without ``model``) serve the
    embedded family; None when it is not installed."""
    family = embedded_family()
    if family is None:
        return None
    algorithm = values.get("speculative_algorithm", DEFAULT_ALGORITHM)
    defaults: dict[str, Any] = {"model": str(family.target), "speculative_algorithm": algorithm}
    if "draft_model" not in values and algorithm in family.drafts:
        defaults["draft_model"] = str(family.drafts[algorithm])
    # NOTE: --generation-config keeps its default, auto: the target's generation_config.json
    # holds sampling defaults chosen by measurement (benchmarks/family_generation.py), and the
    # recipe's export writes the same values (recipe/model.py, GENERATION_DEFAULTS).
    return defaults
