"""Base class of the device side of speculative plugins (loaded in the daemon only).

A STEP row of width ``W`` holds the slot's root (its relay token: the last committed token,
whose KV is not written yet, at position ``seq``) followed by the ``W - 1`` drafts a worker
returns, at positions ``seq + 1 ..``. The runner verifies them with the target, accepts
(outrider.daemon.engine.accept) and hands the committed tokens back for the worker's
catch-up. Every method only queues device work: a host sync inside is a bug.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

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
    """The device side of a speculative plugin: ``width`` tokens per row are verified (the
    root included), at most ``max_commit`` committed."""

    def __init__(self, ctx: WorkerContext, options: Any) -> None:
        self.ctx = ctx
        self.options = options  # the plugin's validated options struct
        self.width = ctx.width
        self.max_commit = ctx.width  # a chain commits at most all drafts plus the bonus

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
