"""Deferred catch-up: a plain step of a speculative engine (one token a row, no drafts) buffers
what its draft would have caught up on, and the draft runs over the buffered positions later,
in one batch: before the row's next drafting step, when a slot's buffer is full, or once its
request has ended (so that prefix-cache pages carry the draft's KV).

A prompt's last chunk may be buffered the same way when it is short (engine/deferred.py
says when), each position with the token after it.

After ``n`` plain steps a row whose committed length (relay start) is ``start`` has buffered
positions ``start - n .. start - 1``, oldest first: position ``start - n + i`` is buffer entry
``i`` of the slot, a token (the worker's choice: the root, or the token after it) and, for
drafts fed by the target, its tapped features at that position.

The host knows every count (each plain step adds one a row; the runner's ``DeferredCatchUp``
keeps them), so a catch-up batch is laid out from host lengths; the device keeps its own
count per slot, the write index of the next plain step, which a captured plain-step graph
reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from outrider.plugins.device import SCRATCH_PAGE, BatchLayout, HostLengths, flat_kv_index


@dataclass(frozen=True)
class DeferredRows:
    """The rows of one catch-up batch (device tensors, laid out from host counts): row ``r``
    catches up ``counts[r]`` of slot ``slots[r]``'s buffered positions, the row's last
    ``counts[r]`` tokens, which end at ``starts[r]``. A slot's positions may come in two
    batches, its oldest first (the first ending before the committed length): each token
    reads its own buffer entry (``token_index``), and each batch sees the draft's KV of the
    one before.

    A batch replayed from a CUDA graph has its graph's shape: every row ``max_q`` tokens long,
    the buffered positions last, and rows past the real ones on the scratch slot with a count
    of 0 (their start is ``max_q``). Its other tokens are padding (not ``real``): each sits at a
    position before its row's buffered ones (the host pads only rows that long), reads the
    row's first entry, writes its K/V to the scratch page, and its output is never read. A
    worker treats both shapes alike: ``layout`` and ``DeferredBuffer.take`` place the
    padding."""

    slots: torch.Tensor  # [n] int64
    counts: torch.Tensor  # [n] int64: 0 for a padding row
    starts: torch.Tensor  # [n] int64: where each row's positions end (its relay start or less)
    q_start: torch.Tensor  # [n + 1] int64: cumulative row lengths
    token_rows: torch.Tensor  # [T] int64: each token's row
    token_index: torch.Tensor  # [T] int64: its buffer entry (0: the oldest; padding: row's first)
    back: torch.Tensor  # [T] int64: how far before its row's start it sits (1 .. count if real)
    real: torch.Tensor  # [T] bool: a buffered position, not padding
    q_pad_index: torch.Tensor  # [T] int64: row * max_q + its place in the row
    max_q: int  # the longest row
    max_kv: int  # host bound on any row's KV length
    # Each row's length and ``starts`` as the host knows them exactly, where it does
    # (``HostLengths``; for a backend that plans on the host).
    host: HostLengths | None = None

    def layout(self, page_table: torch.Tensor, page_size: int) -> BatchLayout:
        """The causal layout of the rows, each the positions right before its start; the
        buffered positions' K/V go to the row's own pages, the padding's to the scratch
        page."""
        positions = self.starts[self.token_rows] - self.back
        out_loc = flat_kv_index(page_table, self.slots[self.token_rows], positions, page_size)
        return BatchLayout(
            page_table=page_table,
            page_size=page_size,
            slots=self.slots,
            positions=positions,
            out_loc=torch.where(self.real, out_loc, SCRATCH_PAGE * page_size),
            q_start=self.q_start,
            seq_lens=self.starts,
            q_pad_index=self.q_pad_index,
            bs=self.slots.shape[0],
            max_q=self.max_q,
            max_kv=self.max_kv,
            host=self.host,
        )


class DeferredBuffer:
    """Per slot, up to ``capacity`` buffered positions, each with what the worker keeps: a
    token (``keeps_tokens``) and the target's tapped features (the concatenated capture
    layers, ``taps_width`` wide, in ``dtype``; 0: none)."""

    def __init__(
        self,
        rows: int,
        capacity: int,
        *,
        keeps_tokens: bool,
        taps_width: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.capacity = capacity
        self.tokens = (
            torch.zeros(rows, capacity, dtype=torch.int64, device=device) if keeps_tokens else None
        )
        self.taps = (
            torch.zeros(rows, capacity, taps_width, dtype=dtype, device=device)
            if taps_width
            else None
        )
        self.count = torch.zeros(rows, dtype=torch.int64, device=device)
        self.ones = torch.ones(rows, dtype=torch.int64, device=device)

    def append(
        self,
        slots: torch.Tensor,
        tokens: torch.Tensor | None = None,
        taps: torch.Tensor | None = None,
    ) -> None:
        """One more position for each of ``slots`` [bs]: ``tokens`` [bs], ``taps`` [bs, D]."""
        # NOTE: the runner catches a live slot up before its buffer overflows; only the scratch
        # slot (the padding rows of captured graphs, several per batch) runs past the end, and
        # its entries are never read.
        index = self.count[slots].clamp(max=self.capacity - 1)
        for kept, value in ((self.tokens, tokens), (self.taps, taps)):
            if kept is not None:
                assert value is not None, "the buffer keeps it: every position must bring it"
                kept.index_put_((slots, index), value)
        self.count.index_add_(0, slots, self.ones[: slots.shape[0]])

    def fill(
        self,
        layout: BatchLayout,
        tokens: torch.Tensor | None = None,
        taps: torch.Tensor | None = None,
    ) -> None:
        """The positions of an EXTEND batch (``layout``; its slots start afresh, each row's
        tokens from entry 0): ``tokens`` [T], ``taps`` [T, D]."""
        row = layout.q_pad_index // layout.max_q
        entry = layout.q_pad_index - row * layout.max_q
        slots = layout.slots[row]
        for kept, value in ((self.tokens, tokens), (self.taps, taps)):
            if kept is not None:
                assert value is not None, "the buffer keeps it: every position must bring it"
                kept.index_put_((slots, entry), value)
        self.count.index_copy_(0, layout.slots, layout.q_start[1:] - layout.q_start[:-1])

    def clear(self, slots: torch.Tensor) -> None:
        """``slots`` [n] start afresh: what they buffered is dropped."""
        self.count.index_fill_(0, slots, 0)

    def take(self, rows: DeferredRows) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The tokens [T] and taps [T, D] (None where not kept) of ``rows``' tokens, in the
        layout's order (a padding token's: its slot's first entry); their slots' buffers are
        empty afterwards."""
        flat = rows.slots[rows.token_rows] * self.capacity + rows.token_index
        tokens = None if self.tokens is None else self.tokens.view(-1)[flat]
        taps = None if self.taps is None else self.taps.view(-1, self.taps.shape[2])[flat]
        self.clear(rows.slots)
        return tokens, taps
