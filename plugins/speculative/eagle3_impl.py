"""``eagle3`` on the device: an EAGLE-3 draft chain with its own paged KV cache.

Convention: the draft row at position ``t`` takes the token at ``t + 1`` and the target's
feature at ``t`` (``fc`` of the three tapped layers, output-of-layer convention) and predicts
the token at ``t + 2``. So after a target forward over positions ``s .. e - 1`` the draft can
fill its rows ``s .. e - 1`` once the token at ``e`` is known: the next chunk's first token,
the token sampled at the end of the prompt, or, after a verify, the bonus. The draft's KV at
positions below a row's KV length is then always final, and two per-slot relays carry the
drafting state: ``feat`` (the draft's output at the row of the last committed position) and
``next_draft`` (the first draft it predicts).

A prefix-cache hit gives its last page back (``prefix_margin_pages``): the draft's KV at the
last cached position was computed with the publishing request's next token.
"""

from __future__ import annotations

import dataclasses

import torch

from outrider.daemon.engine.forward import ForwardBatch
from outrider.plugins.api import NoOptions
from outrider.plugins.attention.base import AttentionBackend
from outrider.plugins.speculative.base import (
    Drafts,
    ExtendView,
    SpeculativeWorker,
    StepView,
    WorkerContext,
)
from outrider.plugins.speculative.eagle3_model import (
    Eagle3Config,
    Eagle3Draft,
    default_aux_layers,
    load_eagle3,
)


class Eagle3Worker(SpeculativeWorker):
    prefix_margin_pages = 1

    def __init__(self, ctx: WorkerContext, options: NoOptions) -> None:
        super().__init__(ctx, options)
        config = Eagle3Config.from_pretrained(ctx.draft_model)
        self.capture_layers = config.aux_layer_ids or default_aux_layers(ctx.target_layers)
        self.model: Eagle3Draft = load_eagle3(
            ctx.draft_model,
            dtype=ctx.dtype,
            device=ctx.device,
            max_positions=ctx.max_positions,
            load_format="dummy" if ctx.load_format == "dummy" else "auto",
        )
        shape = self.model.attention_shape
        self.kv = self.allocate_kv(1, shape)
        self.extend_backend = ctx.make_backend("draft_extend", shape)
        self.decode_backend = ctx.make_backend("draft_decode", shape)
        self.embed = ctx.embed
        hidden = config.model.hidden_size
        self.feat = torch.zeros(ctx.max_slots, hidden, dtype=ctx.dtype, device=ctx.device)
        self.next_draft = torch.zeros(ctx.max_slots, dtype=torch.int64, device=ctx.device)

    # --- EXTEND --------------------------------------------------------------------------

    def after_extend(self, view: ExtendView) -> None:
        fb = view.fb
        feats = self._features(fb)  # [T, H]
        # Each position takes the token after it: the row's next input, and at the row's
        # end the token after the chunk.
        tokens = torch.roll(view.input_ids, -1)
        last = fb.q_start[1:] - 1  # [bs]: each row's last token
        tokens[last] = view.next_tokens
        y = self._run(tokens, feats, fb, self.extend_backend)  # [T, H]
        ended = y[last[view.sample_rows]]  # [n, H]: rows whose chunk ended the prompt
        self._seed(view.sample_slots, ended)

    # --- STEP ----------------------------------------------------------------------------

    def draft(self, view: StepView) -> Drafts:
        bs = view.bs
        token = self.next_draft[view.slots]  # [bs]: d1, from the last catch-up
        feat = self.feat[view.slots]  # [bs, H]
        drafts = [token]
        for k in range(1, self.width - 1):
            # d_k sits at seq + k; its draft row is the position before.
            positions = view.seq_lens + (k - 1)
            fb = self.one_token_batch(view, positions, self.kv, self.decode_backend)
            feat = self._run(token, feat, fb, self.decode_backend)  # [bs, H]
            token = self._predict(feat)
            drafts.append(token)
        return Drafts(torch.stack(drafts, dim=1).view(bs, self.width - 1))

    def after_accept(
        self,
        view: StepView,
        verify: ForwardBatch,
        committed: torch.Tensor,
        commit_lens: torch.Tensor,
    ) -> None:
        # Row j of a slot (position seq + j) takes committed[j], the token at seq + 1 + j, and
        # the target's feature at seq + j; rows past the accepted ones are rewritten later.
        y = self._run(committed.view(-1), self._features(verify), verify, self.extend_backend)
        last = self.row_ids[: view.bs] * self.width + commit_lens - 1  # the bonus's row
        self._seed(view.slots, y[last])

    # --- helpers -------------------------------------------------------------------------

    def _features(self, fb: ForwardBatch) -> torch.Tensor:
        taps = [fb.captured[layer] for layer in self.capture_layers]
        return self.model.project(torch.cat(taps, dim=-1))

    def _run(
        self,
        tokens: torch.Tensor,
        feats: torch.Tensor,
        geometry: ForwardBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """The draft over ``tokens`` at ``geometry``'s positions, into its own KV."""
        fb = dataclasses.replace(
            geometry, kv=self.kv, backend=backend, capture_layers=(), captured={}
        )
        fb.backend.prepare(fb)
        return self.model(self.embed(tokens), feats, fb)

    def _predict(self, y: torch.Tensor) -> torch.Tensor:
        """The draft's greedy next token (target ids) from its outputs ``y: [n, H]``."""
        return self.model.to_target_ids(self.model.compute_logits(y).argmax(dim=-1))

    def _seed(self, slots: torch.Tensor, y: torch.Tensor) -> None:
        """The drafting state of ``slots`` from the draft's output at their last committed
        position."""
        self.feat.index_copy_(0, slots, y)
        self.next_draft.index_copy_(0, slots, self._predict(y))
