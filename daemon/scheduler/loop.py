"""The overlap loop and its serial twin (ARCHITECTURE.md 4.3).

```
overlap:  plan_n = schedule(); launch(plan_n, settle); process(plan_{n-1}) unless settled
serial:   plan_n = schedule(); launch(plan_n); process(plan_n)
```
Both share every function; only the order differs, so both give identical tokens. ``settle``
processes plan_{n-1} from inside the launch, where the runner first needs the host's grammar
masks (late masks: a decode batch may hold grammar rows whose step n - 1 is still in
flight, planner.py): plan_n's first device work is queued by then, so the host's processing
and mask work run while the device computes it.
"""

from __future__ import annotations

import logging
import time

import torch

from outrider.daemon.engine.runner import Launched, ModelRunner
from outrider.daemon.internal import RequestUpdate
from outrider.daemon.scheduler.planner import Planned
from outrider.daemon.scheduler.scheduler import Scheduler
from outrider.daemon.scheduler.step_log import StepLog

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
        self.step_log: StepLog | None = None  # --step-log
        self._waited = 0.0  # this turn's seconds waiting for step results

    @property
    def has_work(self) -> bool:
        return self.in_flight is not None or self.scheduler.has_work

    def iterate(self) -> list[RequestUpdate]:
        """One turn of the loop; returns the updates to send to the detokenizer."""
        started = time.perf_counter()
        self._waited = 0.0
        planned = self.scheduler.schedule()
        scheduled = time.perf_counter()
        settle = _Settle(self, self.in_flight)
        times = self.runner.token_masks.times
        times.take()  # not this launch's: start-up's graph captures
        launched = self._launch(planned, settle) if planned is not None else None
        masks = times.take()  # the launch's own
        settle()
        self.in_flight = launched
        if not self.overlap and launched is not None:
            self.in_flight = None
            self._process(*launched)
        self.oldest_step_started = time.monotonic() if self.in_flight is not None else 0.0
        if self.check_kv:
            self.scheduler.check_integrity()
        if self.step_log is not None:
            ended, waiting = time.perf_counter(), len(self.scheduler.waiting)
            self.step_log.turn(started, scheduled, ended, self._waited, planned, waiting, masks)
        return self.scheduler.take_updates()

    def close(self) -> None:
        """Close what the loop holds open (the step log)."""
        if self.step_log is not None:
            self.step_log.close()

    def idle_check(self) -> None:
        """Run when nothing is in flight: leaks are bugs, not noise."""
        assert self.in_flight is None
        self.scheduler.check_integrity()

    def _launch(self, planned: Planned, settle: _Settle) -> tuple[Planned, Launched] | None:
        try:
            return planned, self.runner.launch(planned.plan, planned.grammar, settle)
        except Exception as exc:
            if settle.raised:  # the step before's processing: not this step's failure
                raise
            self._step_failed(planned, exc)
            return None

    def _process(self, planned: Planned, launched: Launched) -> None:
        waiting_since = time.perf_counter()
        try:
            out = self.runner.collect(launched)
        except Exception as exc:
            self._step_failed(planned, exc)
            return
        finally:
            self._waited += time.perf_counter() - waiting_since
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
        self.scheduler.landed(planned)
        self.scheduler.fail_all(planned.requests, f"step failed: {type(exc).__name__}: {exc}")


class _Settle:
    """The processing of the step in flight before a launch, once: where the launch first
    needs its results (the runner calls it), or after the launch."""

    def __init__(self, loop: EngineLoop, previous: tuple[Planned, Launched] | None) -> None:
        self.loop = loop
        self.previous = previous
        self.raised = False

    def __call__(self) -> None:
        previous, self.previous = self.previous, None
        if previous is not None:
            try:
                self.loop._process(*previous)
            except BaseException:
                self.raised = True
                raise


def _is_fatal_cuda_error(exc: Exception) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return False
    if isinstance(exc, torch.AcceleratorError):
        return True
    return isinstance(exc, RuntimeError) and "CUDA error" in str(exc)
