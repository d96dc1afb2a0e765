"""``dflash`` on the device: block drafting with the draft's own paged KV cache.

For every committed position the draft's KV holds context K/V materialised from the target's
tapped features (K and V only): after each EXTEND chunk for its positions, and after each
verify for the whole verified block (positions past the accepted ones are rewritten by later
steps before they are read). A decode batch drafts the block ``[root, MASK, ..., MASK]`` at
the root's position onwards in one non-causal forward: each block query sees the committed
context and the whole block. The target's LM head turns slots 1 .. B - 1 into the B - 1
drafts: the argmax for greedy rows; for sampled rows one draw per slot from that slot's own
processed distribution (``DraftOptions.sample``, sampled.py). Context K/V depend on target
features only, so prefix-cache pages carry valid draft KV. A step the engine cuts to ``d``
drafts (``DecodeView.drafts``) runs the block ``[root, MASK x d]``: shorter than the draft
was trained with, so its drafts may be accepted less often, and cheaper to draft and verify.

Under tensor parallelism the draft's layers are sharded as the target's (each rank holds its
heads' KV) and the head is the target's vocabulary-parallel one: greedy drafts are the
``vocab_argmax`` of each rank's logits slice, with no gather of the full logits.

Sampled blocks stay lossless although no slot sees the drafts before it: slot ``j``'s
distribution ``q_j`` is a function of the committed prefix alone, and its draft is drawn from
``q_j`` independently of the other slots' drafts given that prefix. The speculative sampling
argument needs only that draft ``j`` be drawn from the very ``q_j`` the verify divides by,
given the prefix and the drafts before it; a ``q_j`` that ignores those drafts is one such
distribution. So ``min(1, p_j / q_j)`` with the residual at the first rejection leaves every
committed token distributed as the target's (``rejection``), and the coupled draw's tokens are
the target's own draws whatever the drafts are (``coupled``).

Under a grammar (``DecodeView.guide``) the block's slots are chosen one after the other, slot
``j`` from its logits masked by the grammar after the drafts before it: ``q_j`` then depends on
those drafts, which the argument above allows as well. Where the slots take their argmax, each
slot's best ids go to the guide first (``DraftGuide.candidates``), which chooses on the host
the slots whose masked argmax is among them. A block guides its first slots only
(``DraftGuide.guided_places``, fewer in larger batches) and draws the rest as unconstrained:
their ``q_j`` ignore the drafts before them, as above.
"""

from __future__ import annotations

import torch

from outrider.plugins.device import ForwardBatch
from outrider.plugins.models.parallel import gather_vocab, vocab_argmax
from outrider.plugins.speculative.base import (
    Accepted,
    DecodeView,
    Drafts,
    ExtendView,
    SpeculativeWorker,
    WorkerContext,
)
from outrider.plugins.speculative.deferred import DeferredRows
from outrider.plugins.speculative.dflash import resolve_mask_token
from outrider.plugins.speculative.dflash_model import DFlashConfig, DFlashDraft, load_dflash
from outrider.plugins.speculative.draft_options import DraftOptions
from outrider.plugins.speculative.sampled import coupled_drafts, rejection_drafts


