"""The verify of a decode batch: the target's choice at every node, and what each row commits
by the chain, tree or sampled-draft rule (accept.py). Without drafts a row commits its root's
successor, the plain decode."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from outrider.daemon.engine.accept import accept_chain, accept_sampled, accept_tree
from outrider.daemon.engine.inputs import StepInputs
from outrider.daemon.engine.plan import StepPlan
from outrider.daemon.engine.results import StepResults
from outrider.daemon.engine.slots import RelayRows, SlotState
from outrider.plugins.api import StepShape
from outrider.plugins.device import KVCache, flat_kv_index
from outrider.plugins.sampling import (
    DRAW_SIMULATE,
    SampleResult,
    processed_probs,
    sample,
    token_logprobs,
    uniform_at,
)
from outrider.plugins.speculative.base import Drafts
from outrider.plugins.speculative.tree import path_ranks


@dataclass(frozen=True)
class Verified:
    sampled: SampleResult  # [bs * W]: the target's choice at every node, with its logprobs
    choices: torch.Tensor  # [bs, W] int64: the same choices per row
    commit_lens: torch.Tensor  # [bs] int64: 1 .. max_commit
    path: torch.Tensor  # [bs, max_commit] int64: the node of each committed token
    # A ranked tree's (``Drafts.ranks``): the worst rank by score on the accepted path up to
    # each accepted draft, [bs, max_commit - 1]; a tree cut to its best ``m`` nodes would
    # have accepted the drafts whose entry is below ``m``. None: a chain, or unranked.
    path_ranks: torch.Tensor | None = None

    def committed(self) -> torch.Tensor:
        """[bs, max_commit]: committed token ``j`` is the choice at node ``path[:, j]``."""
        return self.choices.gather(1, self.path)

    def results(self, committed: torch.Tensor) -> StepResults:
        """The step's results: ``committed`` (``committed()``) with the logprobs of the nodes
        along the path."""
        out, path = self.sampled, self.path
        (bs, width), max_commit, k = self.choices.shape, path.shape[1], out.top_ids.shape[-1]
        node = path.unsqueeze(2).expand(bs, max_commit, k)
        return StepResults(
            tokens=committed,
            commit_lens=self.commit_lens,
            logprob=out.logprob.view(bs, width).gather(1, path),
            top_ids=out.top_ids.view(bs, width, k).gather(1, node),
            top_logprobs=out.top_logprobs.view(bs, width, k).gather(1, node),
            path_ranks=self.path_ranks,
        )


class Verifier:
    def __init__(
        self,
        shape: StepShape,
        kv: KVCache,
        slots: SlotState,
        vocab_limit: int,
        device: torch.device,
        simulated: SimulatedAcceptance | None = None,
    ) -> None:
        """``simulated`` (benchmarks): commit lengths drawn instead of accepted."""
        self.shape = shape
        self.kv = kv
        self.slots = slots
        self.vocab_limit = vocab_limit
        self.offsets = torch.arange(shape.width, device=device)  # [W]
        self.simulated = simulated

    def verify(
        self,
        plan: StepPlan,
        step: StepShape,
        inputs: StepInputs[torch.Tensor],
        relay: RelayRows,
        drafts: Drafts,
        depth: torch.Tensor,
        logits: torch.Tensor,
        choose_from: torch.Tensor | None = None,
    ) -> Verified:
        """``step``: the step's shape (the engine's, or its chain cut short); ``inputs.input_ids``
        holds each row's verified tokens (root, drafts), ``depth: [bs, W]`` each node's depth
        and ``logits: [bs * W, V]`` the target's at every node (``choose_from``: as the
        requests adjusted them, penalties.py; None: unadjusted). A tree's accepted KV is moved
        to the front here."""
        bs, width, limit = plan.bs, step.width, self.vocab_limit
        batch = self.slots.sampling(inputs.token_slots, plan)  # per token
        path = self.offsets[: step.max_commit].expand(bs, -1)  # a chain: 0, 1, ..
        # A request's draft cap cuts its commit after the token at the cap: the target's own
        # there (its draw, or under the sampled rule the accepted draft or the residual's,
        # distributed as the target's), so every rule stays lossless.
        max_commit = self.slots.max_commit[inputs.slots]
        # Simulated commit lengths (benchmarks) decide rejection-sampled drafts' rows too.
        if drafts.probs is not None and self.simulated is None:
            chosen = logits if choose_from is None else choose_from
            target = processed_probs(chosen, batch, vocab_limit=limit).view(bs, width, -1)
            seed = self.slots.seed[inputs.slots]
            commit_lens, choices = accept_sampled(
                drafts.tokens, drafts.probs, target, seed, relay.out_lens
            )
            out = token_logprobs(logits, choices.view(-1), plan.max_logprobs, vocab_limit=limit)
            return Verified(out, choices, torch.minimum(commit_lens, max_commit), path)
        # The target's own draw at each node: output index out_len + depth.
        draws = (relay.out_lens.unsqueeze(1) + depth).view(-1)  # [bs * W]
        out = sample(logits, batch, draws, vocab_limit=limit, choose_from=choose_from)
        choices = out.tokens.view(bs, width)  # [bs, W]
        if self.simulated is not None:
            seed = self.slots.seed[inputs.slots]
            nodes = inputs.input_ids.view(bs, width)
            allowed = None if choose_from is None else allowed_drafts(choose_from, nodes, drafts)
            commit_lens, path = self.simulated.accept(drafts, step, seed, relay.out_lens, allowed)
            commit_lens = torch.minimum(commit_lens, max_commit)
            choices = self.simulated.commit_drafts(choices, nodes, path, commit_lens)
        elif drafts.parents is not None:
            commit_lens, path = accept_tree(
                drafts.tokens, drafts.parents, choices, step.max_commit - 1
            )
            commit_lens = torch.minimum(commit_lens, max_commit)
        else:
            tokens = inputs.input_ids.view(bs, width)
            commit_lens = accept_chain(tokens[:, 1:], choices)  # [bs]; 1 without drafts
            commit_lens = torch.minimum(commit_lens, max_commit)
        ranks = None
        if drafts.parents is not None:  # a tree
            self._compact(inputs.slots, relay.starts, path)
            if drafts.ranks is not None:
                ranks = path_ranks(drafts.ranks, path)
        return Verified(out, choices, commit_lens, path, ranks)

    def _compact(self, slots: torch.Tensor, starts: torch.Tensor, path: torch.Tensor) -> None:
        """Move the KV of a tree's accepted path (node ``path[:, j]`` at ``start +
        path[:, j]``) to ``start + j``, so that committed positions stay contiguous. Entries
        past a row's commit length move KV that is never read."""
        table, page_size = self.slots.page_table, self.kv.page_size
        rows, first = slots.unsqueeze(1), starts.unsqueeze(1)
        src = flat_kv_index(table, rows, first + path, page_size)
        dst = flat_kv_index(table, rows, first + self.offsets[: path.shape[1]], page_size)
        self.kv.move(src.view(-1), dst.view(-1))


