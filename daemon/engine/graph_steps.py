"""Decode batches through captured graphs (graphs.py): a plan padded to its key's batch, staged,
its host-scheduled backends planned, then replayed; a key's graph captured first, from scratch
rows, when it is new. The step a graph records is the runner's own eager decode step.

A plain step with grammar rows (``GraphKey.masked``) is split in two graphs: its front (relay,
forward, logits: ``PlainFront``) replays before the host has its rows' masks, its back
(the staged masks, sampling, relay writes, the catch-up) once they are staged
(``launch_front``, then ``launch_back``).

The padding rows run on the scratch slot, whose relay is reset after every recorded step
(slots.py). Every replay waits on the device for the previous replay's result copy, whose
source it overwrites (``DecodeGraphs.last_copy``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from outrider.daemon.engine.graphs import DecodeGraphs, GraphKey
from outrider.daemon.engine.inputs import InputBuffers, StepInputs, host_values
from outrider.daemon.engine.plan import StepPlan
from outrider.daemon.engine.results import Launched, ResultCopies, StepResults
from outrider.daemon.engine.slots import KnownStarts, RelayRows, SlotState
from outrider.daemon.engine.timing import PhaseTimer
from outrider.plugins.attention.base import AttentionBackend, GraphBounds
from outrider.plugins.device import ForwardBatch
from outrider.plugins.speculative.base import DecodeView


@dataclass(frozen=True)
class PlainFront:
    """A plain decode step up to its logits: what its back (sampling, relay writes, the
    catch-up) reads. In a split graph these are the front's static outputs."""

    plan: StepPlan
    inputs: StepInputs[torch.Tensor]
    relay: RelayRows
    view: DecodeView
    fb: ForwardBatch
    logits: torch.Tensor  # [bs, V]
    max_kv: int


# The runner's eager decode step over staged inputs, with the KV bound of its layouts; a
# plain step's two parts.
DecodeStep = Callable[[StepPlan, StepInputs[torch.Tensor], int], StepResults]
FrontStep = Callable[[StepPlan, StepInputs[torch.Tensor], int], PlainFront]
BackStep = Callable[[PlainFront], StepResults]


@dataclass(frozen=True)
class StepParts:
    """The runner's decode step whole, and a plain step's front and back."""

    decode: DecodeStep
    front: FrontStep
    back: BackStep


@dataclass(frozen=True)
class GraphPlanning:
    """Every backend a graph runs (the target's and the draft's), once each: those that
    schedule on the host plan a graph before its capture and before each replay
    (``AttentionBackend.plan_replay``)."""

    backends: tuple[AttentionBackend, ...]
    page_size: int

    def plan(
        self, key: Hashable, starts: tuple[int, ...], rows: int, max_q: int, max_kv: int
    ) -> None:
        bounds = GraphBounds(rows, max_q, max_kv, self.page_size)
        for backend in self.backends:
            backend.plan_replay(key, starts, bounds)


class GraphSteps:
    """Replays and captures of the runner's decode batches."""

    def __init__(
        self,
        inputs: InputBuffers,
        slots: SlotState,
        results: ResultCopies,
        planning: GraphPlanning,
        starts: KnownStarts,
        timer: PhaseTimer,
        parts: StepParts,
    ) -> None:
        self.inputs = inputs
        self.slots = slots
        self.results = results
        self.planning = planning
        self.starts = starts
        self.timer = timer
        self.parts = parts

    def launch(self, plan: StepPlan, key: GraphKey, graphs: DecodeGraphs) -> Launched:
        """``plan`` padded to ``key``'s batch and replayed from its graph (captured first from
        scratch rows when new)."""
        self.launch_front(plan, key, graphs)
        return self.launch_back(plan, key, graphs)

    def launch_front(self, plan: StepPlan, key: GraphKey, graphs: DecodeGraphs) -> None:
        """Stage ``plan`` padded to ``key``'s batch (capturing the key first when new), and
        replay its front where the key is split."""
        if key not in graphs.graphs:
            self.capture(key, graphs)
        padded = graphs.pad(plan, key)
        inputs = self.inputs.stage(padded, host_values(padded, poison_released=False))
        self.slots.apply(inputs)
        self._plan(padded, key)
        self.timer.mark("graph")
        graphs.replay_front(key)

    def launch_back(self, plan: StepPlan, key: GraphKey, graphs: DecodeGraphs) -> Launched:
        """Replay ``key``'s graph (a split key's back) and queue the copy of its results."""
        results = graphs.replay(key)
        self.timer.mark("end")
        launched = self.results.copy(plan, results)
        graphs.last_copy = launched.done
        return launched

    def capture(self, key: GraphKey, graphs: DecodeGraphs) -> None:
        """Capture ``key``'s decode graph (a masked key's front and back) from a batch of
        scratch rows (no live state)."""
        scratch = graphs.scratch_plan(key)
        staged = self.inputs.stage(scratch, host_values(scratch, poison_released=False))
        self._plan(scratch, key)
        with self.timer.paused():
            if key.masked:
                graphs.capture_split(
                    key,
                    lambda: self.parts.front(scratch, staged, key.max_kv),
                    lambda front: self._reset(self.parts.back(front)),
                )
            else:
                graphs.capture(
                    key, lambda: self._reset(self.parts.decode(scratch, staged, key.max_kv))
                )

    def _plan(self, plan: StepPlan, key: GraphKey) -> None:
        """Let the backends that schedule on the host plan ``key``'s graph for ``plan`` (its
        exact starts, when the host has them)."""
        starts = self.starts.of_plan(plan)
        if starts is not None:
            self.planning.plan(key, starts, key.bs, key.width, key.max_kv)

    def _reset(self, results: StepResults) -> StepResults:
        """A recorded step's end: the scratch slot's relay back to its start."""
        self.slots.reset_scratch()
        return results
