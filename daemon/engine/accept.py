"""The accept rule of a speculative STEP (DESIGN.md 4.4).

At node ``j`` of a row (the root is node 0) the target's own choice ``y[j]`` is drawn with the
randomness counter of output index ``out_len + j``: exactly the draw that decoding without
speculation makes there. Chain accept takes drafts while ``draft[j] == y[j]``; with ``a``
accepted, ``commit_len = a + 1`` tokens ``y[0 .. a]`` are committed, the last being the bonus.
Deterministic drafts (argmax chains, n-gram, DFlash blocks) are therefore lossless by
construction: greedy and seeded sampled outputs equal the target-only outputs token for token,
and no draft probability is needed.
"""

from __future__ import annotations

import torch


def accept_chain(drafts: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``commit_len`` per row: 1 + the number of leading drafts equal to the target's choice
    at their parent node. drafts: [bs, W - 1]; target: [bs, W]. Returns [bs] int64."""
    matches = (drafts == target[:, :-1]).to(torch.int64)  # [bs, W - 1]
    return torch.cumprod(matches, dim=1).sum(dim=1) + 1


def step_reservation(width: int, max_commit: int, page_size: int) -> int:
    """KV positions a STEP may write past the host's bound on a row's committed length: the
    verify block plus one step's commit (overlap), page aligned."""
    need = width + max_commit
    return (need + page_size - 1) // page_size * page_size
