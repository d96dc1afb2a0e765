"""The host's side of deferred catch-up (plugins/speculative/deferred.py): how many positions
each slot's plain steps have buffered, which slots catch up before a plan runs, and the staging
of a catch-up batch's index arrays. catch_up.py runs the batches.

A slot catches up, in one batch queued before the plan's own work:
- when the plan drafts for it (its draft must be current before drafting);
- when the plan is a plain step and some row's buffer is full: then every row of the plan with
  buffered positions (their buffers fill again together);
- when its decoding row rides an EXTEND batch (``plan.relay_rows``): the draft takes the
  rider's token as a prompt chunk of one, which starts the slot afresh;
- when its request has ended (``plan.released_slots``): its pages may be in the prefix cache,
  and a later hit reads the draft's KV there. The slot's relay and request-table row still hold
  the ended request's: the catch-up runs before the plan writes anything.

Invariants:
- Every count is exact on the host: a plain step buffers one position a row, an EXTEND starts a
  slot afresh (with its chunk's positions, or none), a catch-up empties it. Tensor-parallel
  ranks make the same decisions from the same plans.
- An EXTEND drops what its slots still hold, on the host and on the device (the runner clears
  the slot's buffer). Its riders caught up first, only slots whose end no plan reported hold
  any then: the warm-up's and the start-up timing's, whose scheduler (and prefix cache) the
  engine replaces before READY. An EXTEND batch whose rows all end their prompts (or ride)
  within ``capacity`` tokens buffers its positions instead of running the draft over them
  (``buffers``).
- A slot whose request does not feed the draft (``StepPlan.unfed``) buffers nothing the host
  counts and never catches up (the device's entries stay until its next EXTEND clears them,
  unread).
- A batch replayed from a captured catch-up graph has its rows padded to a length bucket, the
  padding before the buffered positions, so every row's committed length must be at least the
  padded length: the host keeps a floor under it (``kv_floor``). Rows too short for that
  replay in two pieces (``split``), each causally after what came before it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from outrider.daemon.engine.plan import StepPlan
from outrider.plugins.device import HostLengths
from outrider.plugins.speculative.deferred import DeferredRows

# Host sets the catch-up's index arrays are staged in: two batches a launch (a split
# catch-up) over two launches in flight.
STAGING_SETS = 4


@dataclass(frozen=True)
class CatchUp:
    """Slots to catch up before a plan, their buffered counts, a bound on their KV and a floor
    under their committed lengths (every decode step commits a token a row at least).

    A piece of a split catch-up (``DeferredCatchUp.split``) takes part of each row's
    buffer: the ``counts[r]`` entries from ``first[r]`` on, ending ``behind[r]`` positions
    before the row's start; ``min_start`` is then a floor under the piece's own end. Empty
    ``first`` and ``behind``: the whole buffer of every row."""

    slots: list[int]
    counts: list[int]
    max_kv: int
    min_start: int
    first: tuple[int, ...] = ()
    behind: tuple[int, ...] = ()


@dataclass(frozen=True)
class Padding:
    """A catch-up batch in a captured graph's shape: ``rows`` rows of ``row_len`` tokens."""

    rows: int
    row_len: int


@dataclass(frozen=True)
class StagedShape:
    """The sizes of the catch-up batch staged last (what ``DeferredCatchUp.rows`` reads)."""

    rows: int
    tokens: int
    max_q: int
    max_kv: int
    # Each row's tokens and the KV length it ends at (``DeferredRows.starts``) on the host,
    # where the slots' exact starts were given (for a backend that plans on the host).
    host: HostLengths | None = None


