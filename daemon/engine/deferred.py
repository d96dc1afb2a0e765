"""The host's side of deferred catch-up (plugins/speculative/deferred.py): how many positions
each slot's plain steps have buffered, and which slots catch up before a plan runs.

A slot catches up, in one eager batch queued before the plan's own work:
- when the plan drafts for it (its draft must be current before drafting);
- when the plan is a plain step and some row's buffer is full: then every row of the plan with
  buffered positions (their buffers fill again together);
- when its request has ended (``plan.released_slots``): its pages may be in the prefix cache,
  and a later hit reads the draft's KV there. The slot's relay and request-table row still hold
  the ended request's: the catch-up runs before the plan writes anything.

An EXTEND starts a slot afresh: positions it still holds are dropped, on the host and on the
device (the runner clears the slot's buffer), not caught up. Only slots whose end no plan
reported hold any: the warm-up's and the start-up timing's, whose scheduler (and prefix cache)
the engine replaces before READY; their pages may belong to other requests by then.

Every count is exact on the host: a plain step buffers one position a row, an EXTEND starts a
slot afresh, a catch-up empties it. A tensor-parallel rank makes the same decisions from the
same plans.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from outrider.daemon.engine.plan import StepPlan
from outrider.plugins.speculative.deferred import DeferredRows


@dataclass(frozen=True)
class CatchUp:
    """Slots to catch up before a plan, their buffered counts and a bound on their KV."""

    slots: list[int]
    counts: list[int]
    max_kv: int


class DeferredCatchUp:
    """The buffered positions of every slot, the catch-ups they call for, and the staging of a
    catch-up batch's index arrays."""

    def __init__(self, capacity: int, rows: int, device: torch.device) -> None:
        assert capacity > 0, "deferral needs room for a position"
        self.capacity = capacity
        self.pending = [0] * rows  # buffered positions per slot
        # Per slot, a bound on its KV length after its last plain step: the plan's start (an
        # upper bound on the committed length under speculation) plus the step's token.
        self.kv_bound = [0] * rows
        pin, host = device.type == "cuda", torch.device("cpu")
        self._staging = [_Staging(rows, capacity, host, pin=pin) for _ in (0, 1)]
        self._device = _Staging(rows, capacity, device, pin=False)
        self._parity = 0

    def due(self, plan: StepPlan) -> CatchUp | None:
        """What must catch up before ``plan`` runs (module docstring), or None."""
        slots = [s for s in plan.released_slots if self.pending[s]]
        if plan.kind == "decode":
            buffered = [s for s in plan.slots if self.pending[s]]
            if plan.drafting or any(self.pending[s] >= self.capacity for s in buffered):
                slots += buffered
        if not slots:
            return None
        counts = [self.pending[s] for s in slots]
        return CatchUp(slots, counts, max(self.kv_bound[s] for s in slots))

    def advance(self, plan: StepPlan, catch_up: CatchUp | None) -> None:
        """The counts after ``plan`` (and ``catch_up`` before it) were launched."""
        for slot in catch_up.slots if catch_up is not None else ():
            self.pending[slot] = 0
        if plan.kind == "extend":
            for slot in plan.slots:
                self.pending[slot] = 0
        elif not plan.drafting:
            for slot, start in zip(plan.slots, plan.starts, strict=True):
                self.pending[slot] += 1
                self.kv_bound[slot] = start + 1
                assert self.pending[slot] <= self.capacity, "a full buffer catches up first"

    def stage(self, catch_up: CatchUp, starts: torch.Tensor) -> DeferredRows:
        """``catch_up``'s rows on the device (copies queued on the current stream); ``starts``:
        the relay's start of every slot. Staging is double-buffered as the step inputs are
        (inputs.py): a set is refilled two launches later, after the loop waited for the
        first."""
        counts = np.asarray(catch_up.counts, dtype=np.int64)
        n, total = len(catch_up.slots), int(counts.sum())
        q_start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=q_start[1:])
        token_rows = np.repeat(np.arange(n, dtype=np.int64), counts)
        values = {
            "slots": np.asarray(catch_up.slots, dtype=np.int64),
            "counts": counts,
            "q_start": q_start,
            "token_rows": token_rows,
            "token_index": np.arange(total, dtype=np.int64) - q_start[token_rows],
        }
        host, self._parity = self._staging[self._parity], self._parity ^ 1
        views = {}
        for name, value in values.items():
            staged, device = getattr(host, name)[: len(value)], getattr(self._device, name)
            staged.numpy()[:] = value
            views[name] = device[: len(value)]
            views[name].copy_(staged, non_blocking=True)
        slots = views["slots"]
        return DeferredRows(
            slots=slots,
            counts=views["counts"],
            starts=starts[slots],
            q_start=views["q_start"],
            token_rows=views["token_rows"],
            token_index=views["token_index"],
            max_q=int(counts.max()),
            max_kv=catch_up.max_kv,
        )


class _Staging:
    """The catch-up batch's index arrays, sized for every slot's full buffer."""

    def __init__(self, rows: int, capacity: int, device: torch.device, *, pin: bool) -> None:
        def make(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device, pin_memory=pin)

        self.slots, self.counts, self.q_start = make(rows), make(rows), make(rows + 1)
        self.token_rows, self.token_index = make(rows * capacity), make(rows * capacity)
