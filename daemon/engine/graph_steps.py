"""Decode batches through captured graphs (graphs.py): a plan padded to its key's batch, staged,
its host-scheduled backends planned, then replayed; a key's graph captured first, from scratch
rows, when it is new. The step a graph records is the runner's own eager decode step; where
it waits for the host's masks (``MaskHoles``) the capture is cut into segments (graph_capture.py).

The padding rows run on the scratch slot, whose relay is reset after every recorded step
(slots.py). Every replay waits on the device for the previous replay's result copy, whose
source it overwrites (``DecodeGraphs.last_copy``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import partial

import torch

from outrider.daemon.engine.graphs import DecodeGraphs, GraphKey
from outrider.daemon.engine.host_masks import HostMasks
from outrider.daemon.engine.inputs import InputBuffers, StepInputs, host_values
from outrider.daemon.engine.plan import StepPlan
from outrider.daemon.engine.results import Launched, ResultCopies, StepResults
from outrider.daemon.engine.slots import KnownStarts, SlotState
from outrider.daemon.engine.timing import PhaseTimer
from outrider.plugins.attention.base import AttentionBackend, GraphBounds

# The runner's eager decode step over staged inputs, with the KV bound of its layouts.
DecodeStep = Callable[[StepPlan, StepInputs[torch.Tensor], int], StepResults]


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
        decode: DecodeStep,
        masks: HostMasks,
    ) -> None:
        self.inputs = inputs
        self.slots = slots
        self.results = results
        self.planning = planning
        self.starts = starts
        self.timer = timer
        self.decode = decode
        self.masks = masks

    def launch(self, plan: StepPlan, key: GraphKey, graphs: DecodeGraphs) -> Launched:
        """``plan`` padded to ``key``'s batch and replayed from its graph (captured first from
        scratch rows when new)."""
        if key not in graphs.graphs:
            self.capture(key, graphs)
        padded = graphs.pad(plan, key)
        self.masks.padded(key.bs)
        inputs = self.inputs.stage(padded, host_values(padded, poison_released=False))
        self.slots.apply(inputs)
        self._plan(padded, key)
        self.timer.mark("graph")
        results = graphs.replay(key)
        self.timer.mark("end")
        launched = self.results.copy(plan, results)
        graphs.last_copy = launched.done
        return launched

    def capture(self, key: GraphKey, graphs: DecodeGraphs) -> None:
        """Capture ``key``'s decode graph from a batch of scratch rows (no live state)."""
        scratch = graphs.scratch_plan(key)
        staged = self.inputs.stage(scratch, host_values(scratch, poison_released=False))
        self._plan(scratch, key)
        run = partial(self._recorded, scratch, staged, key.max_kv)
        with self.timer.paused(), self.masks.scratch(key.bs):  # fills allow every token
            graphs.capture(key, run, self.masks.holes)

    def _plan(self, plan: StepPlan, key: GraphKey) -> None:
        """Let the backends that schedule on the host plan ``key``'s graph for ``plan`` (its
        exact starts, when the host has them)."""
        starts = self.starts.of_plan(plan)
        if starts is not None:
            self.planning.plan(key, starts, key.bs, key.width, key.max_kv)

    def _recorded(
        self, plan: StepPlan, inputs: StepInputs[torch.Tensor], max_kv: int
    ) -> StepResults:
        results = self.decode(plan, inputs, max_kv)
        self.slots.reset_scratch()
        return results
