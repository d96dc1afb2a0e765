"""Base class of the device side of speculative plugins (loaded in the daemon only).

A decode row of width ``W`` holds the slot's root (its relay token: the last committed
token, whose KV is not written yet, at the row's start ``seq``) followed by the ``W - 1``
drafts a worker returns. A chain's draft ``j`` sits at position ``seq + j``. A tree's nodes
carry their parent's index: node ``i`` sits at position ``seq + depth(i)`` and its KV at
``seq + i``, and it attends to the committed prefix, its ancestors and itself. The runner
verifies the row with the target, accepts (outrider.daemon.engine.accept), moves a tree's
accepted path to the KV slots ``seq ..`` and hands the committed tokens back for the worker's
catch-up. Every method only queues device work: a host sync inside is a bug, but for the
ones a ``DraftGuide`` makes (below).

Rows under a grammar: a decode batch holding them carries a ``DraftGuide`` in its view
(``DecodeView.guide``), which a worker that drafts from logits calls before it chooses each
draft, with the drafts already chosen before it on each place's path; it sets to -inf the
logits of every token the row's grammar refuses there. The verify masks every node anyway, so
a worker that ignores the guide stays lossless; it only loses the drafts the grammar refuses.
Each call waits for the host, which computes the masks from the paths copied to it: eagerly
at once, in a replayed graph between two segments (the capture is cut at the call), so the
worker's code around the calls stays device work only, as anywhere in a step. A worker that
runs a forward between two places hands the next place's paths to ``prepare`` before that
forward: the host then computes their masks while the forward runs. A worker whose places'
logits are all known before the first (DFlash) hands their best ids to ``candidates``: the
host then chooses itself the places whose masked argmax it can tell (among those ids, or
alone in the mask), and waits for the device only after a place it could not. Guides come
on one rank only.

KV of a row starting at ``seq`` (its committed length) during a decode batch::

    seq ............... seq + kv_span - 1
    | verify block (W)  |  (tree drafts: a draft model's own node slots, up to kv_span)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from outrider.plugins.api import NoOptions, Phase, StepShape
from outrider.plugins.attention.base import AttentionBackend
from outrider.plugins.device import (
    AttentionShape,
    BatchLayout,
    ForwardBatch,
    HostLengths,
    KVCache,
    SamplingBatch,
    flat_kv_index,
)
from outrider.plugins.models.parallel import SINGLE, TPGroup
from outrider.plugins.speculative.deferred import DeferredBuffer, DeferredRows


@dataclass(frozen=True)
class WorkerContext:
    """What a worker is built with (besides its plugin options).

    Under tensor parallelism every rank builds its worker with its ``tp`` and runs the same
    draft steps: a draft model built with ``tp`` holds the rank's shard and communicates
    inside its forward, and the drafts must come out the same on every rank (``vocab_argmax``
    or gathered logits, never a rank's own slice alone)."""

    device: torch.device
    dtype: torch.dtype  # the target's serving dtype
    shape: StepShape
    # Slots 0 .. max_slots - 1 serve requests; slot max_slots is the scratch slot that the
    # padding rows of a captured decode batch use: per-slot tensors need max_slots + 1 rows.
    max_slots: int
    page_table: torch.Tensor  # [max_slots + 1, max_pages] int32, shared with the target
    page_size: int
    num_pages: int  # of the target's KV pool, the scratch page included
    context_length: int
    vocab_limit: int  # token ids the target may emit are below this
    logits_width: int  # the target's logits (its embedding rows)
    max_positions: int  # positions a decode batch may reach: context length plus the reservation
    # The target's parts a draft may share.
    target_layers: int
    embed: nn.Module  # token ids [T] -> embeddings [T, H] (whole, on every rank)
    # normed hidden [n, H] -> logits [n, V] float32, the whole vocabulary (gathered under
    # tensor parallelism: for sampling)
    lm_head: Callable[[torch.Tensor], torch.Tensor]
    # normed hidden [n, H] -> the rank's vocabulary slice [n, V / N] float32, with no
    # communication (greedy choices: ``vocab_argmax(local, tp)``); lm_head's in a world of one
    local_lm_head: Callable[[torch.Tensor], torch.Tensor]
    model: str  # --model, the target (a directory or config.json path)
    draft_model: str  # --draft-model ("" when none)
    load_format: str  # --load-format, for the draft too
    # An attention backend instance for one of the draft phases, for the draft's shape.
    make_backend: Callable[[Phase, AttentionShape], AttentionBackend]
    tp: TPGroup = SINGLE  # this rank's tensor-parallel group


@dataclass(frozen=True)
class ExtendView:
    """An EXTEND batch after the target's forward and sampling."""

    fb: ForwardBatch  # the target's: positions, out_loc, rows, captured hidden states
    input_ids: torch.Tensor  # [T] int64
    # [bs] int64: the token after each row's chunk: the next chunk's first token, or the
    # token just sampled when the chunk ends the prompt.
    next_tokens: torch.Tensor
    sample_rows: torch.Tensor  # [n] int64: rows whose chunk ended the prompt
    sample_slots: torch.Tensor  # [n] int64: their slots


class DraftGuide(Protocol):
    """The grammar rows of a decode batch, for the worker's drafting (module docstring)."""

    def restrict(
        self, logits: torch.Tensor, paths: torch.Tensor, columns: torch.Tensor | None = None
    ) -> None:
        """Set to -inf, in place, the logits each grammar row's grammar refuses after its
        place's path. ``logits: [bs * n, C]``: ``n`` draft places a batch row, row-major,
        a row's best first (a tree's frontier: a guide may leave all but its best unmasked);
        ``paths: [bs * n, d]``: the target ids drafted before each place after the root
        (``d`` 0 at the first draft); ``columns: [C]``: the target id of each logits column
        (None: column ``c`` is id ``c``). A place whose path the grammar refused, or ended,
        is never committed and keeps every logit; so does a place where no column is
        allowed (a draft vocabulary without the tokens the grammar allows there)."""

    def prepare(self, paths: torch.Tensor) -> None:
        """The next ``restrict``'s ``paths`` (the same tensor), handed over before the
        forward that computes its logits, so that the host's masks for them fill while the
        forward runs (an optional call: ``restrict`` alone waits for all the work queued)."""

    def guided_places(self, bs: int, places: int) -> int:
        """How many of a block's first ``places`` a batch of ``bs`` rows guides, for a worker
        whose places' logits are all known before the first (DFlash's block): it drafts the
        places past them freely, in one go (their drafts are masked at the verify only)."""

    def candidate_count(self, bs: int) -> int:
        """How many of each place's best ids ``candidates`` takes in a batch of ``bs`` rows
        (0: the call is not made)."""

    def candidates(self, ids: torch.Tensor) -> None:
        """Each draft place's best ids, ``[bs, n, k]`` best first (``k`` from
        ``candidate_count``), handed over before a step's first ``restrict`` by a worker that
        takes the argmax of each place and whose places' logits do not depend on the drafts
        before them (DFlash's block). Where it can tell a row's masked argmax (among them, or
        alone in the mask), the guide chooses it on the host and leaves the place that one
        id, so that it knows the path to the next place without waiting for the device (an
        optional call)."""


@dataclass(frozen=True)
class DecodeView:
    """A decode batch before verification, as the relay holds it."""

    slots: torch.Tensor  # [bs] int64
    roots: torch.Tensor  # [bs] int64: the relay token of each slot
    starts: torch.Tensor  # [bs] int64: the root's position = the committed KV length
    out_lens: torch.Tensor  # [bs] int64: output tokens committed (the randomness counter)
    sampling: SamplingBatch  # each row's sampling parameters
    max_kv: int  # host bound on any row's KV length during the batch (start + kv_span)
    # The starts as the host knows them exactly, where it does (``HostLengths``); None
    # under a graph's capture.
    host_starts: tuple[int, ...] | None = None
    guide: DraftGuide | None = None  # where rows draw under a grammar (module docstring)
    # The drafts each row takes this step: its shape's ``width - 1``, fewer where the engine
    # cuts the step short (a worker with ``cut_steps``), 0 in a plain step.
    drafts: int = 0

    @property
    def bs(self) -> int:
        return self.slots.shape[0]


@dataclass(frozen=True)
class Drafts:
    """What ``draft`` returns. ``probs``: only for chain drafts sampled at random, the
    processed distribution each was drawn from (the verify then keeps a draft with
    probability ``min(1, p/q)``); None for deterministic drafts, which need no probabilities.
    ``parents``: a tree's shape, None for a chain. Node ``i`` (1-based: the root is node 0)
    is ``tokens[:, i - 1]``; its parent's index is below ``i`` (parents before children), and
    siblings carry distinct tokens."""

    tokens: torch.Tensor  # [bs, width - 1] int64
    probs: torch.Tensor | None = None  # [bs, width - 1, V] float32, V the target's logits width
    parents: torch.Tensor | None = None  # [bs, width - 1] int64
    # A tree's nodes by score, 0 the best (``tree.select_tree``): the best ``m`` are the tree
    # cut to ``m`` nodes. None: the sizes are not ranked (the engine then never cuts it).
    ranks: torch.Tensor | None = None  # [bs, width - 1] int64


@dataclass(frozen=True)
class Accepted:
    """The accept's result, handed to ``after_accept``. Committed token ``j`` (``j <
    lens``) is the target's choice at verify node ``path[:, j]``, the node of depth ``j`` on
    the accepted path; it sits at position ``seq + 1 + j``. After a tree's compaction the KV
    of node ``path[:, j]`` is at ``seq + j``; a chain's path is ``0, 1, ..``."""

    tokens: torch.Tensor  # [bs, max_commit] int64
    lens: torch.Tensor  # [bs] int64: commit_len, 1 .. max_commit
    path: torch.Tensor  # [bs, max_commit] int64: verify node indices


class SpeculativeWorker(ABC):
    """The device side of a speculative plugin: ``shape.width`` tokens per row are verified
    (the root included), at most ``shape.max_commit`` committed."""

    # Target layers (output-of-layer convention) whose hidden states EXTEND and verify
    # forwards capture into ``fb.captured`` for the worker.
    capture_layers: tuple[int, ...] = ()
    # Whole pages a prefix-cache hit gives back to be recomputed: a draft whose cached state
    # at the last hit position depends on the token after it sets 1.
    prefix_margin_pages: int = 0
    # Plain steps buffer their catch-up for up to this many positions a slot (``defer``), as
    # do short prompt endings (``defer_extend``), and the runner has the draft catch up on
    # them in one batch (``catch_up_deferred``, deferred.py); 0: every plain step catches up
    # at once through ``after_accept``.
    deferred_positions: int = 0
    deferred: DeferredBuffer | None = None  # the buffer, where deferred_positions > 0
    # The draft keeps state over each row's context (its own KV, n-gram's token table),
    # which the target's forwards feed. A request may then run without feeding it (the
    # engine's drafting policy): its forwards capture nothing for the worker, and neither
    # ``after_extend`` nor a plain step's catch-up runs for it; a batch of such rows calls no
    # worker hook at all.
    draft_state: bool = True
    # The worker drafts fewer tokens than its shape's as each step asks (``DecodeView.drafts``):
    # a chain's first drafts, a tree's best nodes (``Drafts.ranks`` set), so that the engine
    # may choose the size per batch. False: every drafting step takes the shape's drafts.
    cut_steps: bool = False

    def __init__(self, ctx: WorkerContext, options: Any) -> None:
        self.ctx = ctx
        self.shape = ctx.shape
        self.options = options  # the plugin's validated options struct
        self.token_ids = torch.arange(
            (ctx.max_slots + 1) * max(self.shape.width, self.shape.kv_span), device=ctx.device
        )

    @classmethod
    def draft_logit_rows(cls, shape: StepShape) -> int:
        """Rows of vocabulary logits a drafting step scores per batch row: one per draft
        token of a chain or block, ``K`` children at each of a tree's ``S`` steps. The start-up
        memory plan budgets their sampling in the CUDA graph pool (memory_plan.py)."""
        return shape.depth * shape.topk if shape.tree else shape.width - 1

    @classmethod
    def draft_vocab_size(cls, draft_model: str) -> int | None:
        """Logits in each of those rows when the draft at ``draft_model`` scores a vocabulary
        of its own; None: the target's."""
        return None

    def allocate_kv(self, num_layers: int, shape: AttentionShape) -> KVCache:
        """A draft's own paged KV: the target's pages and page size, the draft's heads."""
        ctx = self.ctx
        return KVCache.allocate(
            num_layers, ctx.num_pages, ctx.page_size, shape, ctx.dtype, ctx.device
        )

    def row_layout(
        self,
        view: DecodeView,
        positions: torch.Tensor,
        *,
        kv_end: int | None = None,
        kv_slots: torch.Tensor | None = None,
        causal: bool = True,
        tree_mask: torch.Tensor | None = None,
    ) -> BatchLayout:
        """A draft batch of ``q`` tokens per row at ``positions: [bs, q]``, their K/V stored
        at ``kv_slots`` (default: the positions). ``kv_end``: each row's KV length after it
        is its start plus this (the layout then carries host lengths where the view has host
        starts); None: the last position + 1, on the device only."""
        bs, q = positions.shape
        page_size = self.ctx.page_size
        where = positions if kv_slots is None else kv_slots
        out_loc = flat_kv_index(self.ctx.page_table, view.slots.unsqueeze(1), where, page_size)
        flat = self.token_ids[: bs * q]
        host = None
        if kv_end is not None and view.host_starts is not None:
            host = HostLengths((q,) * bs, tuple(start + kv_end for start in view.host_starts))
        return BatchLayout(
            page_table=self.ctx.page_table,
            page_size=page_size,
            slots=view.slots,
            # NOTE: an expanded [1, q] (a tree step at batch 1) flattens to a stride-0 view,
            # which fused rotary kernels refuse.
            positions=positions.reshape(-1).contiguous(),
            out_loc=out_loc.view(-1),
            q_start=self.token_ids[: bs + 1] * q,
            seq_lens=positions[:, -1] + 1 if kv_end is None else view.starts + kv_end,
            q_pad_index=flat,
            bs=bs,
            max_q=q,
            max_kv=view.max_kv,
            causal=causal,
            tree_mask=tree_mask,
            host=host,
        )

    @abstractmethod
    def after_extend(self, view: ExtendView) -> None:
        """Draft-side work after any EXTEND batch (prompt chunks, prefix-hit remainders,
        re-admissions, and decoding rows riding the batch: a chunk of one token, the row's
        root, whose positions before it the draft has caught up on)."""

    @abstractmethod
    def draft(self, view: DecodeView) -> Drafts:
        """The drafts of each row."""

    @abstractmethod
    def after_accept(self, view: DecodeView, verify: ForwardBatch, accepted: Accepted) -> None:
        """Catch-up after the accept. ``verify``: the target's verify forward (``width``
        nodes per row, with its captures, one row per verify node)."""

    def _defer_plain_steps(self, positions: int, *, keeps_tokens: bool, taps_width: int) -> None:
        """Plain steps buffer up to ``positions`` a slot (0: they catch up at once), each a
        token (``keeps_tokens``) and the target's taps (``taps_width`` wide; 0: none)."""
        self.deferred_positions = positions
        if positions:
            ctx = self.ctx
            self.deferred = DeferredBuffer(
                ctx.max_slots + 1,
                positions,
                keeps_tokens=keeps_tokens,
                taps_width=taps_width,
                dtype=ctx.dtype,
                device=ctx.device,
            )

    def _deferred(self) -> DeferredBuffer:
        assert self.deferred is not None, "only a worker with deferred_positions defers"
        return self.deferred

    def defer(self, view: DecodeView, verify: ForwardBatch, accepted: Accepted) -> None:
        """A plain step's catch-up, buffered instead of run (``deferred_positions`` > 0):
        ``verify`` is the forward over each row's root, ``accepted`` one token a row."""
        raise NotImplementedError(f"{type(self).__name__} does not defer its catch-up")

    def defer_extend(self, view: ExtendView) -> None:
        """``after_extend`` buffered instead of run (``deferred_positions`` > 0): an EXTEND
        batch whose rows all end their prompts, each within the buffer (``DeferredBuffer.fill``;
        the slots start afresh)."""
        raise NotImplementedError(f"{type(self).__name__} does not defer its catch-up")

    def catch_up_deferred(self, rows: DeferredRows) -> None:
        """The draft over ``rows``' buffered positions, as if each plain step (and the
        EXTEND before them) had caught up at once; empties their buffers."""
        raise NotImplementedError(f"{type(self).__name__} does not defer its catch-up")


class NoDraft(SpeculativeWorker):
    """Plain decoding: a decode row is its root alone, and nothing is drafted."""

    draft_state = False

    def __init__(self, ctx: WorkerContext) -> None:
        super().__init__(ctx, NoOptions())
        assert not ctx.shape.speculative, "plain decoding has width 1"
        self.no_tokens = torch.zeros(ctx.max_slots + 1, 0, dtype=torch.int64, device=ctx.device)

    def after_extend(self, view: ExtendView) -> None:
        pass

    def draft(self, view: DecodeView) -> Drafts:
        return Drafts(self.no_tokens[: view.bs])

    def after_accept(self, view: DecodeView, verify: ForwardBatch, accepted: Accepted) -> None:
        pass
