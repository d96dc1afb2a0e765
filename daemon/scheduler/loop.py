"""The overlap loop and its serial twin (ARCHITECTURE.md 4.3).

```
overlap:  plan_n = schedule(); launch(plan_n); process(plan_{n-1})
serial:   plan_n = schedule(); launch(plan_n); process(plan_n)
late masks (overlap):
          plan_n = schedule(); launch_front(plan_n); process(plan_{n-1});
          launch_back(plan_n, masks from the grammar states now)
```
Both share every function; only the order differs, so both give identical tokens. A plain
decode plan with grammar rows may hold rows whose step n - 1 is still in flight
(``Planned.late_masks``, planner.py): their masks need that step's tokens, so the host
processes it while the device runs plan n's forward, then gives the masks to its sampling.
"""

from __future__ import annotations

import logging
import time

import torch

from outrider.daemon.engine.runner import FrontLaunched, Launched, ModelRunner
from outrider.daemon.internal import RequestUpdate
from outrider.daemon.scheduler.planner import Planned
from outrider.daemon.scheduler.scheduler import Scheduler

log = logging.getLogger("outrider.loop")


class StepFailed(Exception):
    """A device error after which the process cannot go on (the CUDA context is gone)."""


class EngineLoop:
    def __init__(
        self, scheduler: Scheduler, runner: ModelRunner, *, overlap: bool, check_kv: bool
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.overlap = overlap
        self.check_kv = check_kv
        self.in_flight: tuple[Planned, Launched] | None = None
        # Launch time of the oldest step not yet processed (watchdog); 0 when none.
        self.oldest_step_started = 0.0

    @property
    def has_work(self) -> bool:
        return self.in_flight is not None or self.scheduler.has_work

    def iterate(self) -> list[RequestUpdate]:
        """One turn of the loop; returns the updates to send to the detokenizer."""
        planned = self.scheduler.schedule()
        previous, self.in_flight = self.in_flight, None
        launched = None
        if planned is not None and planned.late_masks:
            front = self._launch_front(planned)
            if previous is not None:
                self._process(*previous)
                previous = None
            if front is not None:
                launched = self._launch_back(planned, front)
        elif planned is not None:
            launched = self._launch(planned)
        if previous is not None:
            self._process(*previous)
        if self.overlap:
            self.in_flight = launched
        elif launched is not None:
            self._process(*launched)
        self.oldest_step_started = time.monotonic() if self.in_flight is not None else 0.0
        if self.check_kv:
            self.scheduler.check_integrity()
        return self.scheduler.take_updates()

    def idle_check(self) -> None:
        """Run when nothing is in flight: leaks are bugs, not noise."""
        assert self.in_flight is None
        self.scheduler.check_integrity()

    def _launch(self, planned: Planned) -> tuple[Planned, Launched] | None:
        try:
            return planned, self.runner.launch(planned.plan, planned.grammar)
        except Exception as exc:
            self._step_failed(planned, exc)
            return None

    def _launch_front(self, planned: Planned) -> FrontLaunched | None:
        try:
            return self.runner.launch_front(planned.plan)
        except Exception as exc:
            self._step_failed(planned, exc)
            return None

    def _launch_back(
        self, planned: Planned, front: FrontLaunched
    ) -> tuple[Planned, Launched] | None:
        try:
            masks = self.scheduler.late_masks(planned)
            return planned, self.runner.launch_back(front, masks)
        except Exception as exc:
            self._step_failed(planned, exc)
            return None

    def _process(self, planned: Planned, launched: Launched) -> None:
        try:
            out = self.runner.collect(launched)
        except Exception as exc:
            self._step_failed(planned, exc)
            return
        self.scheduler.process(planned, out)

    def _step_failed(self, planned: Planned, exc: Exception) -> None:
        """A step that raised on the CPU or ran out of CUDA memory ends its batch with
        ``internal``; any other CUDA error is fatal, and so is any error of a step that
        tensor-parallel ranks run (the others may wait in collectives it never reached)."""
        if _is_fatal_cuda_error(exc):
            raise StepFailed(f"CUDA error, the device context is lost: {exc}") from exc
        if self.runner.channel is not None:
            raise StepFailed(f"a step of tensor-parallel ranks failed: {exc}") from exc
        log.exception("step failed; ending its %d requests", len(planned.requests))
        for req in planned.requests:
            req.steps_in_flight -= 1
        self.scheduler.fail_all(planned.requests, f"step failed: {type(exc).__name__}: {exc}")


def _is_fatal_cuda_error(exc: Exception) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return False
    if isinstance(exc, torch.AcceleratorError):
        return True
    return isinstance(exc, RuntimeError) and "CUDA error" in str(exc)