class DeferredCatchUp:
    """The buffered positions of every slot, the catch-ups they call for, and the staging of a
    catch-up batch's index arrays."""

    def __init__(self, capacity: int, rows: int, device: torch.device) -> None:
        """``rows``: the request table's, the scratch slot last."""
        assert capacity > 0, "deferral needs room for a position"
        self.capacity = capacity
        self.scratch_slot = rows - 1
        self.pending = [0] * rows  # buffered positions per slot
        # Per slot, a bound on its KV length after its last plain step: the plan's start (an
        # upper bound on the committed length under speculation) plus the step's token.
        self.kv_bound = [0] * rows
        # Per slot, a floor under its committed length: its prompt's, plus a token a step.
        self.kv_floor = [0] * rows
        pin, host = device.type == "cuda", torch.device("cpu")
        self._staging = [_Staging(rows, capacity, host, pin=pin) for _ in range(STAGING_SETS)]
        self._device = _Staging(rows, capacity, device, pin=False)
        self._next = 0  # the staging set the next batch fills

    def due(self, plan: StepPlan) -> CatchUp | None:
        """What must catch up before ``plan`` runs (module docstring), or None."""
        slots = [s for s in plan.released_slots if self.pending[s]]
        unfed = set(plan.unfed)
        if plan.kind == "decode":
            buffered = [s for s in plan.slots if self.pending[s] and s not in unfed]
            if plan.drafting or any(self.pending[s] >= self.capacity for s in buffered):
                slots += buffered
        else:
            riders = (plan.slots[row] for row in plan.relay_rows)
            slots += [s for s in riders if self.pending[s] and s not in unfed]
        if not slots:
            return None
        counts = [self.pending[s] for s in slots]
        return CatchUp(
            slots,
            counts,
            max(self.kv_bound[s] for s in slots),
            min(self.kv_floor[s] for s in slots),
        )

    def split(self, catch_up: CatchUp, lengths: list[int]) -> tuple[CatchUp, CatchUp] | None:
        """``catch_up`` in two pieces for captured graphs whose rows are padded to ``lengths``
        (ascending), or None where that does not help. A row whose count pads to more than
        the floor under its start (a whole request buffered: its prompt and every plain step)
        gives its oldest entries, as many as the longest length under its count, to a first
        piece, which ends the rest of its count before the start and so has that much more
        room for padding; the second piece takes every row's remaining entries (module
        docstring). Each piece still needs a key of its own (``DecodeGraphs.catch_up_key``)."""
        assert not catch_up.first and not catch_up.behind, "a whole catch-up splits"
        heads = []  # per row: the entries its first piece takes (0: none)
        for slot, count in zip(catch_up.slots, catch_up.counts, strict=True):
            padded = next((n for n in lengths if n >= count), 0)
            head = 0
            if not padded or padded > self.kv_floor[slot]:
                head = max((n for n in lengths if n < count), default=0)
                if not head:
                    return None
            heads.append(head)
        if not any(heads):
            return None
        split = [i for i, head in enumerate(heads) if head]
        behind = tuple(catch_up.counts[i] - heads[i] for i in split)
        floors = [self.kv_floor[catch_up.slots[i]] - catch_up.counts[i] + heads[i] for i in split]
        first_piece = CatchUp(
            slots=[catch_up.slots[i] for i in split],
            counts=[heads[i] for i in split],
            max_kv=catch_up.max_kv,
            min_start=min(floors),
            first=(0,) * len(split),
            behind=behind,
        )
        second_piece = CatchUp(
            slots=catch_up.slots,
            counts=[count - head for count, head in zip(catch_up.counts, heads, strict=True)],
            max_kv=catch_up.max_kv,
            min_start=catch_up.min_start,
            first=tuple(heads),
            behind=(0,) * len(heads),
        )
        return first_piece, second_piece

    def buffers(self, plan: StepPlan) -> bool:
        """Whether EXTEND ``plan`` buffers its positions: every row ends its prompt in it (a
        later chunk would start the slot afresh) and fits the buffer."""
        return (
            plan.kind == "extend"
            and len(plan.sample_rows) == plan.bs
            and max(plan.q_lens) <= self.capacity
        )

    def advance(self, plan: StepPlan, catch_up: CatchUp | None) -> None:
        """The counts after ``plan`` (and ``catch_up`` before it) were launched."""
        for slot in (*(catch_up.slots if catch_up is not None else ()), *plan.unfed):
            self.pending[slot] = 0
        unfed = set(plan.unfed)
        if plan.kind == "extend":
            buffered = self.buffers(plan)
            for slot, start, q_len in zip(plan.slots, plan.starts, plan.q_lens, strict=True):
                self.pending[slot] = q_len if buffered and slot not in unfed else 0
                self.kv_bound[slot] = self.kv_floor[slot] = start + q_len
            return
        for slot in plan.slots:
            self.kv_floor[slot] += 1
        if not plan.drafting:
            for slot, start in zip(plan.slots, plan.starts, strict=True):
                if slot in unfed:
                    continue
                self.pending[slot] += 1
                self.kv_bound[slot] = start + 1
                assert self.pending[slot] <= self.capacity, "a full buffer catches up first"

    def stage(
        self,
        catch_up: CatchUp,
        padding: Padding | None = None,
        starts: list[int] | None = None,
    ) -> StagedShape:
        """Queue the copies of ``catch_up``'s index arrays to the device (on the current
        stream), laid out exactly or, with ``padding``, in a captured graph's shape
        (``DeferredRows``; the caller checked that every row fits and starts at
        ``row_len`` or later). ``starts``: the slots' exact starts, where the host has them
        (``StagedShape.host``). Staging rotates over ``STAGING_SETS`` host sets: a launch
        stages two batches at most (a split catch-up), so a set is refilled two launches later
        at the earliest, after the loop waited for the first (as the step inputs, inputs.py)."""
        real = np.asarray(catch_up.counts, dtype=np.int64)
        first = np.asarray(catch_up.first or [0] * len(real), dtype=np.int64)
        behind = np.asarray(catch_up.behind or [0] * len(real), dtype=np.int64)
        # Where each row's positions end (``DeferredRows.starts``), on the host.
        ends = None if starts is None else [s - int(b) for s, b in zip(starts, behind, strict=True)]
        if padding is None:
            values = _exact(catch_up.slots, real, first)
            q_lens = tuple(catch_up.counts)
            shape = StagedShape(len(real), int(real.sum()), int(real.max()), catch_up.max_kv)
        else:
            n, length = padding.rows, padding.row_len
            extra = np.zeros(n - len(real), np.int64)  # the scratch slot's rows
            assert int(real.max(initial=0)) <= length <= catch_up.min_start and n >= len(real)
            slots = catch_up.slots + [self.scratch_slot] * len(extra)
            values = _padded(
                slots, np.concatenate([real, extra]), np.concatenate([first, extra]), length
            )
            behind = np.concatenate([behind, extra])
            q_lens = (length,) * n
            if ends is not None:  # a padding row ends at its length
                ends += [length] * len(extra)
            shape = StagedShape(n, n * length, length, catch_up.max_kv)
        if ends is not None:
            shape = dataclasses.replace(shape, host=HostLengths(q_lens, tuple(ends)))
        values["behind"] = behind
        host = self._staging[self._next]
        self._next = (self._next + 1) % len(self._staging)
        for name, value in values.items():
            staged = getattr(host, name)[: len(value)]
            staged.numpy()[:] = value
            getattr(self._device, name)[: len(value)].copy_(staged, non_blocking=True)
        return shape

    def rows(self, shape: StagedShape, starts: torch.Tensor) -> DeferredRows:
        """The staged batch of ``shape`` on the device; ``starts``: the relay's start of every
        slot. Device work only (a graph captures it with the worker's catch-up)."""
        n, tokens, device = shape.rows, shape.tokens, self._device
        slots, counts = device.slots[:n], device.counts[:n]
        return DeferredRows(
            slots=slots,
            counts=counts,
            # A padding row (count 0, the scratch slot) starts where its row's length ends.
            starts=torch.where(counts > 0, starts[slots] - device.behind[:n], shape.max_q),
            q_start=device.q_start[: n + 1],
            token_rows=device.token_rows[:tokens],
            token_index=device.token_index[:tokens],
            back=device.back[:tokens],
            real=device.real[:tokens],
            q_pad_index=device.q_pad_index[:tokens],
            max_q=shape.max_q,
            max_kv=shape.max_kv,
            host=shape.host,
        )


