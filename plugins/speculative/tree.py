"""Top-K draft trees (EAGLE family): choosing the frontier and the verified nodes.

A drafter scores candidates by cumulative log-probability along their path. Step 0 yields
the ``K`` best tokens after the root; each later step expands the ``K`` frontier nodes by
their ``K`` best children and keeps the best ``K`` of those ``K * K`` as the next frontier.
Candidates are numbered in generation order, so a parent's index is below its children's.

Ties are broken by candidate index: since a child scores at most its parent (log-probs are
<= 0), the best ``n`` candidates then always include each chosen node's parent, so the
verified tree is ancestor-closed.
"""

from __future__ import annotations

import torch


def best(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the ``n`` highest ``scores`` along the last dimension, best first, equal
    scores in index order. ``scores: [..., C]`` -> ``[..., n]`` int64."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :n]


def select_tree(
    tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``size`` best candidates in generation order, as (``tokens`` [bs, size], node
    ``parents`` [bs, size]): node ``i`` (1-based, the root is 0) is column ``i - 1``.
    ``tokens, scores, parents: [bs, C]``; a candidate's parent is a candidate index, or -1
    for the root's children."""
    chosen = best(scores, size).sort(dim=1).values  # [bs, size]: generation order
    node_of = torch.zeros_like(parents)  # candidate -> node index (0: not chosen)
    nodes = torch.arange(1, size + 1, device=tokens.device).expand_as(chosen)
    node_of.scatter_(1, chosen, nodes)
    parent = parents.gather(1, chosen)
    node_parents = torch.where(parent >= 0, node_of.gather(1, parent.clamp(min=0)), 0)
    return tokens.gather(1, chosen), node_parents
