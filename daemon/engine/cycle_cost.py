"""The cost of a speculative cycle in plain steps, measured before READY: the acceptance length
at which drafting pays (``BreakEven``, scheduler/drafting.py) at a few batch sizes.

At each size a batch of greedy requests decodes through the loop, first drafting every step,
then plain; the ratio of the fastest loop turns is the break-even acceptance length (the
fastest: other work on the host only ever slows a turn down, so the minimum is the steadiest
estimate of what the step itself costs). A cycle's
cost does not depend on what its drafts are, so the requests' tokens do not matter. The
requests are short (a few pages each) and sizes whose batch the KV pool could not hold without
retracting are skipped.
"""

from __future__ import annotations

import logging
import time

from outrider.daemon.internal import own_request
from outrider.daemon.scheduler.drafting import BreakEven, FixedDrafting
from outrider.daemon.scheduler.loop import EngineLoop
from outrider.plugins.api import StepShape

log = logging.getLogger("outrider.engine")

SIZES = (1, 4, 16, 64)  # batch sizes measured, up to the most running requests
TIMED_TURNS = 7  # loop turns timed per mode; the fastest is taken
PROMPT = 4  # tokens of each request's prompt


def measure_break_even(
    loop: EngineLoop, shape: StepShape, max_running: int, pool_tokens: int
) -> BreakEven:
    """The break-even acceptance length at each measurable size (``loop`` is left idle)."""
    # Per mode: one turn that runs the other mode's step in flight, then the timed turns.
    new_tokens = 2 * (TIMED_TURNS + 2) * shape.max_commit
    need = PROMPT + new_tokens + 2 * shape.kv_span
    sizes = [bs for bs in SIZES if bs <= max_running and 2 * bs * need <= pool_tokens] or [1]
    taus = tuple(_cycle_cost(loop, bs, new_tokens) for bs in sizes)
    log.info(
        "drafting pays from an acceptance length of %s (batch %s; the cycle's time over a "
        "plain step's)",
        ", ".join(f"{tau:.2f}" for tau in taus), ", ".join(map(str, sizes)),
    )  # fmt: skip
    return BreakEven(tuple(sizes), taus)


def _cycle_cost(loop: EngineLoop, bs: int, new_tokens: int) -> float:
    """A drafting turn's time over a plain turn's (the fastest of each), for ``bs`` rows."""
    scheduler = loop.scheduler
    policy = FixedDrafting(on=True)
    previous = scheduler.policy
    scheduler.use_policy(policy)
    rids = [-100 - i for i in range(bs)]
    for rid in rids:
        scheduler.add(own_request(rid, "cycle-cost", [0] * PROMPT, new_tokens))
    while not all(req.decoding for req in scheduler.running) or len(scheduler.running) < bs:
        loop.iterate()
    fastest = {}
    for drafting in (True, False):
        policy.on = drafting
        loop.iterate()
        times = []
        for _ in range(TIMED_TURNS):
            started = time.perf_counter()
            loop.iterate()
            times.append(time.perf_counter() - started)
        fastest[drafting] = min(times)
    for rid in rids:
        scheduler.abort(rid, "start-up timing done")
    while loop.has_work:
        loop.iterate()
    scheduler.take_updates()
    scheduler.use_policy(previous)
    return max(fastest[True] / fastest[False], 1.0)
