"""``ngram`` on the device: every row's history is read from a token table laid out like the
KV pool, so drafting needs no host tokens and no sync.

The table holds, at each flat KV index, the token whose K/V is there. Invariant: for a slot
with KV length ``seq``, positions ``0 .. seq - 1`` hold the row's committed tokens, and the
root (position ``seq``) is in the relay. EXTEND writes its input tokens; a decode batch writes
its whole verify block (root and drafts at ``seq .. seq + W - 1``) after the accept. Entries
past the new KV length hold rejected drafts and are rewritten by the next decode batch before
any read.
Prefix-cache pages carry their tokens with them, since the request that computed a page wrote
them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from outrider.plugins.api import StepShape
from outrider.plugins.device import ForwardBatch, flat_kv_index
from outrider.plugins.speculative.base import (
    Accepted,
    DecodeView,
    Drafts,
    ExtendView,
    SpeculativeWorker,
    WorkerContext,
)
from outrider.plugins.speculative.ngram import NgramOptions


class NgramWorker(SpeculativeWorker):
    cut_steps = True

    @classmethod
    def draft_logit_rows(cls, shape: StepShape) -> int:
        return 0  # drafts are read from the history: no logits

    def __init__(self, ctx: WorkerContext, options: NgramOptions) -> None:
        super().__init__(ctx, options)
        self.max_match = options.max_match
        self.min_match = options.min_match
        window = options.window
        self.tokens = torch.full(
            (ctx.num_pages * ctx.page_size,), -1, dtype=torch.int64, device=ctx.device
        )
        self.window_offsets = torch.arange(1 - window, 1, device=ctx.device)  # [window]
        self.candidate_ends = torch.arange(window - 1, device=ctx.device)  # [window - 1]
        self.draft_offsets = torch.arange(1, self.shape.width, device=ctx.device)  # [W - 1]
        self.block_offsets = torch.arange(self.shape.width, device=ctx.device)  # [W]

    def after_extend(self, view: ExtendView) -> None:
        self.tokens.index_copy_(0, view.fb.layout.out_loc, view.input_ids)

    def draft(self, view: DecodeView) -> Drafts:
        history = self._history(view)  # [bs, window]
        end, found = self._latest_longest_match(history)  # [bs], [bs]
        last = history.shape[1] - 1
        # The tokens after the match; past the root the history ends: repeat the root.
        offsets = self.draft_offsets[: view.drafts]
        index = (end.unsqueeze(1) + offsets).clamp_(max=last)  # [bs, W - 1]
        drafts = history.gather(1, index)
        # NOTE: the table of a row that does not feed it (the drafting policy's unfed rows,
        # which a mixed batch drafts for) holds -1 or stale tokens: never draft a -1.
        keep = found.unsqueeze(1) & (drafts >= 0)
        return Drafts(torch.where(keep, drafts, view.roots.unsqueeze(1)))

    def after_accept(self, view: DecodeView, verify: ForwardBatch, accepted: Accepted) -> None:
        # Committed token j sits at position seq + 1 + j; the block starts with the root (a
        # plain step's block is the root alone).
        block = torch.cat([view.roots.unsqueeze(1), accepted.tokens[:, :-1]], dim=1)  # [bs, m]
        positions = view.starts.unsqueeze(1) + self.block_offsets[: block.shape[1]]  # [bs, m]
        self.tokens.index_copy_(0, self._flat_index(view, positions).view(-1), block.view(-1))

    def _flat_index(self, view: DecodeView, positions: torch.Tensor) -> torch.Tensor:
        """Flat table index of ``positions`` [bs, n] (>= 0) of each row's slot."""
        table, page_size = self.ctx.page_table, self.ctx.page_size
        return flat_kv_index(table, view.slots.unsqueeze(1), positions, page_size)

    def _history(self, view: DecodeView) -> torch.Tensor:
        """The last ``window`` tokens of each row, the root last; -1 before the text."""
        positions = view.starts.unsqueeze(1) + self.window_offsets  # [bs, window]
        valid = positions >= 0
        tokens = self.tokens[self._flat_index(view, positions.clamp(min=0))]
        history = torch.where(valid, tokens, -1)
        history[:, -1] = view.roots
        return history

    def _latest_longest_match(self, history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For each row, the end ``i`` (< window - 1) of the earlier occurrence of the
        longest suffix (``min_match`` to ``max_match`` tokens), latest first; and whether one
        exists."""
        window = history.shape[1]
        ends = history[:, :-1]  # [bs, window - 1]: the token at each candidate end
        length = torch.zeros_like(ends)
        alive = torch.ones_like(ends, dtype=torch.bool)
        for k in range(self.max_match):
            # The token k before each candidate end, against the suffix's k-th last token.
            earlier = F.pad(ends[:, : window - 1 - k], (k, 0), value=-1)
            alive &= (earlier == history[:, window - 1 - k : window - k]) & (earlier >= 0)
            length += alive
        score = torch.where(length >= self.min_match, length * window + self.candidate_ends, -1)
        best = score.argmax(dim=1)  # [bs]
        found = score.gather(1, best.unsqueeze(1)).squeeze(1) >= 0
        return best, found
