"""``standalone`` on the device: a small causal LM drafts a chain, with its own paged KV cache
at the target's positions.

The draft's KV at position p holds its K/V of the token at p, exactly as the target's does, so
it depends on the prefix tokens only: prefix-cache pages carry valid draft KV. Greedy rows
draft the argmax; sampled rows draw from the draft's processed distribution as
``DraftOptions.sample`` says (sampled.py). EXTEND runs the draft over the chunk. A decode
batch feeds the root and each draft in turn (positions ``seq .. seq + S - 1``); accepted
drafts are the committed tokens, so after the accept the draft's KV is final up to
``seq + a - 1``, and one more token (the last accepted one, at ``seq + a``) completes it; that
rewrite is idempotent unless all ``S`` drafts were accepted.

Under tensor parallelism the draft model is sharded as the target (``load_model`` with the
rank's ``tp``): greedy drafts are the ``vocab_argmax`` of each rank's logits slice, sampled
ones gather the draft's vocabulary.
"""

from __future__ import annotations

import torch

from outrider.plugins.device import DRAW_DRAFT, ForwardBatch, processed_probs, sample_probs
from outrider.plugins.models.config import ModelConfig, tensor_parallel_problems
from outrider.plugins.models.layers import DecoderForCausalLM
from outrider.plugins.models.loader import load_model
from outrider.plugins.models.parallel import vocab_argmax
from outrider.plugins.speculative.base import (
    Accepted,
    DecodeView,
    Drafts,
    ExtendView,
    SpeculativeWorker,
    WorkerContext,
)
from outrider.plugins.speculative.deferred import DeferredRows
from outrider.plugins.speculative.draft_options import DraftOptions
from outrider.plugins.speculative.sampled import coupled_scores


