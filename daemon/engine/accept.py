"""The accept rule of a speculative decode batch (ARCHITECTURE.md 4.4).

At node ``j`` of a row (the root is node 0) the target's own choice ``y[j]`` is drawn with the
randomness counter of output index ``out_len + j``: exactly the draw that decoding without
speculation makes there. Chain accept takes drafts while ``draft[j] == y[j]``; with ``a``
accepted, ``commit_len = a + 1`` tokens ``y[0 .. a]`` are committed, the last being the bonus.
In a tree the node of depth ``d`` draws at ``out_len + d`` (siblings share the draw), and the
walk moves to the child equal to ``y`` at the current node. Deterministic drafts (argmax
chains, top-K trees, n-gram, DFlash blocks) are therefore lossless by construction: greedy and
seeded sampled outputs equal the target-only outputs token for token, and no draft
probability is needed.

A draft that truly samples (token ``x_j`` drawn from ``q_j``) goes through ``accept_sampled``
instead: ``x_j`` is kept with probability ``min(1, p_j(x_j) / q_j(x_j))``, the first rejected
node draws from ``normalize(max(0, p_j - q_j))``, and when every draft is kept the last node
draws from ``p``. Each committed token is then distributed as the target's, but seeded outputs
no longer equal the target-only ones. With greedy rows ``p`` and ``q`` are one-hot and the rule
is the greedy walk. Using a deterministic draft's softmax as ``q`` is NOT lossless.
"""

from __future__ import annotations

import torch

from outrider.plugins.sampling import DRAW_ACCEPT, DRAW_RESIDUAL, sample_probs, uniform_at


def accept_chain(drafts: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``commit_len`` per row: 1 + the number of leading drafts equal to the target's choice
    at their parent node. drafts: [bs, W - 1]; target: [bs, W]. Returns [bs] int64."""
    matches = (drafts == target[:, :-1]).to(torch.int64)  # [bs, W - 1]
    return torch.cumprod(matches, dim=1).sum(dim=1) + 1


def tree_geometry(parents: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``depth`` [bs, W], ``visible`` [bs, W, W]) of trees given by ``parents`` [bs, W - 1]
    (node ``i``'s parent at column ``i - 1``, the root is node 0): ``visible[b, i, j]`` when
    node ``j`` is ``i`` or one of its ancestors. ``max_depth`` bounds every node's depth."""
    bs, width = parents.shape[0], parents.shape[1] + 1
    root = torch.zeros(bs, 1, dtype=parents.dtype, device=parents.device)
    parent = torch.cat([root, parents], dim=1)  # [bs, W]; the root is its own parent
    node = torch.arange(width, device=parents.device).expand(bs, width)
    visible = torch.eye(width, dtype=torch.bool, device=parents.device).repeat(bs, 1, 1)
    for _ in range(max_depth):
        node = parent.gather(1, node)
        visible.scatter_(2, node.unsqueeze(2), True)
    return visible.sum(dim=2) - 1, visible


def check_tree(drafts: torch.Tensor, parents: torch.Tensor) -> None:
    """Debug (syncs the host): every node's parent comes before it, and siblings carry
    distinct tokens. drafts, parents: [bs, W - 1]."""
    nodes = torch.arange(1, parents.shape[1] + 1, device=parents.device)
    if not bool(((parents >= 0) & (parents < nodes)).all()):
        raise AssertionError(f"a tree node's parent does not come before it: {parents.tolist()}")
    same = (parents.unsqueeze(2) == parents.unsqueeze(1)) & (
        drafts.unsqueeze(2) == drafts.unsqueeze(1)
    )  # [bs, W - 1, W - 1]
    if int(same.sum()) != same.shape[0] * same.shape[1]:  # only the diagonal
        raise AssertionError(f"tree siblings share a token: {drafts.tolist()}")


def accept_tree(
    drafts: torch.Tensor, parents: torch.Tensor, target: torch.Tensor, max_depth: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``commit_len`` [bs], ``path`` [bs, max_depth + 1]) of a tree: from the root, move to
    the child whose token equals the target's choice at the current node, while one does
    (siblings carry distinct tokens, so at most one does). ``path[:, j]`` is the node of
    depth ``j`` on the accepted path (entries past ``commit_len`` repeat the last).
    drafts, parents: [bs, W - 1] (node ``i`` is column ``i - 1``); target: [bs, W]."""
    bs = drafts.shape[0]
    node = torch.zeros(bs, dtype=torch.int64, device=drafts.device)
    path = [node]
    alive = torch.ones(bs, dtype=torch.bool, device=drafts.device)
    accepted = torch.zeros_like(node)
    for _ in range(max_depth):
        want = target.gather(1, node.unsqueeze(1))  # [bs, 1]
        match = (parents == node.unsqueeze(1)) & (drafts == want)  # [bs, W - 1]
        alive = alive & match.any(dim=1)
        node = torch.where(alive, match.to(torch.int8).argmax(dim=1) + 1, node)
        accepted += alive
        path.append(node)
    return accepted + 1, torch.stack(path, dim=1)


def step_reservation(kv_span: int, max_commit: int, page_size: int) -> int:
    """KV positions a decode batch may write past the host's bound on a row's committed length: its
    span (the verify block, or a tree drafter's node slots) plus one step's commit
    (overlap), page aligned."""
    need = kv_span + max_commit
    return (need + page_size - 1) // page_size * page_size


def accept_sampled(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    seed: torch.Tensor,
    out_len: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``commit_len`` [bs], committed tokens [bs, W]) for drafts sampled from
    ``draft_probs``. drafts: [bs, W - 1]; draft_probs: [bs, W - 1, V]; target_probs: [bs, W, V]
    (processed as the requests sample); seed, out_len: [bs] (node j draws at output index
    ``out_len + j``)."""
    bs, width, vocab = target_probs.shape
    offsets = torch.arange(width, device=drafts.device)
    positions = out_len.unsqueeze(1) + offsets  # [bs, W]
    index = drafts.unsqueeze(-1)
    p_x = target_probs[:, :-1].gather(-1, index).squeeze(-1)  # [bs, W - 1]
    q_x = draft_probs.gather(-1, index).squeeze(-1)
    seeds = seed.unsqueeze(1).expand(bs, width - 1).reshape(-1)
    u = uniform_at(seeds, positions[:, :-1].reshape(-1), DRAW_ACCEPT, drafts.reshape(-1, 1))
    kept = (u.view(bs, width - 1) * q_x <= p_x).to(torch.int64)
    accepted = torch.cumprod(kept, dim=1).sum(dim=1)  # [bs]
    residual = (target_probs[:, :-1] - draft_probs).clamp_(min=0)
    mass = residual.sum(-1, keepdim=True)
    # Zero mass only where p == q, where nothing is ever rejected: any row does.
    residual = torch.where(mass > 0, residual / mass, target_probs[:, :-1])
    dists = torch.cat([residual, target_probs[:, -1:]], dim=1)  # [bs, W, V]
    replacement = sample_probs(
        dists.view(-1, vocab), seed.repeat_interleave(width), positions.reshape(-1), DRAW_RESIDUAL
    ).view(bs, width)
    padded = torch.cat([drafts, drafts[:, -1:]], dim=1)  # [bs, W]
    committed = torch.where(offsets < accepted.unsqueeze(1), padded, replacement)
    return accepted + 1, committed
