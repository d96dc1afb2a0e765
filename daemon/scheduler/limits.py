"""What the scheduler may hold: the sizes its parts are built with, fixed at start."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerLimits:
    max_running: int
    max_pages_per_request: int
    chunked_prefill_tokens: int
    context_length: int
    prefix_margin_pages: int = 0  # last pages of a prefix hit recomputed (speculative drafts)
    # The draft keeps state over the context (its own KV): requests may not feed it
    # (``Request.fed``, drafting.py).
    draft_state: bool = False
    # A decode batch holding grammar rows may draft: their verify nodes' masks come from the
    # host mid-step, which one rank alone can wait for (tensor-parallel ranks: False).
    grammar_drafts: bool = True
