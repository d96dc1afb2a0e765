"""Base class of the device side of speculative plugins (loaded in the daemon only).

A STEP row of width ``W`` holds the slot's root (its relay token: the last committed token,
whose KV is not written yet, at position ``seq``) followed by the ``W - 1`` drafts a worker
returns, at positions ``seq + 1 ..``. The runner verifies them with the target, accepts
(outrider.daemon.engine.accept) and hands the committed tokens back for the worker's
catch-up. Every method only queues device work: a host sync inside is a bug.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from outrider.daemon.engine.forward import ForwardBatch, KVCache
from outrider.plugins.api import Phase
from outrider.plugins.attention.base import AttentionBackend, AttentionShape

if TYPE_CHECKING:
    from outrider.daemon.engine.sampling import SamplingBatch


@dataclass(frozen=True)
class WorkerContext:
    """What a worker is built with (besides its plugin options)."""

    device: torch.device
    dtype: torch.dtype  # the target's serving dtype
    width: int  # verify tokens per row, the root included (--speculative-num-draft-tokens)
    max_slots: int
    page_table: torch.Tensor  # [max_slots, max_pages] int32, shared with the target
    page_size: int
    num_pages: int  # of the target's KV pool, the scratch page included
    context_length: int
    vocab_limit: int  # token ids the target may emit are below this
    logits_width: int  # the target's logits (its embedding rows)
    max_positions: int  # positions a STEP may reach: context length plus the reservation
    # The target's parts a draft may share.
    target_layers: int
    embed: nn.Module  # token ids [T] -> embeddings [T, H]
    lm_head: Callable[[torch.Tensor], torch.Tensor]  # normed hidden [n, H] -> logits [n, V]
    model: str  # --model, the target (a directory or config.json path)
    draft_model: str  # --draft-model ("" when none)
    load_format: str  # --load-format, for the draft too
    # An attention backend instance for one of the draft phases, for the draft's shape.
    make_backend: Callable[[Phase, AttentionShape], AttentionBackend]


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


@dataclass(frozen=True)
class StepView:
    """A STEP batch before verification, as the relay holds it."""

    slots: torch.Tensor  # [bs] int64
    roots: torch.Tensor  # [bs] int64: the relay token of each slot
    seq_lens: torch.Tensor  # [bs] int64: committed KV length = the root's position
    out_lens: torch.Tensor  # [bs] int64: output tokens committed (the randomness counter)
    sampling: SamplingBatch  # each row's sampling parameters
    max_kv: int  # host bound on any row's KV length after the verify

    @property
    def bs(self) -> int:
        return self.slots.shape[0]


@dataclass(frozen=True)
class Drafts:
    """What ``draft`` returns. ``probs``: only for drafts sampled at random, the processed
    distribution each was drawn from (the verify then keeps a draft with probability
    ``min(1, p/q)``); None for deterministic drafts, which need no probabilities."""

    tokens: torch.Tensor  # [bs, width - 1] int64
    probs: torch.Tensor | None = None  # [bs, width - 1, V] float32, V the target's logits width


class SpeculativeWorker(ABC):
    """The device side of a speculative plugin: ``width`` tokens per row are verified (the
    root included), at most ``max_commit`` committed."""

    # Target layers (output-of-layer convention) whose hidden states EXTEND and verify
    # forwards capture into ``fb.captured`` for the worker.
    capture_layers: tuple[int, ...] = ()
    # Whole pages a prefix-cache hit gives back to be recomputed: a draft whose cached state
    # at the last hit position depends on the token after it sets 1.
    prefix_margin_pages: int = 0

    def __init__(self, ctx: WorkerContext, options: Any) -> None:
        self.ctx = ctx
        self.options = options  # the plugin's validated options struct
        self.width = ctx.width
        self.max_commit = ctx.width  # a chain commits at most all drafts plus the bonus
        self.row_ids = torch.arange(ctx.max_slots + 1, device=ctx.device)

    def allocate_kv(self, num_layers: int, shape: AttentionShape) -> KVCache:
        """A draft's own paged KV: the target's pages and page size, the draft's heads."""
        ctx = self.ctx
        return KVCache.allocate(
            num_layers, ctx.num_pages, ctx.page_size, shape.num_kv_heads, shape.head_dim,
            ctx.dtype, ctx.device,
        )  # fmt: skip

    def one_token_batch(
        self, view: StepView, positions: torch.Tensor, kv: KVCache, backend: AttentionBackend
    ) -> ForwardBatch:
        """A draft forward of one token per row at ``positions`` [bs], into ``kv``."""
        bs, page_size = view.bs, self.ctx.page_size
        pages = self.ctx.page_table[view.slots, positions // page_size].to(torch.int64)
        rows = self.row_ids[: bs + 1]
        return ForwardBatch(
            backend=backend,
            kv=kv,
            page_table=self.ctx.page_table,
            slots=view.slots,
            positions=positions,
            out_loc=pages * page_size + positions % page_size,
            q_start=rows,
            seq_lens=positions + 1,
            q_pad_index=rows[:bs],
            bs=bs,
            max_q=1,
            max_kv=view.max_kv,
        )

    @abstractmethod
    def after_extend(self, view: ExtendView) -> None:
        """Draft-side work after any EXTEND batch (prompt chunks, prefix-hit remainders,
        re-admissions)."""

    @abstractmethod
    def draft(self, view: StepView) -> Drafts:
        """The drafts of each row."""

    @abstractmethod
    def after_accept(
        self,
        view: StepView,
        verify: ForwardBatch,
        committed: torch.Tensor,
        commit_lens: torch.Tensor,
    ) -> None:
        """Catch-up after the accept. ``verify``: the target's verify forward (``width``
        tokens per row at ``seq_lens ..``, with its captures). ``committed``: [bs, width],
        the first ``commit_lens`` of each row committed, at positions ``seq_lens + 1 ..``."""
