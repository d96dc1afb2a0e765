"""Whether a decode batch drafts: speculation only where its measured acceptance pays for it.

A drafting step (a speculative cycle: draft, verify ``width`` tokens a row, catch-up) costs
``break_even`` times a plain step (one token a row, the catch-up only) and commits the rows'
acceptance length ``tau`` (1 + accepted drafts) where the plain step commits 1. So a batch
drafts when its rows' mean estimated ``tau`` reaches ``break_even`` at the batch's size and
kind (greedy, or sampled when any row samples: sampling costs a cycle more, cycle_cost.py):
measured at start (cycle_cost.py's ``measure_break_even``) or set with
``--speculative-min-acceptance`` (0: always draft, the policy off).

How deep: where the engine cuts its steps short (``StepShape.cut``: a chain to its first
drafts, EAGLE-3's, n-gram's, a standalone draft's, DFlash's block; a tree to its best nodes)
and the break-even is measured at the sizes it cuts to (``StepShape.cuts``: its own, then
halved down to one draft), a batch takes the width whose expected commit length gains most
over its own break-even (a tie: the wider), and drafts where that gain reaches 1. A row's
commit length at ``d`` drafts is its estimate at the engine's shape scaled by the share of
accepted drafts its kind keeps at ``d``: a chain's from its first ``d`` positions
(``Positions``: per position, the steps that reached it and those that accepted it; a row
capped lower, ``Request.max_drafts``, counts at its cap), a tree's from what its whole steps
would have accepted cut to ``d`` nodes (``Sizes``, from each step's path ranks). A step cut
short counts back at the engine's shape by the same share, so every estimate below is at the
engine's shape. Probes draft the whole shape (every position and size measured); a kind
drafting cut short measures the rest only then. A width whose step takes fewer rows than the
batch has (``BreakEven.max_rows``: the memory plan's) is never chosen, nor probed: the probe
drafts the widest width the batch fits.

Estimates, all updated from the commit counts the host sees (outputs.py), per kind of request
(``kind_of``: greedy, or a temperature band; acceptance differs several-fold between them):

- per kind, the engine's mean commit length over every request's drafting steps: the plain
  mean of its first observations (as many as ``1 / engine_smoothing`` steps hold), then a
  moving average over steps. A step of ``n`` observed rows moves it by ``engine_smoothing /
  n`` a row, so that a step moves it about as far at any batch size and keeps all its rows.
  Over rows, a step of 256 would leave about the mean of its last 20 (a standard deviation
  of 0.15-0.2 at acceptance 2), enough to turn feeding near the break-even on and off;
- per request, a moving average of its commit lengths (``smoothing``), started at its kind's
  mean; a request with no drafting step yet is estimated at its kind's mean.

A kind learns until its ``evidence``-th observation: before, it has no estimate, its rows
count at the break-even (after a plain step, at the resume threshold below), so a batch of
them drafts (to learn) and a mixed batch decides by the others; its requests feed the draft,
and keep no estimate of their own. Commit lengths vary widely from step to step (a draft
accepted position by position with probability 0.5 commits 1 half the time and averages 2),
so a mean of a few steps would stop a draft that pays after an unlucky start, and with it
every later request of the kind, which then learns again only from probes that come ever
more rarely; over 20 steps the mean of such a draft has a standard deviation of about 0.3. The
learning costs a weak draft those cycles once per kind (one step at 20 rows or more).

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
size: its own mean (``Request.accepted_at_depth``) once it drafted ``demote_after`` times,
before that its kind's once the kind learned (a probe keeps feeding until it drafted). What it
had buffered is dropped, never caught up. So a first wave of an unobserved kind, fed to learn,
stops feeding after the cycle that measured it where its batch is too large for drafting to
pay (a wave of ``evidence`` rows or more learns in one cycle). An
unfed row counts an acceptance length of 1 in a mixed batch, and its commits there are not
observed (its drafts had no context); a batch of unfed rows never drafts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from outrider.daemon.scheduler.acceptance import (
    BreakEven,
    KindMean,
    Positions,
    Sizes,
    kind_name,
    kind_of,
    moved,
)
from outrider.daemon.scheduler.request import Request

log = logging.getLogger("outrider.scheduler")


class DraftPolicy(Protocol):
    def width(self, rows: list[Request]) -> int:
        """The tokens each row of the decode batch of ``rows`` verifies: 1, a plain step; the
        engine's width, a drafting step; or, where the engine cuts its chain short, a
        chain's of fewer drafts."""
        ...

    def feeds(self, req: Request, others: int) -> bool:
        """Whether ``req``, admitted into a batch of ``others`` requests besides it, feeds
        the draft."""
        ...

    def observe(
        self, req: Request, commit_len: int, drafts: int, ranks: list[int], rows: int
    ) -> None:
        """A drafting step that offered ``req`` ``drafts`` drafts (its chain's, or its cap;
        a tree's nodes) committed ``commit_len`` tokens (1 + accepted drafts); ``ranks``: a
        ranked tree's worst rank on the accepted path up to each accepted draft, else empty;
        ``rows``: the step's rows observed (those that feed the draft)."""
        ...


