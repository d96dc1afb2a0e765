"""``eagle3`` on the device: an EAGLE-3 draft with its own paged KV cache, drafting a chain
(K = 1) or a top-K tree (tree.py).

Convention: the draft row at position ``t`` takes the token at ``t + 1`` and the target's
feature at ``t`` (``fc`` of the three tapped layers, output-of-layer convention) and predicts
the token at ``t + 2``. So after a target forward over positions ``s .. e - 1`` the draft can
fill its rows ``s .. e - 1`` once the token at ``e`` is known: the next chunk's first token,
the token sampled at the end of the prompt, or, after a verify, the bonus. The draft's KV at
positions below a row's KV length is then always final, and a per-slot relay carries the
drafting state: ``feat``, the draft's output at the row of the last committed position.

Drafting, with ``seq`` the root's position: forward step ``k`` (1 .. S - 1) runs the ``K``
frontier nodes of depth ``k`` at position ``seq + k - 1`` (siblings share it) and writes
their K/V at the node slots ``seq + (k - 1) K + i``; each attends to the committed rows and
to its ancestors' node slots. The catch-up after a verify rewrites rows ``seq ..`` along the
accepted path from the target's features, so node slots never need moving.

Sampled requests (``DraftOptions.sample``, sampled.py): a step's candidates after a node of
depth ``d`` are the ``K`` best of its race scores at output index ``out_len + d`` under
``coupled`` (the default; a chain takes the winner, and a tree scores a path by the sum of its
nodes' distances from winning, so the spine of race winners scores 0 and the other nodes
below it), or one draw from ``q`` under ``rejection`` (chains only; ``q`` spread over the
target's vocabulary through ``d2t``). A coupled tree is lossless as any deterministic tree is:
every committed token is the target's own draw, and the drafts only decide how many are
committed. So trees at temperature > 0 need neither recursive rejection over siblings nor a
fallback to a chain, and seeded outputs stay the target-only ones.

A prefix-cache hit gives its last page back (``prefix_margin_pages``): the draft's KV at the
last cached position was computed with the publishing request's next token.

Under tensor parallelism the draft is sharded as the target (its KV holds the rank's heads)
and its head is vocabulary-parallel: greedy candidates are ``vocab_top_logprobs`` over each
rank's logits slice (``vocab_argmax``'s tie rule for a chain), with no gather of the logits;
sampled candidates gather the draft vocabulary first.
"""

from __future__ import annotations

import torch

from outrider.plugins.attention.base import AttentionBackend
from outrider.plugins.device import BatchLayout, ForwardBatch
from outrider.plugins.models.parallel import gather_vocab, vocab_top_logprobs
from outrider.plugins.sampling import DRAW_DRAFT, SamplingBatch, processed_probs, sample_probs
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
from outrider.plugins.speculative.eagle3_model import (
    Eagle3Config,
    Eagle3Draft,
    default_aux_layers,
    load_eagle3,
)
from outrider.plugins.speculative.sampled import coupled_scores, repeat_rows
from outrider.plugins.speculative.tree import best, select_tree


