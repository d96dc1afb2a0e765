"""The verify of a decode batch: the target's choice at every node, and what each row commits
by the chain, tree or sampled-draft rule (accept.py). Without drafts a row commits its root's
successor, the plain decode."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from outrider.daemon.engine.accept import accept_chain, accept_sampled, accept_tree
from outrider.daemon.engine.inputs import StepInputs
from outrider.daemon.engine.plan import StepPlan
from outrider.daemon.engine.slots import RelayRows, SlotState
from outrider.plugins.api import StepShape
from outrider.plugins.device import KVCache, flat_kv_index
from outrider.plugins.sampling import SampleResult, processed_probs, sample, token_logprobs
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


class Verifier:
    def __init__(
        self,
        shape: StepShape,
        kv: KVCache,
        slots: SlotState,
        vocab_limit: int,
        device: torch.device,
    ) -> None:
        self.shape = shape
        self.kv = kv
        self.slots = slots
        self.vocab_limit = vocab_limit
        self.offsets = torch.arange(shape.width, device=device)  # [W]

    def verify(
        self,
        plan: StepPlan,
        inputs: StepInputs[torch.Tensor],
        relay: RelayRows,
        drafts: Drafts,
        depth: torch.Tensor,
        logits: torch.Tensor,
    ) -> Verified:
        """``inputs.input_ids`` holds each row's verified tokens (root, drafts), ``depth:
        [bs, W]`` each node's depth and ``logits: [bs * W, V]`` the target's at every node. A
        tree's accepted KV is moved to the front here."""
        bs, width, limit = plan.bs, self.shape.width, self.vocab_limit
        batch = self.slots.sampling(inputs.token_slots, plan)  # per token
        path = self.offsets[: self.shape.max_commit].expand(bs, -1)  # a chain: 0, 1, ..
        if drafts.probs is not None:
            target = processed_probs(logits, batch, vocab_limit=limit).view(bs, width, -1)
            seed = self.slots.seed[inputs.slots]
            commit_lens, choices = accept_sampled(
                drafts.tokens, drafts.probs, target, seed, relay.out_lens
            )
            out = token_logprobs(logits, choices.view(-1), plan.max_logprobs, vocab_limit=limit)
            return Verified(out, choices, commit_lens, path)
        # The target's own draw at each node: output index out_len + depth.
        draws = (relay.out_lens.unsqueeze(1) + depth).view(-1)  # [bs * W]
        out = sample(logits, batch, draws, vocab_limit=limit)
        choices = out.tokens.view(bs, width)  # [bs, W]
        if drafts.parents is not None:
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
