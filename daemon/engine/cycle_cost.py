"""The cost of a speculative cycle in plain steps, measured before READY: the acceptance length
at which drafting pays (``BreakEven``, scheduler/drafting.py), per batch size, for greedy and
for sampled batches.

At each size a batch of requests decodes through the loop, first drafting every step (at each
drafting width: the engine's, then its shape cut to halved sizes where it cuts one), then
plain; the ratio of a width's turns' times to the plain ones' is its break-even acceptance
length.

- On the CPU a turn is the fastest one's time in the loop thread's CPU time: other work on the
  host only ever slows a turn down, and an oversubscribed host stretches wall time in a way no
  minimum removes. Torch's worker threads are not counted: the loop thread runs its share of
  every parallel region, so the ratio holds while both kinds of step split alike.
- On a GPU a turn's host work and the device's step overlap: the turn is the mean wall time
  between the ends of consecutive turns, each of which waits for the step before it, so it
  costs the slower of the two.
- A cycle's cost does not depend on what its drafts are, but on whether the batch samples (a
  sampled batch races over the vocabulary at every verified position and draws its drafts
  from the draft's distribution) and whether a sampled row cuts by top-k or top-p (the batch
  then sorts every sampled row's vocabulary): every size is timed with greedy rows and with
  sampled ones that cut (temperature 1, top-p ``SAMPLED_TOP_P``; the cuts cost the same
  whatever their values), the dearer sampled kind.
- A width is timed only at sizes whose rows its step takes (``SchedulerLimits.drafting_rows``,
  from the memory plan); past them its break-even is infinite (``BreakEven.max_rows``).
- Every row's prompt is ``PROMPT`` tokens, about a chat turn's context, so that the draft's
  catch-up and the verify read a serving-sized context (shorter where the context length
  leaves no room). The rows share all but their last token through the prefix cache; sizes
  whose rows the pool could not hold without retracting are skipped (a row holds what each
  mode's turns may commit at most), and a batch past the largest size timed reads the line
  through the last two sizes on (scheduler/acceptance.py's ``between``).
- The prompts are random tokens (``timing_prompts``), each row's last one its own, so that
  greedy rows generate different tokens and a mixture of experts routes the timed steps'
  tokens as it routes text: a verify of ``N`` tokens a row reaches up to ``N * top_k`` experts
  where a plain step reaches ``top_k``, the cost that makes drafting dearer on such a target at
  small batches. Identical prompts (or one token repeated) would route every token of a step
  to the same experts and understate it.
- The resume: where plain steps defer the draft's catch-up (engine/deferred.py), a drafting
  step right after plain ones runs the catch-up first. At the smallest size, greedy, drafting
  resumes after two plain turns three times; what such a turn takes beyond a drafting turn,
  over a plain turn, is ``BreakEven.resume``.
- The unfed plain step: where the draft keeps state over the context, a last batch at the
  smallest size runs plain turns, then its rows stop feeding the draft (``Request.fed``) and
  plain turns are timed again: the first turn's time over the second's is
  ``BreakEven.unfed``. It comes last, so that no other batch meets the pages its requests
  publish as lacking the draft's state.

The log line says how long the timing took. Measured costs: BENCHMARKS.md.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

from outrider.daemon.engine.step_memory import rows_at
from outrider.daemon.internal import own_request
from outrider.daemon.scheduler.acceptance import BreakEven
from outrider.daemon.scheduler.drafting import FixedDrafting
from outrider.daemon.scheduler.loop import EngineLoop
from outrider.plugins.api import StepShape
from outrider.plugins.sampling_spec import SamplingSpec

log = logging.getLogger("outrider.engine")

# Batch sizes measured, up to the most running requests: past 64 rows a verify of several
# tokens a row is compute-bound (at 256 rows an 8B target's drafting step lost to plain steps
# at an acceptance of 2), so the large batches an operator allows are measured too.
SIZES = (1, 4, 16, 64, 128, 256)
CPU_TURNS = 4  # the CPU device: loop turns timed per mode, the fastest taken
GPU_TURNS = 8  # a GPU: intervals between turn ends averaged per mode
PROMPT = 256  # tokens of each request's prompt, where the context allows
PROMPT_SEED = 0  # timing_prompts draws the same prompts at every start
RESUMES = 3  # resumes timed at the smallest size (greedy)
PLAIN_BEFORE_RESUME = 2  # plain turns before each: a plain step in flight, positions buffered
SAMPLED_TEMPERATURE = 1.0
SAMPLED_TOP_P = 0.95


def measure_break_even(
    loop: EngineLoop, shape: StepShape, widths: tuple[int, ...], pool_tokens: int
) -> BreakEven:
    """The break-even acceptance length at each measurable size, for each drafting width of
    ``widths`` (the engine's first, then its chain cut short; ``loop`` is left idle, its
    prefix cache holding the timing's prompt)."""
    started = time.perf_counter()
    limits, page_size = loop.scheduler.planner.limits, loop.scheduler.pages.page_size
    # What a row may commit: per mode (each width, then plain) one turn that runs the mode
    # before's step in flight, the timed turns and one more, each up to its width's commit;
    # then the resumes, each after its plain turns.
    turns = _timed_turns(loop) + 2
    new_tokens = sum(turns * shape.cut(width).max_commit for width in (*widths, 1))
    new_tokens += RESUMES * (PLAIN_BEFORE_RESUME + shape.cut(widths[0]).max_commit)
    step_room = 2 * shape.kv_span
    length = max(min(PROMPT, limits.context_length - new_tokens - step_room), 1)
    # A row's own pages: the generated tokens, the step's span, the prefix hit's margin pages
    # (recomputed) and the prompt's partial page, which holds its own last token.
    row = new_tokens + step_room + (loop.scheduler.pages.prefix_margin_pages + 1) * page_size
    sizes = [
        bs for bs in SIZES if bs <= limits.max_running and length + 2 * bs * row <= pool_tokens
    ] or [1]
    prompts = timing_prompts(max(sizes), length, loop.runner.limits.vocab_limit)
    max_rows = tuple(rows_at(limits.drafting_rows, width, limits.max_running) for width in widths)
    # The resume's cost, once: at the smallest size, greedy, where the runner defers catch-ups.
    resume_at = sizes[0] if loop.runner.deferred is not None and max_rows[0] else 0
    costs = partial(_cycle_costs, loop, new_tokens=new_tokens, widths=widths, max_rows=max_rows)
    timed = [costs(prompts[:bs], temperature=0.0, resume=bs == resume_at) for bs in sizes]
    greedy = [ratios for ratios, _ in timed]  # [size][width]
    sampled = [costs(prompts[:bs], temperature=SAMPLED_TEMPERATURE)[0] for bs in sizes]
    resume = timed[0][1]
    extras = ""
    if resume_at:
        extras += (
            f"; resuming it after plain steps costs {resume:.2f} plain steps more (the draft's "
            "catch-up)"
        )
    unfed = 1.0
    if limits.draft_state:  # last: its requests publish pages as lacking the draft's state
        unfed = _unfed_cost(loop, prompts[: sizes[0]], new_tokens)
        extras += f"; a plain step costs {unfed:.2f} of the target's own"
    for w, width in enumerate(widths):
        log.info(
            "drafting %d tokens a row pays from an acceptance length of %s greedy, %s sampled "
            "(batch %s, %d-token prompts; the cycle's time over a plain step's; -: more rows "
            "than its step takes)%s",
            width - 1, _listed(greedy, w), _listed(sampled, w), ", ".join(map(str, sizes)),
            length, extras if w == 0 else "",
        )  # fmt: skip
    log.info("drafting timed in %.1f s", time.perf_counter() - started)
    cuts = range(1, len(widths))  # the chain cut short, deepest first
    return BreakEven(
        tuple(sizes),
        tuple(ratios[0] for ratios in greedy),
        tuple(ratios[0] for ratios in sampled),
        resume,
        unfed,
        cut_drafts=tuple(widths[w] - 1 for w in cuts),
        cut_greedy=tuple(tuple(ratios[w] for ratios in greedy) for w in cuts),
        cut_sampled=tuple(tuple(ratios[w] for ratios in sampled) for w in cuts),
        max_rows=max_rows,
    )


def _listed(taus: list[tuple[float, ...]], w: int) -> str:
    return ", ".join(f"{ratios[w]:.2f}" if ratios[w] < math.inf else "-" for ratios in taus)


def timing_prompts(rows: int, length: int, vocab: int) -> list[list[int]]:
    """``rows`` prompts of ``length`` random ids below ``vocab`` (seeded): one text, but for
    each row's own last token."""
    rng = random.Random(PROMPT_SEED)
    shared = [rng.randrange(vocab) for _ in range(length - 1)]
    return [[*shared, rng.randrange(vocab)] for _ in range(rows)]


@contextmanager
def _timing_batch(
    loop: EngineLoop, prompts: list[list[int]], new_tokens: int, temperature: float
) -> Iterator[FixedDrafting]:
    """A row per prompt at ``temperature`` (row ``i`` seeded ``i``) decoding under the yielded
    policy (the engine's width first); aborted and drained afterwards, the loop's policy
    restored."""
    scheduler = loop.scheduler
    policy = FixedDrafting(loop.runner.shape.width)
    previous = scheduler.policy
    scheduler.use_policy(policy)
    bs = len(prompts)
    rids = [-100 - i for i in range(bs)]
    for i, (rid, prompt) in enumerate(zip(rids, prompts, strict=True)):
        top_p = SAMPLED_TOP_P if temperature else 1.0
        sampling = SamplingSpec(temperature, top_p, seed=i)
        scheduler.add(own_request(rid, "cycle-cost", prompt, new_tokens, sampling))
    while not all(req.decoding for req in scheduler.running) or len(scheduler.running) < bs:
        loop.iterate()
    try:
        yield policy
    finally:
        for rid in rids:
            scheduler.abort(rid, "start-up timing done")
        while loop.has_work:
            loop.iterate()
        scheduler.take_updates()
        scheduler.use_policy(previous)


def _cycle_costs(
    loop: EngineLoop,
    prompts: list[list[int]],
    new_tokens: int,
    temperature: float,
    widths: tuple[int, ...],
    max_rows: tuple[int, ...],
    resume: bool = False,
) -> tuple[tuple[float, ...], float]:
    """A drafting turn's time over a plain turn's (``_turn_time``) at each of ``widths`` whose
    step takes a row per prompt (``max_rows``; infinite for the others), the rows at
    ``temperature``; and with ``resume``, what a drafting turn of the first width right after
    plain ones costs beyond one, in plain turns (``_resume_time``), else 0."""
    with _timing_batch(loop, prompts, new_tokens, temperature) as policy:
        turn = dict.fromkeys(widths, math.inf)
        for width, most in (*zip(widths, max_rows, strict=True), (1, len(prompts))):
            if len(prompts) > most:
                continue
            policy.fixed = width
            loop.iterate()
            turn[width] = _turn_time(loop)
        extra = 0.0
        if resume:
            extra = max(_resume_time(loop, policy, widths[0]) - turn[widths[0]], 0.0) / turn[1]
    return tuple(max(turn[width] / turn[1], 1.0) for width in widths), extra


def _unfed_cost(loop: EngineLoop, prompts: list[list[int]], new_tokens: int) -> float:
    """A plain turn's time over that of the same greedy rows (a row per prompt) once they stop
    feeding the draft (``Request.fed``; their buffered positions are dropped)."""
    with _timing_batch(loop, prompts, new_tokens, 0.0) as policy:
        policy.fixed = 1
        loop.iterate()
        plain = _turn_time(loop)
        for req in loop.scheduler.running:
            req.fed = False
        loop.iterate()
        return max(plain / _turn_time(loop), 1.0)


def _resume_time(loop: EngineLoop, policy: FixedDrafting, width: int) -> float:
    """A drafting turn of ``width`` right after plain turns (their positions buffered), timed
    as ``_turn_time`` times one turn: the fastest of ``RESUMES`` in thread CPU time on the CPU
    device, else their mean wall time from the end of the plain turn before."""
    cpu = loop.runner.device.type == "cpu"
    clock = time.thread_time if cpu else time.perf_counter
    times = []
    for _ in range(RESUMES):
        policy.fixed = 1
        for _ in range(PLAIN_BEFORE_RESUME):
            loop.iterate()
        policy.fixed = width
        started = clock()
        loop.iterate()
        times.append(clock() - started)
    return min(times) if cpu else sum(times) / len(times)


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
