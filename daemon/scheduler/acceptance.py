"""What the drafting policy (drafting.py) measures and estimates from: the kind of a request
(greedy, or a temperature band), the acceptance length at which a cycle pays by batch size
and step size (``BreakEven``, timed at start by engine/cycle_cost.py), and each kind's
acceptance: its mean commit length (``KindMean``), by a chain's draft position
(``Positions``) and by a tree's size (``Sizes``).

Invariant: a ``KindMean`` holds commit lengths at the engine's own step shape (the policy
scales a step cut short to it before adding it); ``Positions`` and ``Sizes`` hold the raw
counts that scaling comes from.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from outrider.daemon.scheduler.request import Request

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
    ``sampled[i]`` measured at ``sizes[i]`` (ascending); a batch between two sizes takes the
    value on the line between theirs (``between``), ``sampled`` when any row samples. Where
    the engine cuts its steps short, ``cut_greedy[j]`` and ``cut_sampled[j]`` are the same for
    a step of ``cut_drafts[j]`` drafts (``StepShape.cuts``, below the engine's own).
    ``max_rows``: the most rows a step of the engine's drafts, then of each of ``cut_drafts``,
    takes (``SchedulerLimits.drafting_rows``; empty: every batch); a larger batch never pays
    there, and a size past it is not timed (its value infinite)."""

    sizes: tuple[int, ...]
    greedy: tuple[float, ...]
    sampled: tuple[float, ...]
    resume: float = 0.0  # what resuming after plain steps costs beyond a cycle, in plain steps
    unfed: float = 1.0  # a plain step's time over the target's own (no row feeding the draft)
    cut_drafts: tuple[int, ...] = ()
    cut_greedy: tuple[tuple[float, ...], ...] = ()
    cut_sampled: tuple[tuple[float, ...], ...] = ()
    max_rows: tuple[int, ...] = ()

    @classmethod
    def fixed(cls, tau: float) -> BreakEven:
        return cls((1,), (tau,), (tau,))

    def at(self, bs: int, all_greedy: bool, drafts: int | None = None) -> float:
        """At a batch of ``bs``, for a step cut to ``drafts`` where it is measured cut
        (``cut_drafts``), else (None, or the engine's own) for the engine's shape; infinite
        past the step's ``max_rows``."""
        if not self.fits(bs, drafts):
            return math.inf
        if drafts in self.cut_drafts:
            j = self.cut_drafts.index(drafts)
            values = (self.cut_greedy if all_greedy else self.cut_sampled)[j]
        else:
            values = self.greedy if all_greedy else self.sampled
        return between(self.sizes, values, bs)

    def fits(self, bs: int, drafts: int | None = None) -> bool:
        """Whether a step of ``drafts`` (as ``at``) takes a batch of ``bs`` rows."""
        if not self.max_rows:
            return True
        j = self.cut_drafts.index(drafts) + 1 if drafts in self.cut_drafts else 0
        return bs <= self.max_rows[j]


@dataclass
class KindMean:
    """The mean commit length of one kind's drafting steps: the plain mean of the first
    ``1 / weight`` observations, then a moving average with ``weight``."""

    value: float = 0.0
    count: int = 0

    def add(self, commit_len: float, weight: float) -> None:
        self.count += 1
        self.value = moved(self.value, commit_len, max(weight, 1.0 / self.count))


@dataclass
class Positions:
    """One kind's drafts by position over its drafting steps: ``tried[j]`` counts the steps
    that verified draft ``j + 1`` with every draft before it accepted, ``kept[j]`` those that
    accepted it too; their ratio is the position's acceptance rate."""

    tried: list[int]
    kept: list[int]

    @classmethod
    def empty(cls, depth: int) -> Positions:
        return cls([0] * depth, [0] * depth)

    def add(self, accepted: int, drafts: int) -> None:
        """A step offered ``drafts`` drafts and accepted the first ``accepted``."""
        for j in range(min(accepted + 1, drafts)):
            self.tried[j] += 1
            self.kept[j] += j < accepted

    def reach(self, drafts: int) -> float:
        """The drafts a chain of ``drafts`` accepts on average: the sum over its positions
        of the product of the rates up to each (a position never tried: the rate before it,
        the first's 1)."""
        total, survive, rate = 0.0, 1.0, 1.0
        for tried, kept in zip(self.tried[:drafts], self.kept[:drafts], strict=True):
            if tried:
                rate = kept / tried
            survive *= rate
            total += survive
        return total


@dataclass
class Sizes:
    """One kind's whole-tree steps, each counted as the same tree cut to each of ``counts``
    best nodes would have committed: ``accepted[j]`` sums the drafts a tree of ``counts[j]``
    nodes would have accepted (those on the accepted path whose worst rank so far is below
    ``counts[j]``: the target chose the same tokens), over ``steps``."""

    counts: tuple[int, ...]
    accepted: list[int]
    steps: int = 0

    @classmethod
    def empty(cls, counts: tuple[int, ...]) -> Sizes:
        return cls(counts, [0] * len(counts))

    def add(self, ranks: Sequence[int]) -> None:
        """A whole tree's step that accepted ``len(ranks)`` drafts (``ranks``: the path's
        worst rank so far at each, never decreasing)."""
        self.steps += 1
        for j, count in enumerate(self.counts):
            self.accepted[j] += bisect.bisect_left(ranks, count)

    def reach(self, drafts: int) -> float:
        """The drafts a tree of ``drafts`` nodes (one of ``counts``) accepts on average."""
        return self.accepted[self.counts.index(drafts)] / self.steps if self.steps else 0.0


def between(sizes: tuple[int, ...], values: tuple[float, ...], bs: int) -> float:
    """``values`` measured at ``sizes`` (ascending), read at ``bs`` on the line between the
    two sizes around it. Below the first size, the first value; past the last, the line
    through the last two goes on where it rises (a cycle costs more plain steps the larger its
    batch: the last value would draft where drafting loses), else the last value. A line to an
    infinite value (a size not timed) is infinite but at its finite end."""
    i = bisect.bisect_right(sizes, bs)
    if i == 0:
        return values[0]
    if i == len(sizes):
        if len(sizes) < 2 or values[-1] == math.inf or bs == sizes[-1]:
            return values[-1]
        rise = (values[-1] - values[-2]) / (sizes[-1] - sizes[-2])
        return values[-1] + max(rise, 0.0) * (bs - sizes[-1])
    low, high = sizes[i - 1], sizes[i]
    if bs == low:
        return values[i - 1]
    return values[i - 1] + (values[i] - values[i - 1]) * (bs - low) / (high - low)


def moved(average: float, value: float, weight: float) -> float:
    return (1.0 - weight) * average + weight * value
