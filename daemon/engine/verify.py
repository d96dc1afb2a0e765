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


@dataclass(frozen=True)
class Verified:
    sampled: SampleResult  # [bs * W]: the target's choice at every node, with its logprobs
    choices: torch.Tensor  # [bs, W] int64: the same choices per row
    commit_lens: torch.Tensor  # [bs] int64: 1 .. max_commit
    path: torch.Tensor  # [bs, max_commit] int64: the node of each committed token

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
        inputs: StepInputs[torch.Tensor],
        relay: RelayRows,
        drafts: Drafts,
        depth: torch.Tensor,
        logits: torch.Tensor,
        choose_from: torch.Tensor | None = None,
    ) -> Verified:
        """``inputs.input_ids`` holds each row's verified tokens (root, drafts), ``depth:
        [bs, W]`` each node's depth and ``logits: [bs * W, V]`` the target's at every node
        (``choose_from``: as the requests adjusted them, penalties.py; None: unadjusted). A
        tree's accepted KV is moved to the front here."""
        bs, width, limit = plan.bs, self.shape.width, self.vocab_limit
        batch = self.slots.sampling(inputs.token_slots, plan)  # per token
        path = self.offsets[: self.shape.max_commit].expand(bs, -1)  # a chain: 0, 1, ..
        if drafts.probs is not None:
            chosen = logits if choose_from is None else choose_from
            target = processed_probs(chosen, batch, vocab_limit=limit).view(bs, width, -1)
            seed = self.slots.seed[inputs.slots]
            commit_lens, choices = accept_sampled(
                drafts.tokens, drafts.probs, target, seed, relay.out_lens
            )
            out = token_logprobs(logits, choices.view(-1), plan.max_logprobs, vocab_limit=limit)
            return Verified(out, choices, commit_lens, path)
        # The target's own draw at each node: output index out_len + depth.
        draws = (relay.out_lens.unsqueeze(1) + depth).view(-1)  # [bs * W]
        out = sample(logits, batch, draws, vocab_limit=limit, choose_from=choose_from)
        choices = out.tokens.view(bs, width)  # [bs, W]
        if self.simulated is not None:
            seed = self.slots.seed[inputs.slots]
            commit_lens, path = self.simulated.accept(drafts, seed, relay.out_lens)
            if drafts.parents is not None:
                self._compact(inputs.slots, relay.starts, path)
        elif drafts.parents is not None:
            commit_lens, path = accept_tree(
                drafts.tokens, drafts.parents, choices, self.shape.max_commit - 1
            )
            self._compact(inputs.slots, relay.starts, path)
        else:
            tokens = inputs.input_ids.view(bs, width)
            commit_lens = accept_chain(tokens[:, 1:], choices)  # [bs]; 1 without drafts
        return Verified(out, choices, commit_lens, path)

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
    """Debug, for benchmarks with dummy weights: each row accepts ``a`` drafts whatever they
    are, ``a`` drawn per row and step (counter-based, from the row's seed and output count)
    so that the mean commit length is ``mean`` (at most ``max_commit``). A chain accepts its
    first ``a`` drafts, a tree the first child at each depth; the committed tokens are the
    target's choices along that path, so every step's work is the real one and only the
    outputs are meaningless."""

    def __init__(self, mean: float, shape: StepShape, device: torch.device) -> None:
        extra = min(mean, shape.max_commit) - 1
        self.whole, self.fraction = int(extra), extra - int(extra)
        self.max_depth = shape.max_commit - 1
        self.nodes = torch.arange(shape.width, device=device)  # [W]
        self.no_ids = torch.zeros(1, 1, dtype=torch.int64, device=device)

    def accept(
        self, drafts: Drafts, seed: torch.Tensor, out_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(``commit_len`` [bs], ``path`` [bs, max_commit]), as accept.py's rules return."""
        bs = seed.shape[0]
        u = uniform_at(seed, out_lens, DRAW_SIMULATE, self.no_ids.expand(bs, 1)).squeeze(1)
        accepted = self.whole + (u < self.fraction).to(torch.int64)  # [bs]
        if drafts.parents is None:
            return accepted + 1, self.nodes[: self.max_depth + 1].expand(bs, -1)
        width = self.nodes.shape[0]
        # Each node's first child (the lowest index whose parent it is); a leaf: itself.
        first = torch.full((bs, width), width, dtype=torch.int64, device=seed.device)
        first.scatter_reduce_(1, drafts.parents, self.nodes[1:].expand(bs, -1), "amin")
        first = torch.where(first < width, first, self.nodes)
        node = torch.zeros(bs, dtype=torch.int64, device=seed.device)
        path = [node]
        depth = torch.zeros_like(node)
        for d in range(self.max_depth):
            child = first.gather(1, node.unsqueeze(1)).squeeze(1)
            moves = (d < accepted) & (child != node)
            node = torch.where(moves, child, node)
            depth += moves
            path.append(node)
        return depth + 1, torch.stack(path, dim=1)
