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
    # A decode batch holding grammar rows may draft: their drafts and verify nodes' masks
    # come from the host mid-step, so such a step runs eagerly, on one rank. Only where decode
    # steps run eagerly anyway (no CUDA graphs) and on one rank: eagerly, an H200 step costs
    # several graphed ones (BENCHMARKS.md, structured output), more than drafting gains.
    grammar_drafts: bool = True
    # A plain decode batch may take grammar rows whose step is still in flight: the loop
    # launches its forward, processes that step, then gives the masks (scheduler/loop.py). On
    # one rank, where constrained batches do not draft (each of their steps would).
    late_masks: bool = False
