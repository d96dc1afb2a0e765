"""Device time of a decode batch's phases, for benchmarks (``outrider bench latency``).

The runner and its graph replays mark the start of each phase; a phase lasts until the next
mark. Marks are recorded only once a benchmark turns the timer on, and never while a graph is
captured (``paused``). On CUDA the marks are events on the compute stream, read only when the
totals are asked for (one host sync then); on CPU every operation has finished when it returns,
so the host clock is the device's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch

TimedPhase = Literal["draft", "verify", "catch_up", "graph", "end"]


@dataclass(frozen=True)
class PhaseTimes:
    """Device milliseconds per phase, summed over ``steps`` decode batches."""

    steps: int
    draft_ms: float
    verify_ms: float  # the target's forward over (root, drafts), the accept, the relay
    catch_up_ms: float
    graph_ms: float  # steps replayed from a CUDA graph, not split into phases


class PhaseTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.on = False  # benchmarks turn it on (``ModelRunner.enable_phase_timing``)
        self._marks: list[tuple[TimedPhase, torch.cuda.Event | float]] = []

    def mark(self, phase: TimedPhase) -> None:
        """``phase`` starts now (``end``: the previous one ends); nothing while off."""
        if not self.on:
            return
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((phase, event))
        else:
            self._marks.append((phase, time.perf_counter()))

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No marks inside: a graph's warm-up and capture (an event would be recorded into it)."""
        on, self.on = self.on, False
        try:
            yield
        finally:
            self.on = on

    def take(self) -> PhaseTimes:
        """The phases' times since the last ``take``."""
        if self.cuda:
            torch.cuda.synchronize()
        totals = {"draft": 0.0, "verify": 0.0, "catch_up": 0.0, "graph": 0.0}
        for (phase, start), (_, stop) in zip(self._marks, self._marks[1:], strict=False):
            if phase == "end":
                continue
            if isinstance(start, float) and isinstance(stop, float):
                totals[phase] += (stop - start) * 1e3
            elif isinstance(start, torch.cuda.Event) and isinstance(stop, torch.cuda.Event):
                totals[phase] += start.elapsed_time(stop)
        steps = sum(1 for phase, _ in self._marks if phase == "end")
        self._marks.clear()
        return PhaseTimes(steps, **{f"{phase}_ms": ms for phase, ms in totals.items()})