def _exact(slots: list[int], counts: np.ndarray, first: np.ndarray) -> dict[str, np.ndarray]:
    """Index arrays of rows of their own lengths: every token a buffered position, row ``r``'s
    from buffer entry ``first[r]`` on."""
    n, total = len(counts), int(counts.sum())
    q_start = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=q_start[1:])
    token_rows = np.repeat(np.arange(n, dtype=np.int64), counts)
    index = np.arange(total, dtype=np.int64) - q_start[token_rows]
    return {
        "slots": np.asarray(slots, dtype=np.int64),
        "counts": counts,
        "q_start": q_start,
        "token_rows": token_rows,
        "token_index": index + first[token_rows],
        "back": counts[token_rows] - index,
        "real": np.ones(total, dtype=np.bool_),
        "q_pad_index": token_rows * int(counts.max()) + index,
    }


def _padded(
    slots: list[int], counts: np.ndarray, first: np.ndarray, length: int
) -> dict[str, np.ndarray]:
    """Index arrays of rows of ``length`` tokens each, the buffered positions last (row
    ``r``'s from buffer entry ``first[r]`` on; its padding reads that entry)."""
    n = len(counts)
    token_rows = np.repeat(np.arange(n, dtype=np.int64), length)
    place = np.tile(np.arange(length, dtype=np.int64), n)  # within the row
    index = place - (length - counts[token_rows])  # the buffer entry; < 0: padding
    return {
        "slots": np.asarray(slots, dtype=np.int64),
        "counts": counts,
        "q_start": np.arange(n + 1, dtype=np.int64) * length,
        "token_rows": token_rows,
        "token_index": np.maximum(index, 0) + first[token_rows],
        "back": length - place,
        "real": index >= 0,
        "q_pad_index": np.arange(n * length, dtype=np.int64),
    }


class _Staging:
    """The catch-up batch's index arrays, sized for every slot's full buffer."""

    def __init__(self, rows: int, capacity: int, device: torch.device, *, pin: bool) -> None:
        def make(n: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=device, pin_memory=pin)

        tokens = rows * capacity
        self.slots, self.counts, self.q_start = make(rows), make(rows), make(rows + 1)
        self.behind = make(rows)
        self.token_rows, self.token_index = make(tokens), make(tokens)
        self.back, self.q_pad_index = make(tokens), make(tokens)
        self.real = make(tokens, torch.bool)