class StandaloneWorker(SpeculativeWorker):
    cut_steps = True

    def __init__(self, ctx: WorkerContext, options: DraftOptions) -> None:
        super().__init__(ctx, options)
        draft = ModelConfig.from_pretrained(ctx.draft_model)
        shares = draft.layer_shares | {"vocab_size": draft.vocab_size}
        problems = tensor_parallel_problems(shares, ctx.tp.size, "the standalone draft's")
        if problems:
            raise ValueError("; ".join(problems))
        self.model: DecoderForCausalLM
        self.model, config = load_model(
            ctx.draft_model,
            dtype=ctx.dtype,
            device=ctx.device,
            load_format="dummy" if ctx.load_format == "dummy" else "auto",
            max_positions=ctx.max_positions,
            tp=ctx.tp,
            label="standalone draft",
        )
        shape = self.model.attention_shape
        self.kv = self.allocate_kv(config.num_layers, shape)
        self.extend_backend = ctx.make_backend("draft_extend", shape)
        self.decode_backend = ctx.make_backend("draft_decode", shape)
        # Draft logits in the target's width; ids from the vocabulary limit on stay -inf.
        self.logits = torch.full(
            (ctx.max_slots, ctx.logits_width), float("-inf"), device=ctx.device
        )
        self.vocab_ids = torch.arange(ctx.logits_width, device=ctx.device)  # [V]
        # The draft ids the rank's logits slice holds, and whether some reach the limit.
        local = self.model.config.vocab_size // ctx.tp.size
        self.local_ids = torch.arange(local, device=ctx.device) + ctx.tp.rank * local
        self.local_limited = self.model.config.vocab_size > ctx.vocab_limit
        # A plain step's row: the root, at its position.
        self._defer_plain_steps(options.deferred_catch_up, keeps_tokens=True, taps_width=0)

    def after_extend(self, view: ExtendView) -> None:
        fb = ForwardBatch.bind(
            view.fb.layout, self.extend_backend, self.kv, riders=self.decode_backend
        )
        self.model(view.input_ids, fb)

    def defer_extend(self, view: ExtendView) -> None:
        self._deferred().fill(view.fb.layout, tokens=view.input_ids)

    def draft(self, view: DecodeView) -> Drafts:
        mode, sampling, limit = self.options.sample, view.sampling, self.ctx.vocab_limit
        if sampling.all_greedy:
            mode = "argmax"
        token, drafts, probs = view.roots, list[torch.Tensor](), list[torch.Tensor]()
        for k in range(view.drafts):
            path = _path(view, drafts)
            if path is not None and k:  # on the host while the forward runs
                assert view.guide is not None
                view.guide.prepare(path)
            hidden = self._forward(token, view.starts + k, view)  # [bs, H]
            if mode == "argmax":
                token = self._greedy(hidden, view, path)
                drafts.append(token)
                continue
            logits = self._wide_logits(hidden, view.bs)  # [bs, V]
            _guide(view, logits, path)
            if mode == "coupled":
                scores = coupled_scores(
                    logits, sampling, view.out_lens + k, self.vocab_ids, vocab_limit=limit
                )
                token = scores.argmax(dim=-1)
            elif mode == "rejection":
                q = processed_probs(logits, sampling, vocab_limit=limit)
                token = sample_probs(q, sampling.seed, view.out_lens + k, DRAW_DRAFT)
                probs.append(q)
            drafts.append(token)
        return Drafts(torch.stack(drafts, dim=1), torch.stack(probs, dim=1) if probs else None)

    def after_accept(self, view: DecodeView, verify: ForwardBatch, accepted: Accepted) -> None:
        drafts_taken = accepted.lens - 1
        # The token at seq + a: the root when nothing was accepted, else the last draft taken.
        block = torch.cat([view.roots.unsqueeze(1), accepted.tokens], dim=1)
        last = block.gather(1, drafts_taken.unsqueeze(1)).squeeze(1)
        self._forward(last, view.starts + drafts_taken, view)

    def defer(self, view: DecodeView, verify: ForwardBatch, accepted: Accepted) -> None:
        self._deferred().append(view.slots, view.roots)

    def catch_up_deferred(self, rows: DeferredRows) -> None:
        tokens, _ = self._deferred().take(rows)
        assert tokens is not None, "the standalone draft keeps the roots"
        layout = rows.layout(self.ctx.page_table, self.ctx.page_size)
        self.model(tokens, ForwardBatch.bind(layout, self.extend_backend, self.kv))

    def _forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, view: DecodeView
    ) -> torch.Tensor:
        """Feed ``tokens`` [bs] at ``positions`` [bs]; the draft's final hidden states."""
        layout = self.row_layout(view, positions.unsqueeze(1))
        fb = ForwardBatch.bind(layout, self.decode_backend, self.kv)
        return self.model(tokens, fb)

    def _greedy(
        self, hidden: torch.Tensor, view: DecodeView, path: torch.Tensor | None
    ) -> torch.Tensor:
        """``hidden: [bs, H]`` -> ``[bs]`` the draft's argmax below the target's vocabulary
        limit, from the rank's logits slice (no gather); under the view's guide, the best
        token the grammar allows after ``path`` (one rank)."""
        local = self.model.local_logits(hidden)  # [bs, V_draft / N]
        if self.local_limited:
            local = local.masked_fill(self.local_ids >= self.ctx.vocab_limit, float("-inf"))
        _guide(view, local, path)
        return vocab_argmax(local, self.ctx.tp)

    def _wide_logits(self, hidden: torch.Tensor, bs: int) -> torch.Tensor:
        """``hidden: [bs, H]`` -> the draft's next-token logits as wide as the target's, -inf
        from the target's vocabulary limit on (gathered under tensor parallelism: sampling
        needs the whole distribution)."""
        logits = self.model.compute_logits(hidden)  # [bs, V_draft]
        limit = min(logits.shape[-1], self.ctx.vocab_limit)
        wide = self.logits.narrow(0, 0, bs)
        wide[:, :limit] = logits[:, :limit]
        return wide


def _path(view: DecodeView, drafts: list[torch.Tensor]) -> torch.Tensor | None:
    """Under the view's guide, the next place's path: the chain's ``drafts`` so far
    (``[bs]`` each) as ``[bs, len(drafts)]``; None without a guide."""
    if view.guide is None:
        return None
    return torch.stack(drafts, dim=1) if drafts else view.roots.new_empty(view.bs, 0)


def _guide(view: DecodeView, logits: torch.Tensor, path: torch.Tensor | None) -> None:
    """Under the view's guide, mask ``logits: [bs, V]`` by the grammar after ``path``
    (``_path``, prepared past the first place)."""
    if view.guide is not None and path is not None:
        view.guide.restrict(logits, path)
