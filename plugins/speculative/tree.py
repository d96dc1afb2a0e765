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


def path_ranks(ranks: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """The worst rank on each accepted ``path`` [bs, M] (node indices, the root first) up to
    each of its drafts, from the nodes' ``ranks`` [bs, N] (``select_tree``): [bs, M - 1]. The
    tree cut to its best ``m`` nodes accepts the path's drafts whose entry is below ``m``
    (entries past a row's accepted drafts mean nothing)."""
    on_path = ranks.gather(1, (path[:, 1:] - 1).clamp(min=0))
    return on_path.cummax(dim=1).values


def select_tree(
    tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``size`` best candidates in generation order, as (``tokens`` [bs, size], node
    ``parents`` [bs, size], ``ranks`` [bs, size]: each node's place by score, 0 the best):
    node ``i`` (1-based, the root is 0) is column ``i - 1``. The best ``m`` nodes are those
    ranked below ``m``, the tree this one cut to ``m`` would select. ``tokens, scores,
    parents: [bs, C]``; a candidate's parent is a candidate index, or -1 for the root's
    children."""
    chosen, ranks = best(scores, size).sort(dim=1)  # [bs, size]: generation order
    node_of = torch.zeros_like(parents)  # candidate -> node index (0: not chosen)
    nodes = torch.arange(1, size + 1, device=tokens.device).expand_as(chosen)
    node_of.scatter_(1, chosen, nodes)
    parent = parents.gather(1, chosen)
    node_parents = torch.where(parent >= 0, node_of.gather(1, parent.clamp(min=0)), 0)
    return tokens.gather(1, chosen), node_parents, ranks