class SimulatedAcceptance:
    """Debug, for benchmarks with dummy weights: each row accepts ``a`` drafts whatever the
    target says, drawn per row and step (counter-based uniforms from the row's seed and output
    count) so that the engine's whole shape commits ``mean`` tokens a verify on average (at
    most ``max_commit``). A chain accepts its first ``a`` drafts, each position in turn with
    one probability ``p`` until the first it refuses, so that a chain cut short accepts what
    the whole chain accepts of its positions, as drafts do; a tree accepts ``a`` (the mean's
    whole part or one more) along the path to its deepest node, so that a tree as deep as the
    mean commits it whatever its shape. Never past a draft its row's adjusted logits refuse (a
    grammar's mask). The committed tokens are the accepted drafts and the target's choice
    after them, so every step's work is the real one, a constrained output stays within its
    grammar, and only the outputs are meaningless."""

    def __init__(self, mean: float, shape: StepShape, device: torch.device) -> None:
        self.rate = position_rate(mean, shape.max_commit - 1)
        extra = min(mean, shape.max_commit) - 1
        self.whole, self.fraction = int(extra), extra - int(extra)
        self.nodes = torch.arange(shape.width, device=device)  # [W]
        self.positions = torch.arange(shape.max_commit - 1, device=device).unsqueeze(0)  # [1, D]

    def accept(
        self,
        drafts: Drafts,
        step: StepShape,
        seed: torch.Tensor,
        out_lens: torch.Tensor,
        allowed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(``commit_len`` [bs], ``path`` [bs, max_commit]), as accept.py's rules return, for
        a step of shape ``step`` (a chain cut short accepts no more than its drafts);
        ``allowed: [bs, W]`` (``allowed_drafts``; None: every node) bounds the path."""
        bs, max_depth = seed.shape[0], step.max_commit - 1
        u = uniform_at(seed, out_lens, DRAW_SIMULATE, self.positions[:, :max_depth].expand(bs, -1))
        if drafts.parents is None:
            accepted = (u < self.rate).to(torch.int64).cumprod(dim=1).sum(dim=1)  # [bs]
            if allowed is not None:  # the drafts before the first refused one
                accepted = torch.minimum(accepted, allowed[:, 1:].cumprod(dim=1).sum(dim=1))
            return accepted + 1, self.nodes[: max_depth + 1].expand(bs, -1)
        accepted = self.whole + (u[:, 0] < self.fraction).to(torch.int64)  # [bs]
        next_on_path = self._path_to_deepest(drafts.parents, max_depth)
        node = torch.zeros(bs, dtype=torch.int64, device=seed.device)
        path = [node]
        depth = torch.zeros_like(node)
        for d in range(max_depth):
            child = next_on_path.gather(1, node.unsqueeze(1)).squeeze(1)
            moves = (d < accepted) & (child != node)
            if allowed is not None:
                moves &= allowed.gather(1, child.unsqueeze(1)).squeeze(1)
            node = torch.where(moves, child, node)
            depth += moves
            path.append(node)
        return depth + 1, torch.stack(path, dim=1)

    def _path_to_deepest(self, parents: torch.Tensor, max_depth: int) -> torch.Tensor:
        """``[bs, W]``: each node's next on the path to the tree's deepest node (the lowest
        index among the deepest), the others themselves. Depths and the path in ``max_depth``
        steps of gathers over all nodes at once (a graph step's launches grow with the
        depth, not the size)."""
        bs, width = parents.shape[0], parents.shape[1] + 1
        nodes = self.nodes[:width].expand(bs, -1)
        parent = torch.cat([nodes[:, :1], parents], dim=1)  # [bs, W], the root its own
        depth = torch.zeros_like(parent)
        for _ in range(max_depth):
            depth = torch.where(nodes > 0, depth.gather(1, parent) + 1, 0)
        deepest = (depth * width + (width - 1 - nodes)).argmax(dim=1, keepdim=True)  # [bs, 1]
        next_of = nodes.clone()
        for _ in range(max_depth):  # up from the deepest node, each parent its child
            above = parent.gather(1, deepest)
            child = torch.where(deepest > 0, deepest, next_of.gather(1, above))
            next_of.scatter_(1, above, child)
            deepest = above
        return next_of

    def commit_drafts(
        self, choices: torch.Tensor, nodes: torch.Tensor, path: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor:
        """``choices: [bs, W]`` with each accepted node's choice replaced by the draft of the
        next node on ``path`` (``nodes: [bs, W]``: the verified tokens), so that the
        committed tokens are the accepted drafts, then the target's choice."""
        following = nodes.gather(1, path[:, 1:])  # [bs, max_commit - 1]
        accepted = self.nodes[1 : path.shape[1]] < lens.unsqueeze(1)  # j + 1 < commit_len
        kept = choices.gather(1, path[:, :-1])
        return choices.scatter(1, path[:, :-1], torch.where(accepted, following, kept))


def position_rate(mean: float, depth: int) -> float:
    """The probability ``p`` with which ``depth`` draft positions, each accepted with ``p``
    until the first refused, give a mean commit length of ``mean``: ``1 + p + .. + p^depth``
    (bisection; ``mean`` from 1 to ``depth + 1``, beyond: 1)."""
    if mean >= depth + 1:
        return 1.0
    if mean <= 1.0:
        return 0.0
    low, high = 0.0, 1.0
    for _ in range(60):
        p = (low + high) / 2
        if sum(p**j for j in range(depth + 1)) < mean:
            low = p
        else:
            high = p
    return (low + high) / 2


def allowed_drafts(choose: torch.Tensor, nodes: torch.Tensor, drafts: Drafts) -> torch.Tensor:
    """``[bs, W]`` bool: whether each node's token is allowed by its parent's adjusted logits
    (``choose: [bs * W, V]``; -inf: refused, as a grammar's mask sets); the root always."""
    bs, width = nodes.shape
    parents = (
        torch.arange(width - 1, device=nodes.device).expand(bs, -1)
        if drafts.parents is None
        else drafts.parents
    )  # [bs, W - 1]: each draft's parent node
    rows = (torch.arange(bs, device=nodes.device).unsqueeze(1) * width + parents).view(-1)
    allowed = choose[rows, nodes[:, 1:].reshape(-1)].view(bs, width - 1) > float("-inf")
    return torch.cat((torch.ones_like(allowed[:, :1]), allowed), dim=1)
