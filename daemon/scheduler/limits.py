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
    # A decode batch holding grammar rows may draft: the host computes the masks of their
    # draft places and verify nodes at waits inside the step (graph segments where graphs
    # run). One rank: the masks do not travel to the other ranks.
    grammar_drafts: bool = True
    # A decode batch may take grammar rows whose step is still in flight: the runner
    # computes their masks once the loop has processed that step, in the middle of the new
    # one (scheduler/loop.py). On one rank (the masks do not travel to the other ranks).
    late_masks: bool = False
    # Decoding rows ride prompt batches (planner.py; --mixed-batches), those whose positions
    # the host knows exactly.
    mixed_batches: bool = False
    # Prompt batches in a row while requests are part-way through decoding, then a decode
    # batch first (planner.py; --max-prompt-run); 0: prompts always first.
    max_prompt_run: int = 0
    # The engine's chain may be cut (its worker's ``cut_steps``): a drafting batch whose rows
    # all cap their drafts lower runs the chain cut to the largest cap (planner.py).
    shorter_chains: bool = False
    # (width, the most rows a decode step of it takes) of each width the engine drafts at,
    # widest first (engine/memory_plan.py): a larger batch drafts at a narrower one of them
    # or takes a plain step (planner.py). None listed: every width takes every running row.
    drafting_rows: tuple[tuple[int, int], ...] = ()
    # The sliding layers keep only their windows (no --whole-sliding-kv): the window page pool's
    # pages, the scratch page included (0: no such pool), and the widest window.
    window_pages: int = 0
    window: int = 0
