"""Reading a draft checkpoint in its public layout into a model (loaded in the daemon only)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from outrider.plugins.models.parallel import Split

log = logging.getLogger(__name__)


def read_safetensors(files: list[Path], device: torch.device) -> Iterable[tuple[str, torch.Tensor]]:
    """Every ``(name, tensor)`` of ``files``, one shard open at a time."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, shard.get_tensor(name)


def fill_public(
    what: str,
    dests: dict[str, torch.Tensor],
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    shared: frozenset[str] = frozenset(),
    optional: frozenset[str] = frozenset(),
    splits: Mapping[str, Split] | None = None,
) -> set[str]:
    """Copy public-layout ``(name, tensor)`` pairs into ``dests`` (name -> model tensor).
    ``splits``: the names whose dest holds the rank's cut only (tensor parallelism), and the
    cut; the whole tensor is read and cut (a draft is small). ``shared`` names (the target's
    own tensors) are skipped with a log line. Raises ValueError naming every unexpected,
    repeated or missing tensor, or the first of a wrong shape; the ``optional`` ones may be
    missing: returns those that are."""
    splits = splits or {}
    pending = set(dests)
    unexpected: list[str] = []
    for name, tensor in tensors:
        if name in shared:
            log.info("%s checkpoint: skipping %s (the target's is shared)", what, name)
            continue
        if name not in pending:
            unexpected.append(f"{name} (twice)" if name in dests else name)
            continue
        dest, split = dests[name], splits.get(name)
        expected = tuple(dest.shape) if split is None else split.full_shape(tuple(dest.shape))
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected {expected}"
            )
        dest.copy_(tensor if split is None else split.take(tensor, expected))
        pending.discard(name)
    problems = []
    if unexpected:
        problems.append(f"unexpected checkpoint tensors: {', '.join(sorted(unexpected))}")
    if pending - optional:
        problems.append(f"missing checkpoint tensors: {', '.join(sorted(pending - optional))}")
    if problems:
        raise ValueError(f"{what} draft: " + "; ".join(problems))
    return pending & optional
