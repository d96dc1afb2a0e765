"""Whether a decode batch drafts: speculation only where its measured acceptance pays for it.

A drafting step (a speculative cycle: draft, verify ``width`` tokens a row, catch-up) costs
``break_even`` times a plain step (one token a row, the catch-up only) and commits the rows'
acceptance length ``tau`` (1 + accepted drafts) where the plain step commits 1. So a batch
drafts when its rows' mean estimated ``tau`` reaches ``break_even`` at the batch's size and
kind (greedy, or sampled when any row samples: sampling costs a cycle more, cycle_cost.py):
measured at start (cycle_cost.py's ``measure_break_even``) or set with
``--speculative-min-acceptance`` (0: always draft, the policy off).

Estimates, all updated from the commit counts the host sees (outputs.py), per kind of request
(``kind_of``: greedy, or a temperature band; acceptance differs several-fold between them):

- per kind, the engine's mean commit length over every request's drafting steps: the plain
  mean of its first observations, then a moving average (``engine_smoothing``);
- per request, a moving average of its commit lengths (``smoothing``), started at its kind's
  mean; a request with no drafting step yet is estimated at its kind's mean.

A kind never observed has no estimate: its rows count at the break-even (after a plain step,
at the resume threshold below), so a batch of them drafts (to learn) and a mixed batch decides
by the others. There is no optimistic start: once one cycle of a kind has been seen, its
requests start where that kind's acceptance was measured, so a weak draft at T = 1.0 stops
after its first cycle whose commits fall short (and a later request of the kind starts
plain), while a good draft at T = 0 drafts from the first step of every request.

Resuming drafting after plain steps costs more than a cycle: the draft first catches up on the
positions the plain steps buffered (engine/deferred.py), one batch whose cost hardly depends on
its length, measured at start as ``BreakEven.resume``. A batch whose acceptance hovers at the
break-even would pay it every few steps, so drafting resumes only where ``resume_horizon``
cycles at the batch's mean would gain the catch-up back: from ``break_even + resume /
resume_horizon``. A run, once resumed, goes on at the break-even itself; a probe's result
resumes one only past that threshold too.

A batch that stays plain learns nothing, so after ``probe_every`` plain steps in a row the
batch drafts once (a probe); each probe that does not bring drafting back doubles the wait, up
to ``max_probe_every`` (``probe_cap``: where probes take 1 % of the time), so that a batch whose
acceptance stays low pays one cycle's excess and one catch-up every ``max_probe_every`` steps
at most; a shorter cap sees a change of acceptance sooner. Under the overlap loop a decision is
made before the previous step's commits are known: estimates lag one step, which changes only
when drafting resumes or stops, never what is committed (the runner's module docstring says
why). Drafts drawn with ``"sample": "rejection"`` are the exception: every committed token is
distributed as the target's either way, but which tokens a seed gives then depends on which
steps drafted.

Feeding the draft: a draft that keeps state over the context (EAGLE-3, DFlash, a standalone
draft: its own KV) costs a request something even where no step drafts: the target's forwards
capture its layers, plain steps buffer them, and the draft catches up on them, at the end of
the request too. A request of a kind whose acceptance does not pay for drafting does not feed
the draft at all (``Request.fed`` False, decided at its first admission by ``feeds``, at the
size of the batch it joins: the running requests and those queued behind it, which a burst
admitted one by one decodes beside, at most ``--max-running``): its
steps are the target's alone, as without speculation, and its pages enter the prefix cache
marked as lacking the draft's KV (radix.py). A kind pays where its mean reaches the break-even
counted against the target's own plain step (``BreakEven.unfed``: what a fed plain step costs
over it), plus the resume margin. Every ``probe_requests`` unfed admissions of a kind (doubling
up to ``max_probe_requests``) one is fed anyway (``Request.probe``): it counts as unobserved,
so it drafts, and measures its kind again. A fed request stops feeding the draft for good
where a batch of it runs plain and its acceptance does not pay for feeding at that batch's
size: its own mean once it drafted ``demote_after`` times, before that its kind's once the
kind was observed as often (a probe keeps feeding until it drafted). What it had buffered is
dropped, never caught up. So a first wave of an unobserved kind, fed to learn, stops feeding
after the cycle that measured it where its batch is too large for drafting to pay. An
unfed row counts an acceptance length of 1 in a mixed batch; a batch of unfed rows never
drafts.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Protocol

from outrider.daemon.scheduler.request import Request

log = logging.getLogger("outrider.scheduler")


class DraftPolicy(Protocol):
    def drafting(self, rows: list[Request]) -> bool:
        """Whether the decode batch of ``rows`` drafts."""
        ...

    def feeds(self, req: Request, others: int) -> bool:
        """Whether ``req``, admitted into a batch of ``others`` requests besides it, feeds
        the draft."""
        ...

    def observe(self, req: Request, commit_len: int) -> None:
        """A drafting step of ``req`` committed ``commit_len`` tokens (1 + accepted drafts)."""
        ...


class FixedDrafting:
    """Every decode batch drafts (``on``: the policy off), or none does (start-up timing)."""

    def __init__(self, on: bool = True) -> None:
        self.on = on

    def drafting(self, rows: list[Request]) -> bool:
        return self.on

    def feeds(self, req: Request, others: int) -> bool:
        return True

    def observe(self, req: Request, commit_len: int) -> None:
        pass


class AlternateDrafting:
    """Every other decode batch drafts and every other request feeds the draft, whatever was
    accepted: the warm-up before READY runs every kind of step, and tests check that outputs
    do not depend on the choices."""

    def __init__(self) -> None:
        self.decisions: list[bool] = []
        self.fed: list[bool] = []

    def drafting(self, rows: list[Request]) -> bool:
        self.decisions.append(len(self.decisions) % 2 == 0)
        return self.decisions[-1]

    def feeds(self, req: Request, others: int) -> bool:
        self.fed.append(len(self.fed) % 2 == 0)
        return self.fed[-1]

    def observe(self, req: Request, commit_len: int) -> None:
        pass


# Upper edges of the sampled requests' temperature bands (a kind each; greedy is kind 0).
TEMPERATURE_BANDS = (0.5, 0.9)


def kind_of(req: Request) -> int:
    """0 for a greedy request; 1, 2, ... for the temperature bands of sampled ones."""
    temperature = req.sampling.temperature
    if temperature == 0.0:
        return 0
    return 1 + bisect.bisect_left(TEMPERATURE_BANDS, temperature)


def kind_name(kind: int) -> str:
    """``kind_of``'s kind in words: "greedy", or its temperature band."""
    if kind == 0:
        return "greedy"
    low = TEMPERATURE_BANDS[kind - 2] if kind > 1 else 0.0
    if kind > len(TEMPERATURE_BANDS):
        return f"T > {low}"
    return f"{low} < T <= {TEMPERATURE_BANDS[kind - 1]}"