class DFlashWorker(SpeculativeWorker):
    cut_steps = True

    def __init__(self, ctx: WorkerContext, options: DraftOptions) -> None:
        super().__init__(ctx, options)
        config = DFlashConfig.from_pretrained(ctx.draft_model)
        mask_id = config.mask_token_id
        if mask_id is None and config.mask_token is not None:
            mask_id = resolve_mask_token(config.mask_token, ctx.model)
        if mask_id is None:
            raise ValueError(f"the DFlash draft's mask token {config.mask_token!r} is unknown")
        self.capture_layers = config.target_layer_ids
        self.model: DFlashDraft = load_dflash(
            ctx.draft_model,
            dtype=ctx.dtype,
            device=ctx.device,
            max_positions=ctx.max_positions,
            load_format="dummy" if ctx.load_format == "dummy" else "auto",
            tp=ctx.tp,
        )
        shape = self.model.attention_shape
        self.kv = self.allocate_kv(self.model.num_layers, shape)
        self.backend = ctx.make_backend("draft_decode", shape)
        self.block_offsets = torch.arange(self.shape.width, device=ctx.device)  # [B]
        # The block's input: the root, then the mask token in every other slot.
        self.block = torch.full(
            (ctx.max_slots, self.shape.width), mask_id, dtype=torch.int64,
            device=ctx.device,
        )  # fmt: skip
        # A plain step's row: the target's taps at the root, for its context K/V.
        self._defer_plain_steps(
            options.deferred_catch_up, keeps_tokens=False, taps_width=self.model.fc.in_features
        )

    def after_extend(self, view: ExtendView) -> None:
        self._materialize(view.fb)

    def defer_extend(self, view: ExtendView) -> None:
        self._deferred().fill(view.fb.layout, taps=self._taps(view.fb))

    def draft(self, view: DecodeView) -> Drafts:
        # A chain cut short runs a shorter block: its mask tokens see fewer places after
        # them than the draft was trained with, which may lower acceptance, never the tokens.
        bs, width = view.bs, view.drafts + 1
        block = self.block[:bs, :width]
        block[:, 0] = view.roots
        positions = view.starts.unsqueeze(1) + self.block_offsets[:width]  # [bs, B]
        layout = self.row_layout(view, positions, kv_end=width, causal=False)
        fb = ForwardBatch.bind(layout, self.backend, self.kv)
        hidden = self.model(self.ctx.embed(block.reshape(-1)), fb)  # [bs * B, H]
        drafted = hidden.view(bs, width, -1)[:, 1:].reshape(-1, hidden.shape[-1])
        local = self.ctx.local_lm_head(drafted)  # [bs * (B - 1), V / N]
        if view.guide is not None:
            return self._guided(view, local.view(bs, width - 1, -1))
        tokens, probs = self._choose(view, local, self.block_offsets[: width - 1])
        return Drafts(tokens, probs)

    def _choose(
        self, view: DecodeView, local: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafts ``[bs, n]`` at ``n`` places of each row (``local: [bs * n, V / N]``,
        place ``j`` drawing at ``out_len + offsets[j]``), and their ``q`` under
        ``rejection`` (else None)."""
        bs, mode = view.bs, self.options.sample
        if view.sampling.all_greedy or mode == "argmax":
            return vocab_argmax(local, self.ctx.tp).view(bs, -1), None
        # Sampled rows draw from whole processed distributions: gather the vocabulary, as the
        # target's sampling does (a mixed batch's greedy rows then take their argmax from it).
        logits = gather_vocab(local, self.ctx.tp)
        limit = self.ctx.vocab_limit
        if mode == "coupled":
            drafts = coupled_drafts(
                logits, view.sampling, view.out_lens, offsets, vocab_limit=limit
            )
            return drafts, None
        return rejection_drafts(logits, view.sampling, view.out_lens, offsets, vocab_limit=limit)

    def _guided(self, view: DecodeView, local: torch.Tensor) -> Drafts:
        """Under the view's guide (one rank): the block's first guided places one after the
        other, each masked by the grammar after the drafts before it, then the rest freely
        in one go (``DraftGuide.guided_places``). ``local: [bs, B - 1, V]``."""
        assert view.guide is not None
        bs, places = view.bs, local.shape[1]
        guided = view.guide.guided_places(bs, places)
        if view.sampling.all_greedy or self.options.sample == "argmax":
            count = min(view.guide.candidate_count(bs), local.shape[-1])
            if count:  # the host may choose the places whose masked argmax is among them
                view.guide.candidates(local[:, :guided].topk(count, dim=-1).indices)
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for place in range(guided):
            logits = local[:, place].contiguous()  # [bs, V]
            path = torch.cat(tokens, dim=1) if tokens else view.roots.new_empty(bs, 0)
            view.guide.restrict(logits, path)
            token, q = self._choose(view, logits, self.block_offsets[place : place + 1])
            tokens.append(token)
            if q is not None:
                probs.append(q)
        if guided < places:
            rest = local[:, guided:].reshape(bs * (places - guided), -1)
            token, q = self._choose(view, rest, self.block_offsets[guided:places])
            tokens.append(token)
            if q is not None:
                probs.append(q)
        return Drafts(torch.cat(tokens, dim=1), torch.cat(probs, dim=1) if probs else None)

    def after_accept(self, view: DecodeView, verify: ForwardBatch, accepted: Accepted) -> None:
        self._materialize(verify)

    def defer(self, view: DecodeView, verify: ForwardBatch, accepted: Accepted) -> None:
        self._deferred().append(view.slots, taps=self._taps(verify))

    def catch_up_deferred(self, rows: DeferredRows) -> None:
        _, taps = self._deferred().take(rows)
        assert taps is not None, "DFlash keeps the target's taps"
        self.model.materialize(taps, rows.layout(self.ctx.page_table, self.ctx.page_size), self.kv)

    def _materialize(self, fb: ForwardBatch) -> None:
        """Context K/V of ``fb``'s positions from the target's captured features."""
        self.model.materialize(self._taps(fb), fb.layout, self.kv)

    def _taps(self, fb: ForwardBatch) -> torch.Tensor:
        return torch.cat([fb.captured[layer] for layer in self.capture_layers], dim=-1)