class FixedDrafting:
    """Every decode batch verifies ``width`` tokens a row: the engine's (the policy off),
    1 (start-up timing: plain steps), or a chain's cut short (timing it)."""

    def __init__(self, width: int) -> None:
        self.fixed = width

    def width(self, rows: list[Request]) -> int:
        return self.fixed

    def feeds(self, req: Request, others: int) -> bool:
        return True

    def observe(
        self, req: Request, commit_len: int, drafts: int, ranks: list[int], rows: int
    ) -> None:
        pass


class AlternateDrafting:
    """Every other decode batch drafts, through each of ``widths`` in turn (the engine's, and
    its chain cut short where it cuts), and every other request feeds the draft, whatever was
    accepted: the warm-up before READY runs every kind of step, and tests check that outputs
    do not depend on the choices."""

    def __init__(self, widths: tuple[int, ...]) -> None:
        self.widths = widths
        self.decisions: list[int] = []  # the widths chosen
        self.fed: list[bool] = []

    def width(self, rows: list[Request]) -> int:
        turn = len(self.decisions)
        self.decisions.append(self.widths[turn // 2 % len(self.widths)] if turn % 2 == 0 else 1)
        return self.decisions[-1]

    def feeds(self, req: Request, others: int) -> bool:
        self.fed.append(len(self.fed) % 2 == 0)
        return self.fed[-1]

    def observe(
        self, req: Request, commit_len: int, drafts: int, ranks: list[int], rows: int
    ) -> None:
        pass


@dataclass(frozen=True)
class AdaptiveSettings:
    break_even: BreakEven
    # Weight of a request's newest commit length in its average: low, since at one row its
    # estimate alone decides each step, and a commit length's spread is about its mean.
    smoothing: float = 0.1
    engine_smoothing: float = 0.05  # the same in its kind's mean, once past 1 / count
    resume_horizon: int = 8  # cycles a resumed run must last to gain its catch-up back
    probe_every: int = 8  # plain steps before the first probe
    # At most this many plain steps between probes; None: ``probe_cap`` of the break-even.
    max_probe_every: int | None = None
    probe_requests: int = 4  # unfed admissions of a kind before its first fed probe
    max_probe_requests: int = 64
    evidence: int = 20  # a kind's observations before its mean decides (before: it learns)
    demote_after: int = 8  # drafting steps of a request before its own mean may stop feeding


PROBE_SHARE = 0.01  # of a plain batch's time, what its probes may take at most
PROBE_CAP_RANGE = (64, 1024)


def probe_cap(break_even: BreakEven) -> int:
    """Plain steps between probes at most: a probe at low acceptance costs its cycle's excess
    over the one token it commits, ``break_even - 1`` plain steps (the dearest sampled size
    timed), and the catch-up before it (``resume``); once every this many plain steps it takes
    ``PROBE_SHARE`` of the time, within ``PROBE_CAP_RANGE``."""
    dearest = max((v for v in break_even.sampled if v < math.inf), default=1.0)
    cost = dearest - 1.0 + break_even.resume
    low, high = PROBE_CAP_RANGE
    return min(max(round(cost / PROBE_SHARE), low), high)


class AdaptiveDrafting:
    """The policy of the module docstring, for an engine whose drafting steps verify
    ``width`` tokens a row (its chain or ``tree`` cut short too where the break-even is
    measured cut)."""

    def __init__(self, settings: AdaptiveSettings, width: int, tree: bool = False) -> None:
        self.settings = settings
        self.depth = width - 1  # the engine's drafts a row (a tree's nodes)
        self.tree = tree
        # The widths a drafting step may take, deepest first: a tie keeps the deeper chain.
        self.widths = (width, *(drafts + 1 for drafts in settings.break_even.cut_drafts))
        assert list(self.widths) == sorted(self.widths, reverse=True), self.widths
        self.kind_tau: dict[int, KindMean] = {}  # kinds observed so far
        self.positions: dict[int, Positions] = {}  # the same kinds, by draft position
        self.sizes: dict[int, Sizes] = {}  # a tree's: the same kinds, by the tree's size
        # ``share`` by kind and depth, as of the last decision (``width``): an observation
        # moves it little, and one step's observations would recompute it once a row.
        self._shares: dict[tuple[int, int], float] = {}
        self.probe_every = settings.probe_every
        self.max_probe_every = settings.max_probe_every or probe_cap(settings.break_even)
        self.plain_run = 0  # plain steps in a row
        self.drafting_run = True  # the last decision drafted by the estimates (a probe: not)
        # Per kind: unfed admissions since its last fed one, and how many make a probe.
        self.unfed_run: dict[int, int] = {}
        self.probe_requests: dict[int, int] = {}
        self.kind_feeds: dict[int, bool] = {}  # the last feeding choice of each kind

    def settled(self, req: Request) -> KindMean | None:
        """``req``'s kind's mean once it holds ``evidence`` observations; None before."""
        return self._learned(self.kind_tau.get(kind_of(req)))

    def _learned(self, mean: KindMean | None) -> KindMean | None:
        """``mean`` where it holds ``evidence`` observations, else None."""
        return mean if mean is not None and mean.count >= self.settings.evidence else None

    def estimate(self, req: Request) -> float | None:
        """``req``'s estimated acceptance length at the engine's depth; None while its kind
        is learning (fewer than ``evidence`` observations), and for a probe that has not
        drafted yet."""
        if req.fed is False:
            return 1.0  # its drafts have no context
        if req.tau_estimate > 0.0:  # kept from its kind's settling on (``observe``)
            return req.tau_estimate
        kind = self.settled(req)
        return kind.value if kind is not None and not req.probe else None

    def share(self, req: Request, drafts: int) -> float:
        """The part of ``req``'s accepted drafts at the engine's depth that a chain of
        ``drafts`` keeps (its cap's at most), by its kind's acceptance by position."""
        if req.max_drafts is not None and not self.tree:
            drafts = min(drafts, req.max_drafts)
        if drafts >= self.depth:
            return 1.0
        key = (kind_of(req), drafts)
        share = self._shares.get(key)
        if share is None:  # once per kind and depth a decision
            profile = (self.sizes if self.tree else self.positions).get(key[0])
            whole = 0.0 if profile is None else profile.reach(self.depth)
            if profile is None or whole <= 0.0:
                share = drafts / self.depth
            else:
                share = profile.reach(drafts) / whole
            self._shares[key] = share
        return share

    def commits(self, req: Request, estimate: float, drafts: int) -> float:
        """``req``'s expected commit length in a chain of ``drafts``, from its ``estimate``
        at the engine's depth."""
        return 1.0 + (estimate - 1.0) * self.share(req, drafts)

    def feeding_pays_from(self, req: Request, batch: int) -> float:
        """The acceptance length (at the engine's depth) from which drafting for ``req`` in a
        batch of ``batch`` pays for feeding the draft, at the width where it pays first: the
        break-even against the target's own plain step, resumed."""
        break_even = self.settings.break_even
        margin = break_even.resume / self.settings.resume_horizon
        greedy, lowest = req.sampling.temperature == 0.0, float("inf")
        for width in self.widths:
            needed = break_even.at(batch, greedy, width - 1) * break_even.unfed + margin
            share = self.share(req, width - 1)
            if share > 0.0:
                lowest = min(lowest, 1.0 + (needed - 1.0) / share)
        return lowest

    def feeds(self, req: Request, others: int) -> bool:
        settings, kind = self.settings, kind_of(req)
        mean = self.settled(req)
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
        """Whether the batch of ``rows`` drafts (``width`` above 1)."""
        return self.width(rows) > 1

    def width(self, rows: list[Request]) -> int:
        self._shares.clear()
        if all(req.fed is False for req in rows):
            return 1
        all_greedy = all(req.sampling.temperature == 0.0 for req in rows)
        break_even = self.settings.break_even
        margin = 0.0 if self.drafting_run else break_even.resume / self.settings.resume_horizon
        estimates = [self.estimate(req) for req in rows]
        chosen, gain = self.widths[0], 0.0
        for width in self.widths:
            threshold = break_even.at(len(rows), all_greedy, width - 1) + margin
            mean = sum(
                threshold if e is None else self.commits(req, e, width - 1)
                for req, e in zip(rows, estimates, strict=True)
            ) / len(rows)
            if mean / threshold > gain:
                chosen, gain = width, mean / threshold
        self.drafting_run = gain >= 1.0
        if self.drafting_run:
            self.plain_run = 0
            self.probe_every = self.settings.probe_every
            return chosen
        for req in rows:
            self._demote(req, len(rows))
        if all(req.fed is False for req in rows):
            return 1
        probe = next((w for w in self.widths if break_even.fits(len(rows), w - 1)), 1)
        if self.plain_run >= self.probe_every and probe > 1:  # the widest step the batch takes
            self.plain_run = 0
            self.probe_every = min(2 * self.probe_every, self.max_probe_every)
            return probe
        self.plain_run += 1
        return 1

    def _demote(self, req: Request, batch: int) -> None:
        """``req``, in a plain batch of ``batch`` rows, stops feeding the draft where its
        mean, or its kind's, does not pay for feeding there (docstring)."""
        if not req.fed:
            return
        drafted, kind = req.spec_drafts, self.settled(req)
        if drafted >= self.settings.demote_after:
            mean = 1.0 + req.accepted_at_depth / drafted
        elif kind is None:
            return
        elif req.probe and drafted == 0:
            return  # fed to measure its kind again
        else:
            mean = kind.value
        req.fed = mean >= self.feeding_pays_from(req, batch)

    def observe(
        self,
        req: Request,
        commit_len: int,
        drafts: int | None = None,
        ranks: Sequence[int] = (),
        rows: int = 1,
    ) -> None:
        """As ``DraftPolicy.observe``; ``drafts`` None: the engine's depth. A step cut short
        counts at the engine's depth, scaled by its kind's acceptance by position (a chain)
        or by size (a tree, from its whole steps' ``ranks``)."""
        drafts = self.depth if drafts is None else drafts
        if drafts == 0:
            return  # nothing offered: its cap turned speculation off
        kind = kind_of(req)
        if not self.tree:
            positions = self.positions.get(kind)
            if positions is None:
                positions = self.positions[kind] = Positions.empty(self.depth)
            positions.add(commit_len - 1, drafts)
        elif drafts == self.depth and len(ranks) == commit_len - 1:
            sizes = self.sizes.get(kind)
            if sizes is None:
                counts = (self.depth, *self.settings.break_even.cut_drafts)
                sizes = self.sizes[kind] = Sizes.empty(counts)
            sizes.add(ranks)
        value, share = float(commit_len), self.share(req, drafts)
        if share > 0.0:
            value = min(1.0 + (commit_len - 1) / share, self.depth + 1.0)
        req.accepted_at_depth += value - 1.0
        mean = self.kind_tau.get(kind)
        settled = self._learned(mean)
        if settled is not None:  # while its kind learns, a request keeps no estimate
            start = req.tau_estimate if req.tau_estimate > 0.0 else settled.value
            req.tau_estimate = moved(start, value, self.settings.smoothing)
        if mean is None:
            mean = self.kind_tau[kind] = KindMean()
        mean.add(value, self.settings.engine_smoothing / rows)