@dataclass(frozen=True)
class BreakEven:
    """The acceptance length at which a cycle pays, by batch size and kind: ``greedy[i]`` and
    ``sampled[i]`` measured at ``sizes[i]`` (ascending); a batch takes the value of the largest
    size it reaches (the smallest size's below it), ``sampled`` when any row samples."""

    sizes: tuple[int, ...]
    greedy: tuple[float, ...]
    sampled: tuple[float, ...]
    resume: float = 0.0  # what resuming after plain steps costs beyond a cycle, in plain steps
    unfed: float = 1.0  # a plain step's time over the target's own (no row feeding the draft)

    @classmethod
    def fixed(cls, tau: float) -> BreakEven:
        return cls((1,), (tau,), (tau,))

    def at(self, bs: int, all_greedy: bool) -> float:
        i = max(bisect.bisect_right(self.sizes, bs) - 1, 0)
        return (self.greedy if all_greedy else self.sampled)[i]


@dataclass(frozen=True)
class AdaptiveSettings:
    break_even: BreakEven
    smoothing: float = 0.3  # weight of a request's newest commit length in its average
    engine_smoothing: float = 0.05  # the same in its kind's mean, once past 1 / count
    resume_horizon: int = 8  # cycles a resumed run must last to gain its catch-up back
    probe_every: int = 8  # plain steps before the first probe
    # At most this many plain steps between probes; None: ``probe_cap`` of the break-even.
    max_probe_every: int | None = None
    probe_requests: int = 4  # unfed admissions of a kind before its first fed probe
    max_probe_requests: int = 64
    demote_after: int = 8  # drafting steps of a request before its own mean may stop feeding


PROBE_SHARE = 0.01  # of a plain batch's time, what its probes may take at most
PROBE_CAP_RANGE = (64, 1024)


def probe_cap(break_even: BreakEven) -> int:
    """Plain steps between probes at most: a probe at low acceptance costs its cycle's excess
    over the one token it commits, ``break_even - 1`` plain steps (the dearest sampled size),
    and the catch-up before it (``resume``); once every this many plain steps it takes
    ``PROBE_SHARE`` of the time, within ``PROBE_CAP_RANGE``."""
    cost = max(break_even.sampled) - 1.0 + break_even.resume
    low, high = PROBE_CAP_RANGE
    return min(max(round(cost / PROBE_SHARE), low), high)


@dataclass
class KindMean:
    """The mean commit length of one kind's drafting steps: the plain mean of the first
    ``1 / weight`` observations, then a moving average with ``weight``."""

    value: float = 0.0
    count: int = 0

    def add(self, commit_len: int, weight: float) -> None:
        self.count += 1
        self.value = _moved(self.value, commit_len, max(weight, 1.0 / self.count))


