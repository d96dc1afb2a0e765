"""Whether a decode batch drafts: speculation only where its measured acceptance pays for it.

A drafting step (a speculative cycle: draft, verify ``width`` tokens a row, catch-up) costs
``break_even`` times a plain step (one token a row, the catch-up only) and commits the rows'
acceptance length ``tau`` (1 + accepted drafts) where the plain step commits 1. So a batch
drafts when its rows' mean estimated ``tau`` reaches ``break_even`` at the batch's size:
measured at start (build.py's ``measure_break_even``) or set with
``--speculative-min-acceptance`` (0: always draft, the policy off).

Estimates, all updated from the commit counts the host sees (outputs.py):

- per request: an exponential moving average of its commit lengths over its drafting steps,
  started at its kind's engine mean;
- per kind (greedy, sampled: their acceptance differs several-fold), the engine's moving
  average over every request's drafting steps, which a new request starts from.

A batch that stays plain learns nothing, so after ``probe_every`` plain steps in a row the
batch drafts once (a probe); each probe that does not bring drafting back doubles the wait, up
to ``max_probe_every``, so that a batch whose acceptance stays low pays one cycle's excess
every ``max_probe_every`` steps at most. Under the overlap loop a decision is made before the
previous step's commits are known: estimates lag one step, which changes only when drafting
resumes or stops, never what is committed (the runner's module docstring says why). Drafts
drawn with ``"sample": "rejection"`` are the exception: every committed token is distributed
as the target's either way, but which tokens a seed gives then depends on which steps drafted.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Protocol

from outrider.daemon.scheduler.request import Request


class DraftPolicy(Protocol):
    def drafting(self, rows: list[Request]) -> bool:
        """Whether the decode batch of ``rows`` drafts."""
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

    def observe(self, req: Request, commit_len: int) -> None:
        pass


class AlternateDrafting:
    """Every other decode batch drafts, whatever was accepted: the warm-up before READY runs
    both kinds of step, and tests check that outputs do not depend on the choice."""

    def __init__(self) -> None:
        self.decisions: list[bool] = []

    def drafting(self, rows: list[Request]) -> bool:
        self.decisions.append(len(self.decisions) % 2 == 0)
        return self.decisions[-1]

    def observe(self, req: Request, commit_len: int) -> None:
        pass


@dataclass(frozen=True)
class BreakEven:
    """The acceptance length at which a cycle pays, by batch size: ``taus[i]`` measured at
    ``sizes[i]`` (ascending); a batch takes the value of the largest size it reaches (the
    smallest size's below it)."""

    sizes: tuple[int, ...]
    taus: tuple[float, ...]

    @classmethod
    def fixed(cls, tau: float) -> BreakEven:
        return cls((1,), (tau,))

    def at(self, bs: int) -> float:
        i = max(bisect.bisect_right(self.sizes, bs) - 1, 0)
        return self.taus[i]


@dataclass(frozen=True)
class AdaptiveSettings:
    break_even: BreakEven
    initial_tau: float  # the engine means before any observation (the largest commit: draft)
    smoothing: float = 0.3  # weight of a request's newest commit length in its average
    engine_smoothing: float = 0.05  # the same in its kind's engine mean
    probe_every: int = 8  # plain steps before the first probe
    max_probe_every: int = 64


class AdaptiveDrafting:
    """The policy of the module docstring."""

    def __init__(self, settings: AdaptiveSettings) -> None:
        self.settings = settings
        self.engine_tau = {False: settings.initial_tau, True: settings.initial_tau}
        self.probe_every = settings.probe_every
        self.plain_run = 0  # plain steps in a row

    def estimate(self, req: Request) -> float:
        """``req``'s estimated acceptance length."""
        if req.tau_estimate <= 0.0:  # nothing observed yet
            return self.engine_tau[_greedy(req)]
        return req.tau_estimate

    def drafting(self, rows: list[Request]) -> bool:
        mean = sum(self.estimate(req) for req in rows) / len(rows)
        if mean >= self.settings.break_even.at(len(rows)):
            self.plain_run = 0
            self.probe_every = self.settings.probe_every
            return True
        if self.plain_run >= self.probe_every:
            self.plain_run = 0
            self.probe_every = min(2 * self.probe_every, self.settings.max_probe_every)
            return True
        self.plain_run += 1
        return False

    def observe(self, req: Request, commit_len: int) -> None:
        settings, greedy = self.settings, _greedy(req)
        req.tau_estimate = _moved(self.estimate(req), commit_len, settings.smoothing)
        engine = _moved(self.engine_tau[greedy], commit_len, settings.engine_smoothing)
        self.engine_tau[greedy] = engine


def _moved(average: float, value: float, weight: float) -> float:
    return (1.0 - weight) * average + weight * value


def _greedy(req: Request) -> bool:
    return req.sampling.temperature == 0.0
