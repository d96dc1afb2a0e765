"""The engine's warm-up before READY: every kind of step runs once, so that no kernel compiles
while serving (a JIT compile stalls the whole batch for about a second).

- Sampled rows (top-p, top-k, logprobs) through an EXTEND and decode batches of one and two
  rows, through every routed phase (drafting and plain decode batches both, where the drafting
  policy may choose either).
- Where kernels compile per shape class (CUDA: Triton's tile sizes chosen by the longest row's
  queries, split-KV by the batch's programs, MoE tiles by token counts), a ladder of prompt
  batches (``prompt_ladder``): the longest prompt of 1, 2, 4, ... tokens up to the step's token
  budget, each alone and with as many one-token rows beside it as the budget and
  ``max_running`` allow, so that each class of the smallest and of the largest batch is met.
  Decode batches need no ladder: their graphs' captures ran every captured size.

Invariant: the ladder's prompts share no first page (each starts with its own token), so that
no prompt is served from the prefix cache and each batch extends the tokens it names.
"""

from __future__ import annotations

import logging
import time

from outrider.daemon.internal import own_request
from outrider.daemon.scheduler.loop import EngineLoop
from outrider.plugins.sampling_spec import SamplingSpec

log = logging.getLogger("outrider.engine")


def warm_up(loop: EngineLoop, ladder: bool) -> None:
    """The sampled rows' batches, then with ``ladder`` the prompt ladder (module docstring)."""
    started = time.monotonic()
    for rid in (-1, -2):
        sampling = SamplingSpec(temperature=1.0, top_p=0.9, top_k=4, seed=1, logprobs=2)
        loop.scheduler.add(own_request(rid, "warm-up", [0] * 4, 2 - rid, sampling))
    _drain(loop)
    if ladder:
        limits = loop.scheduler.planner.limits
        batches = prompt_ladder(
            limits.max_running, limits.chunked_prefill_tokens, limits.context_length - 1
        )
        vocab = loop.runner.limits.vocab_limit
        rid = -3
        for first, (rows, longest) in enumerate(batches):
            # Its own first token (below the vocabulary), then one-token rows of any token.
            token = 1 + first % (vocab - 1)
            loop.scheduler.add(own_request(rid, "warm-up", [token] * longest, 1))
            for row in range(1, rows):
                loop.scheduler.add(own_request(rid - row, "warm-up", [row % vocab], 1))
            rid -= rows
            _drain(loop)
    loop.idle_check()  # once: it walks every page
    log.info("warm-up done in %.2f s", time.monotonic() - started)


def prompt_ladder(max_rows: int, budget: int, longest_limit: int) -> list[tuple[int, int]]:
    """``(rows, longest)`` prompt batches: the longest prompt's tokens 1, 2, 4, ... and the
    largest that fits (``budget`` tokens a step, ``longest_limit`` a prompt), each alone and
    with as many one-token rows beside it as fit (``max_rows`` rows, ``budget`` tokens)."""
    top = min(budget, longest_limit)
    if top < 1:  # no prompt fits with a token after it
        return []
    lengths = [1 << i for i in range(top.bit_length()) if 1 << i < top] + [top]
    batches = []
    for longest in lengths:
        batches.append((1, longest))
        rows = min(max_rows, budget - longest + 1)
        if rows > 1:
            batches.append((rows, longest))
    return batches


def _drain(loop: EngineLoop) -> None:
    while loop.has_work:
        loop.iterate()