class AdaptiveDrafting:
    """The policy of the module docstring."""

    def __init__(self, settings: AdaptiveSettings) -> None:
        self.settings = settings
        self.kind_tau: dict[int, KindMean] = {}  # kinds observed so far
        self.probe_every = settings.probe_every
        self.max_probe_every = settings.max_probe_every or probe_cap(settings.break_even)
        self.plain_run = 0  # plain steps in a row
        self.drafting_run = True  # the last decision drafted by the estimates (a probe: not)
        # Per kind: unfed admissions since its last fed one, and how many make a probe.
        self.unfed_run: dict[int, int] = {}
        self.probe_requests: dict[int, int] = {}
        self.kind_feeds: dict[int, bool] = {}  # the last feeding choice of each kind

    def estimate(self, req: Request) -> float | None:
        """``req``'s estimated acceptance length; None while its kind was never observed,
        and for a probe that has not drafted yet."""
        if req.fed is False:
            return 1.0  # its drafts have no context
        if req.tau_estimate > 0.0:
            return req.tau_estimate
        kind = self.kind_tau.get(kind_of(req))
        return kind.value if kind is not None and not req.probe else None

    def feeding_pays_from(self, req: Request, batch: int) -> float:
        """The acceptance length from which drafting for ``req`` in a batch of ``batch`` pays
        for feeding the draft: the break-even against the target's own plain step, resumed."""
        break_even = self.settings.break_even
        pays_from = break_even.at(batch, req.sampling.temperature == 0.0) * break_even.unfed
        return pays_from + break_even.resume / self.settings.resume_horizon

    def feeds(self, req: Request, others: int) -> bool:
        settings, kind = self.settings, kind_of(req)
        mean = self.kind_tau.get(kind)
        pays_from = self.feeding_pays_from(req, others + 1)
        pays = mean is None or mean.value >= pays_from
        if mean is not None and pays != self.kind_feeds.get(kind, True):
            log.info(
                "%s requests %s the draft: their mean acceptance length %.2f, feeding pays "
                "from %.2f", kind_name(kind), "feed" if pays else "stop feeding", mean.value,
                pays_from,
            )  # fmt: skip
        self.kind_feeds[kind] = pays
        if pays:
            self.unfed_run[kind] = 0
            self.probe_requests[kind] = settings.probe_requests
            return True
        self.unfed_run[kind] = self.unfed_run.get(kind, 0) + 1
        wait = self.probe_requests.setdefault(kind, settings.probe_requests)
        if self.unfed_run[kind] <= wait:
            return False
        self.unfed_run[kind] = 0
        self.probe_requests[kind] = min(2 * wait, settings.max_probe_requests)
        req.probe = True
        return True

    def drafting(self, rows: list[Request]) -> bool:
        if all(req.fed is False for req in rows):
            return False
        all_greedy = all(req.sampling.temperature == 0.0 for req in rows)
        break_even = self.settings.break_even.at(len(rows), all_greedy)
        estimates = [self.estimate(req) for req in rows]
        threshold = break_even
        if not self.drafting_run:
            threshold += self.settings.break_even.resume / self.settings.resume_horizon
        mean = sum(threshold if e is None else e for e in estimates) / len(rows)
        self.drafting_run = mean >= threshold
        if self.drafting_run:
            self.plain_run = 0
            self.probe_every = self.settings.probe_every
            return True
        for req in rows:
            self._demote(req, len(rows))
        if all(req.fed is False for req in rows):
            return False
        if self.plain_run >= self.probe_every:
            self.plain_run = 0
            self.probe_every = min(2 * self.probe_every, self.max_probe_every)
            return True
        self.plain_run += 1
        return False

    def _demote(self, req: Request, batch: int) -> None:
        """``req``, in a plain batch of ``batch`` rows, stops feeding the draft where its
        mean, or its kind's, does not pay for feeding there (docstring)."""
        if not req.fed:
            return
        drafted, kind = req.spec_drafts, self.kind_tau.get(kind_of(req))
        if drafted >= self.settings.demote_after:
            mean = 1.0 + req.spec_accepted_tokens / drafted
        elif kind is None or kind.count < self.settings.demote_after:
            return
        elif req.probe and drafted == 0:
            return  # fed to measure its kind again
        else:
            mean = kind.value
        req.fed = mean >= self.feeding_pays_from(req, batch)

    def observe(self, req: Request, commit_len: int) -> None:
        settings, start = self.settings, self.estimate(req)
        if start is None:
            req.tau_estimate = float(commit_len)
        else:
            req.tau_estimate = _moved(start, commit_len, settings.smoothing)
        kind = self.kind_tau.setdefault(kind_of(req), KindMean())
        kind.add(commit_len, settings.engine_smoothing)


def _moved(average: float, value: float, weight: float) -> float:
    return (1.0 - weight) * average + weight * value
