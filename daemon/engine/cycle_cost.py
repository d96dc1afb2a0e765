"""The cost of a speculative cycle in plain steps, measured before READY: the acceptance length
at which drafting pays (``BreakEven``, scheduler/drafting.py), per batch size, for greedy and
for sampled batches.

At each size a batch of requests decodes through the loop, first drafting every step, then
plain; the ratio of their turns' times is the break-even acceptance length. On the CPU device
a turn is the fastest one's time in the loop thread's CPU time (other work on the host only
ever slows a turn down, so the minimum is the steadiest estimate): when the host is
oversubscribed, other processes stretch every turn's wall time, which no minimum removes (the
family's EAGLE-3 measured 1.00 to 2.90 in wall time, 1.65 to 1.71 in CPU time, at a load of 5
on 2 cores); the process's other threads (its sockets' I/O) do no part of a step. Torch's
worker threads, where there are several, are not counted either: the loop thread runs its
share of every parallel region, so the ratio holds while both kinds of step split alike. On a
GPU a turn's host work and the device's step overlap, and one turn's wall time is only the
host's part when the device is ahead: the turn is the mean wall time between the ends of
consecutive turns, each of which waits for the step before it, so it costs the slower of the
two (the fastest single turn gave the family 1.00-1.25 on an H100, where a cycle costs about
1.7 plain steps).

A cycle's cost does not depend on what its drafts are, so the requests' tokens do not matter,
but it depends on whether the batch samples: a sampled batch sorts the vocabulary at every
verified position where a plain step sorts it once, and draws its drafts from the draft's
distribution. So every size is timed twice, with greedy rows and with sampled ones
(temperature 1; the filters cost the same whatever their values). On the family (CPU, batch
1) the greedy cycle costs 1.6-1.7 plain steps for EAGLE-3 (S = 3) and 2.0 for DFlash, the
sampled one 1.9-2.0 and 2.7-3.0.

Where the cycle is paid: every row's prompt is ``PROMPT`` tokens, about a chat turn's context
when it decodes (the family's held-out prompts are 50-200 tokens through the template, its
answers 64-256 tokens), so that the draft's catch-up and the verify's attention read a
serving-sized context; shorter where the context length leaves no room for the timing's
tokens. On the family (CPU) a plain step and a cycle each grow about 15 % from a 4-token to a
350-token context and their ratio stays within the noise, so one length stands for all. The
rows share one prompt through the prefix cache: it is computed once (the first size has one
row), and the pool must hold it once plus each row's own pages; sizes whose rows the pool
could not hold without retracting are skipped.

Cost at start: at each size, two kinds of batch x 2 modes x (1 + the timed turns) turns, plus
one prompt; the log line says how long it took (on the family, CPU: about 0.5 s at batch 1,
1.2-1.5 s at batch 1 and 4, against 0.6 s for the greedy 4-token timing before).
"""

from __future__ import annotations

import logging
import time

from outrider.daemon.internal import SamplingSpec, own_request
from outrider.daemon.scheduler.drafting import BreakEven, FixedDrafting
from outrider.daemon.scheduler.loop import EngineLoop
from outrider.plugins.api import StepShape

log = logging.getLogger("outrider.engine")

SIZES = (1, 4, 16, 64)  # batch sizes measured, up to the most running requests
CPU_TURNS = 4  # the CPU device: loop turns timed per mode, the fastest taken
GPU_TURNS = 8  # a GPU: intervals between turn ends averaged per mode
PROMPT = 256  # tokens of each request's prompt, where the context allows
SAMPLED_TEMPERATURE = 1.0


def measure_break_even(loop: EngineLoop, shape: StepShape, pool_tokens: int) -> BreakEven:
    """The break-even acceptance length at each measurable size (``loop`` is left idle, its
    prefix cache holding the timing's prompt)."""
    started = time.perf_counter()
    limits, page_size = loop.scheduler.planner.limits, loop.scheduler.pages.page_size
    # Per mode: one turn that runs the other mode's step in flight, then the timed turns.
    new_tokens = 2 * (_timed_turns(loop) + 2) * shape.max_commit
    step_room = 2 * shape.kv_span
    prompt = max(min(PROMPT, limits.context_length - new_tokens - step_room), 1)
    # A row's own pages: the generated tokens, the step's span, the prefix hit's margin pages
    # (recomputed) and the prompt's partial page.
    row = new_tokens + step_room + (loop.scheduler.pages.prefix_margin_pages + 1) * page_size
    sizes = [
        bs for bs in SIZES if bs <= limits.max_running and prompt + 2 * bs * row <= pool_tokens
    ] or [1]
    greedy = tuple(_cycle_cost(loop, bs, [0] * prompt, new_tokens, 0.0) for bs in sizes)
    sampled = tuple(
        _cycle_cost(loop, bs, [0] * prompt, new_tokens, SAMPLED_TEMPERATURE) for bs in sizes
    )
    log.info(
        "drafting pays from an acceptance length of %s greedy, %s sampled (batch %s, "
        "%d-token prompts; the cycle's time over a plain step's; timed in %.1f s)",
        _listed(greedy), _listed(sampled), ", ".join(map(str, sizes)), prompt,
        time.perf_counter() - started,
    )  # fmt: skip
    return BreakEven(tuple(sizes), greedy, sampled)


def _listed(taus: tuple[float, ...]) -> str:
    return ", ".join(f"{tau:.2f}" for tau in taus)


def _cycle_cost(
    loop: EngineLoop, bs: int, prompt: list[int], new_tokens: int, temperature: float
) -> float:
    """A drafting turn's time over a plain turn's (``_turn_time``), for ``bs`` rows at
    ``temperature`` (row ``i`` seeded ``i``)."""
    scheduler = loop.scheduler
    policy = FixedDrafting(on=True)
    previous = scheduler.policy
    scheduler.use_policy(policy)
    rids = [-100 - i for i in range(bs)]
    for i, rid in enumerate(rids):
        sampling = SamplingSpec(temperature, seed=i)
        scheduler.add(own_request(rid, "cycle-cost", prompt, new_tokens, sampling))
    while not all(req.decoding for req in scheduler.running) or len(scheduler.running) < bs:
        loop.iterate()
    turn = {}
    for drafting in (True, False):
        policy.on = drafting
        loop.iterate()
        turn[drafting] = _turn_time(loop)
    for rid in rids:
        scheduler.abort(rid, "start-up timing done")
    while loop.has_work:
        loop.iterate()
    scheduler.take_updates()
    scheduler.use_policy(previous)
    return max(turn[True] / turn[False], 1.0)


def _timed_turns(loop: EngineLoop) -> int:
    return CPU_TURNS if loop.runner.device.type == "cpu" else GPU_TURNS + 1


def _turn_time(loop: EngineLoop) -> float:
    """A turn of the current mode (module docstring): on the CPU device the fastest of
    ``CPU_TURNS`` in the loop thread's CPU time, else the mean wall time between the ends of
    ``GPU_TURNS + 1`` turns."""
    if loop.runner.device.type == "cpu":
        times = []
        for _ in range(CPU_TURNS):
            started = time.thread_time()
            loop.iterate()
            times.append(time.thread_time() - started)
        return min(times)
    ends = []
    for _ in range(GPU_TURNS + 1):
        loop.iterate()
        ends.append(time.perf_counter())
    return (ends[-1] - ends[0]) / GPU_TURNS
