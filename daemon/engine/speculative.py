"""Speculative decoding inside a STEP (DESIGN.md 4.4): the worker interface that speculative
plugins implement, and the accept rule the runner applies.

A STEP row of width ``W`` holds the slot's root (its relay token: the last committed token,
whose KV is not written yet, at position ``seq``) followed by ``W - 1`` drafts at positions
``seq + 1 ..``. The target verifies all ``W`` tokens in one forward. At node ``j`` the target's
own choice ``y[j]`` is drawn with the randomness counter of output index ``out_len + j``:
exactly the draw that decoding without speculation makes there. Chain accept takes drafts
while ``draft[j] == y[j]``; with ``a`` accepted, ``commit_len = a + 1`` tokens ``y[0 .. a]``
are committed, the last being the bonus. Deterministic drafts (argmax chains, n-gram, DFlash
blocks) are therefore lossless by construction: greedy and seeded sampled outputs equal the
target-only outputs token for token, with no q needed.

Everything here runs on the device without a host sync; the CPU learns ``commit_len`` one step
late, through the step's result copy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WorkerContext:
    """What a worker is built with (besides its plugin options)."""

    device: torch.device
    width: int  # verify tokens per row, the root included (--speculative-num-draft-tokens)
    max_slots: int
    page_table: torch.Tensor  # [max_slots, max_pages] int32, shared with the target
    page_size: int
    num_pages: int  # of the target's KV pool, the scratch page included
    context_length: int


@dataclass(frozen=True)
class ExtendView:
    """An EXTEND batch after the target's forward: every token's id and flat KV index."""

    input_ids: torch.Tensor  # [T] int64
    out_loc: torch.Tensor  # [T] int64: flat KV index the token's K/V went to


@dataclass(frozen=True)
class StepView:
    """A STEP batch before verification, as the relay holds it."""

    slots: torch.Tensor  # [bs] int64
    roots: torch.Tensor  # [bs] int64: the relay token of each slot
    seq_lens: torch.Tensor  # [bs] int64: committed KV length = the root's position

    @property
    def bs(self) -> int:
        return self.slots.shape[0]


class SpeculativeWorker(ABC):
    """The device side of a speculative plugin. ``width`` tokens per row are verified, at
    most ``max_commit`` committed. Every method only queues device work: a host sync inside
    is a bug."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.width = ctx.width
        self.max_commit = ctx.width

    def reserve_tokens(self, page_size: int) -> int:
        """KV positions a STEP may write past the host's bound on a row's committed length:
        the verify block, plus one step's commit under overlap, page aligned."""
        need = self.width + self.max_commit
        return (need + page_size - 1) // page_size * page_size

    @abstractmethod
    def after_extend(self, view: ExtendView) -> None:
        """Draft-side work after any EXTEND batch (prompt chunks, prefix-hit remainders,
        re-admissions)."""

    @abstractmethod
    def draft(self, view: StepView) -> torch.Tensor:
        """The drafts of each row: [bs, width - 1] int64 token ids."""

    @abstractmethod
    def after_accept(
        self, view: StepView, committed: torch.Tensor, commit_lens: torch.Tensor
    ) -> None:
        """Catch-up after the accept. ``committed``: [bs, width] (the first ``commit_lens``
        of each row are committed, at positions ``seq_lens + 1 ..``)."""


def accept_chain(drafts: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``commit_len`` per row: 1 + the number of leading drafts equal to the target's choice
    at their parent node. drafts: [bs, W - 1]; target: [bs, W]. Returns [bs] int64."""
    matches = (drafts == target[:, :-1]).to(torch.int64)  # [bs, W - 1]
    return torch.cumprod(matches, dim=1).sum(dim=1) + 1