class Eagle3Worker(SpeculativeWorker):
    prefix_margin_pages = 1
    cut_steps = True  # a chain's first drafts, a tree's best nodes

    def __init__(self, ctx: WorkerContext, options: DraftOptions) -> None:
        super().__init__(ctx, options)
        config = Eagle3Config.from_pretrained(ctx.draft_model)
        self.capture_layers = config.aux_layer_ids or default_aux_layers(ctx.target_layers)
        self.model: Eagle3Draft = load_eagle3(
            ctx.draft_model,
            dtype=ctx.dtype,
            device=ctx.device,
            max_positions=ctx.max_positions,
            load_format="dummy" if ctx.load_format == "dummy" else "auto",
            tp=ctx.tp,
        )
        shape = self.model.attention_shape
        self.kv = self.allocate_kv(1, shape)
        self.extend_backend = ctx.make_backend("draft_extend", shape)
        self.decode_backend = ctx.make_backend("draft_decode", shape)
        self.embed = ctx.embed
        self.depth, self.topk = ctx.shape.depth, ctx.shape.topk
        hidden = config.model.hidden_size
        self.feat = torch.zeros(ctx.max_slots + 1, hidden, dtype=ctx.dtype, device=ctx.device)
        self.node_offsets = torch.arange(self.topk, device=ctx.device)  # [K]
        self.commit_offsets = torch.arange(ctx.shape.max_commit, device=ctx.device)  # [M]
        # The target id of each draft vocabulary entry: the column a coupled race keys on.
        self.draft_ids = self.model.to_target_ids(
            torch.arange(config.draft_vocab_size, device=ctx.device)
        )
        # A plain step's row: the token after the root and the target's taps at the root.
        self._defer_plain_steps(
            options.deferred_catch_up, keeps_tokens=True, taps_width=self.model.fc.in_features
        )

    # --- EXTEND --------------------------------------------------------------------------

    @classmethod
    def draft_vocab_size(cls, draft_model: str) -> int | None:
        return Eagle3Config.from_pretrained(draft_model).draft_vocab_size

    def after_extend(self, view: ExtendView) -> None:
        fb = view.fb
        feats = self._features(fb)  # [T, H]
        tokens, last = self._next_tokens(view)
        y = self._run(tokens, feats, fb.layout, self.extend_backend, self.decode_backend)
        self.feat.index_copy_(0, view.sample_slots, y[last[view.sample_rows]])

    def defer_extend(self, view: ExtendView) -> None:
        tokens, _ = self._next_tokens(view)
        self._deferred().fill(view.fb.layout, tokens, self._taps(view.fb))

    def _next_tokens(self, view: ExtendView) -> tuple[torch.Tensor, torch.Tensor]:
        """The token after each position [T] (the row's next input, and at the row's end the
        token after the chunk), and each row's last token [bs]."""
        tokens = torch.roll(view.input_ids, -1)
        last = view.fb.layout.q_start[1:] - 1
        tokens[last] = view.next_tokens
        return tokens, last

    # --- decode --------------------------------------------------------------------------

    def draft(self, view: DecodeView) -> Drafts:
        bs, k = view.bs, self.topk
        depth = self.depth if k > 1 else view.drafts  # a chain may be cut short
        y = self.feat[view.slots].unsqueeze(1)  # [bs, 1, H]: the root's row
        # Under a grammar: the drafts on each frontier node's path, itself included.
        paths = view.roots.new_empty(bs, 1, 0) if view.guide is not None else None
        flat = None if paths is None else paths.view(bs, 0)
        score, token, q = self._expand(view, 0, y.squeeze(1), flat)  # [bs, K]: depth 1
        cand_tokens, cand_scores, probs = [token], [score], [q]
        cand_parents = [torch.full_like(token, -1)]
        node = self.node_offsets.expand(bs, k)  # [bs, K]: the frontier's candidate indices
        ancestors = torch.zeros(bs, k, (depth - 1) * k, dtype=torch.bool, device=y.device)
        for step in range(1, depth):
            first = (step - 1) * k  # this step's node slots: seq + first ..
            ancestors[:, :, first : first + k] |= torch.eye(k, dtype=torch.bool, device=y.device)
            if paths is not None:  # the next places' paths, on the host while the forward runs
                paths = torch.cat((paths.expand(bs, k, -1), token.unsqueeze(2)), dim=2)
                flat = paths.reshape(bs * k, step)
                assert view.guide is not None
                view.guide.prepare(flat)
            y = self._frontier(view, step, token, y, ancestors[:, :, : first + k])  # [bs, K, H]
            child_score, child_token, q = self._expand(view, step, y.view(bs * k, -1), flat)
            probs.append(q)  # child_score, child_token: [bs * K, K]
            child_score = (score.unsqueeze(2) + child_score.view(bs, k, k)).view(bs, k * k)
            cand_tokens.append(child_token.view(bs, k * k))
            cand_scores.append(child_score)
            cand_parents.append(node.repeat_interleave(k, dim=1))
            keep = best(child_score, k)  # [bs, K]: the next frontier
            parent = keep // k  # [bs, K]: its parents' places in this frontier
            token = cand_tokens[-1].gather(1, keep)
            score = child_score.gather(1, keep)
            node = k + (step - 1) * k * k + keep
            y = y.gather(1, parent.unsqueeze(2).expand(-1, -1, y.shape[2]))
            ancestors = ancestors.gather(1, parent.unsqueeze(2).expand_as(ancestors))
            if paths is not None:
                paths = paths.gather(1, parent.unsqueeze(2).expand_as(paths))
        tokens = torch.cat(cand_tokens, dim=1)
        if k == 1:  # a chain: every candidate, in depth order
            sampled = [q for q in probs if q is not None]
            return Drafts(tokens, torch.stack(sampled, dim=1) if sampled else None)
        drafts, parents, ranks = select_tree(
            tokens, torch.cat(cand_scores, dim=1), torch.cat(cand_parents, dim=1), view.drafts
        )
        return Drafts(drafts, parents=parents, ranks=ranks)

    def after_accept(self, view: DecodeView, verify: ForwardBatch, accepted: Accepted) -> None:
        # Row j (position seq + j) takes committed token j, the token at seq + 1 + j, and the
        # target's feature at the path's node of depth j; rows past the commit are rewritten
        # later. A plain step verifies the root alone: one node, one row (m = 1).
        bs, m = view.bs, accepted.tokens.shape[1]
        feats = self._features(verify)
        feats = feats.view(bs, feats.shape[0] // bs, -1)  # [bs, nodes, H]
        feats = feats.gather(1, accepted.path.unsqueeze(2).expand(-1, -1, feats.shape[2]))
        positions = view.starts.unsqueeze(1) + self.commit_offsets[:m]  # [bs, M]
        layout = self.row_layout(view, positions, kv_end=m)
        y = self._run(accepted.tokens.view(-1), feats.view(bs * m, -1), layout, self.extend_backend)
        last = self.token_ids[:bs] * m + accepted.lens - 1  # the bonus's row
        self.feat.index_copy_(0, view.slots, y[last])

    def defer(self, view: DecodeView, verify: ForwardBatch, accepted: Accepted) -> None:
        self._deferred().append(view.slots, accepted.tokens[:, 0], self._taps(verify))

    def catch_up_deferred(self, rows: DeferredRows) -> None:
        tokens, taps = self._deferred().take(rows)
        assert tokens is not None and taps is not None, "EAGLE-3 keeps both"
        layout = rows.layout(self.ctx.page_table, self.ctx.page_size)
        y = self._run(tokens, self.model.project(taps), layout, self.extend_backend)
        self.feat.index_copy_(0, rows.slots, y[rows.q_start[1:] - 1])

    # --- helpers -------------------------------------------------------------------------

    def _frontier(
        self,
        view: DecodeView,
        step: int,
        tokens: torch.Tensor,
        feats: torch.Tensor,
        ancestors: torch.Tensor,
    ) -> torch.Tensor:
        """Draft forward step ``step`` over the frontier ``tokens: [bs, K]`` (depth
        ``step``) with their parents' outputs ``feats: [bs, K or 1, H]`` -> ``[bs, K, H]``.
        ``ancestors: [bs, K, step * K]``: the node slots each node sees, itself included."""
        bs, k = tokens.shape
        seq = view.starts.unsqueeze(1)  # [bs, 1]
        positions = (seq + (step - 1)).expand(bs, k)
        if k == 1:  # a chain: the node slot is the position, and attention plain causal
            layout = self.row_layout(view, positions, kv_end=step)
        else:
            layout = self.row_layout(
                view,
                positions,
                kv_end=step * k,
                kv_slots=seq + (step - 1) * k + self.node_offsets,
                tree_mask=ancestors,
            )
        feats = feats.expand(bs, k, feats.shape[2]).reshape(bs * k, -1)
        return self._run(tokens.view(-1), feats, layout, self.decode_backend).view(bs, k, -1)

    def _expand(
        self, view: DecodeView, depth: int, y: torch.Tensor, paths: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The ``K`` best next tokens (target ids) after the nodes of ``depth`` whose draft
        outputs are ``y: [n, H]`` (``n`` a multiple of the batch, row-major), best first, and
        their scores: ``[n, K]`` each. Scores are the draft's log-probabilities, or a sampled
        row's coupled race scores. Under ``rejection`` (a chain) the one token is drawn from
        ``q``, returned as ``[n, V]`` (else None). ``paths: [n, depth]``: each node's path,
        for the grammar rows' guide (None: no guide; past depth 0 the guide's prepared
        ones)."""
        local = self.model.local_logits(y)  # [n, V_draft / N]
        if view.guide is not None and paths is not None:  # one rank: ``local`` is whole
            view.guide.restrict(local, paths, self.draft_ids)
        mode, sampling = self.options.sample, view.sampling
        # Siblings' order is free (neither is the other's ancestor): topk, not a full sort.
        if sampling.all_greedy or mode == "argmax":
            greedy = vocab_top_logprobs(local, self.topk, self.model.tp)
            return greedy.logprobs, self.model.to_target_ids(greedy.ids), None
        # Sampled rows race over (or draw from) the whole draft vocabulary: gather it, as the
        # target's sampling does.
        logits = gather_vocab(local, self.model.tp)  # [n, V_draft]
        per_row = y.shape[0] // view.bs
        batch = repeat_rows(sampling, per_row)
        counters = (view.out_lens + depth).repeat_interleave(per_row)
        if mode == "rejection":
            return self._draw(logits, batch, counters)
        scores = coupled_scores(
            logits, batch, counters, self.draft_ids, vocab_limit=self.ctx.vocab_limit
        )
        top = scores.topk(self.topk, dim=-1)
        return top.values, self.model.to_target_ids(top.indices), None

    def _draw(
        self, logits: torch.Tensor, batch: SamplingBatch, counters: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A chain's ``rejection`` draft: (score [n, 1] (unused), token [n, 1], q [n, V])."""
        limit = self.ctx.vocab_limit
        logits = logits.float().masked_fill(self.draft_ids >= limit, float("-inf"))
        q_draft = processed_probs(logits, batch, vocab_limit=logits.shape[-1])  # [n, V_draft]
        q = torch.zeros(
            logits.shape[0], self.ctx.logits_width, dtype=q_draft.dtype, device=logits.device
        ).index_copy_(1, self.draft_ids, q_draft)
        token = sample_probs(q, batch.seed, counters, DRAW_DRAFT).unsqueeze(1)
        return torch.zeros_like(token, dtype=q.dtype), token, q

    def _features(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model.project(self._taps(fb))

    def _taps(self, fb: ForwardBatch) -> torch.Tensor:
        """The target's captured layers, concatenated: ``[T, taps_width]``."""
        return torch.cat([fb.captured[layer] for layer in self.capture_layers], dim=-1)

    def _run(
        self,
        tokens: torch.Tensor,
        feats: torch.Tensor,
        layout: BatchLayout,
        backend: AttentionBackend,
        riders: AttentionBackend | None = None,
    ) -> torch.Tensor:
        """The draft over ``tokens`` at ``layout``'s positions, into its own KV (``riders``:
        ``ForwardBatch.bind``'s)."""
        fb = ForwardBatch.bind(layout, backend, self.kv, riders=riders)
        return self.model(self.embed(tokens), feats, fb)
