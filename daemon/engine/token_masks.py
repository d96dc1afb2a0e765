"""``TokenMasks``: grammar masks (daemon/grammar/) applied to the logits sampled rows choose
from (a copy: the logprobs stay the model's), and ``GrammarGuide``, which masks a draft's
logits the same way, one draft place at a time (``DraftGuide``,
plugins/speculative/base.py). ``HostMasks`` is the runner's side of it: the launch's turn,
its waits, the fills.

A decode step takes its masks from the host in the middle of the step, at a ``MaskHoles``
wait: a plain step's between its logits and its sampling, a drafting step's before each draft
place its worker chooses (the place's path copied to the host; past the first place only
where some row guides its paths, else the place allows every token without waiting:
``HostTurn.guides_paths``) and before its verify (its drafts copied to the host and the point
marked, ``DeviceMark``, so that the nodes' masks wait for the copy alone while the verify's
forward runs). A worker that runs a forward between two draft places hands the next place's
paths over before that forward (``GrammarGuide.prepare``): their copy is marked alike, and
the place's masks fill while the forward runs. A worker whose places' logits are all known
before the first (DFlash) hands each place's best ids over (``GrammarGuide.candidates``): the
host chooses the places whose masked argmax is among them, and waits only after a place it
could not choose; those places stage from host rows of their own (``stage_apart``), since
their fills may not wait. Eagerly the host's
fill runs at the wait; while a graph is captured the graph is cut there (graph_capture.py) and each
replay runs the recorded fill between the two segments. A fill reads the launch's
``HostTurn``: the plan's masks, or its grammar rows' states, which it first brings up to date
with the turn's ``settle`` (the loop's processing of the step before, scheduler/loop.py).

Masks are int32 words, bit ``t`` of a row set where token ``t`` may come. A decode step's are
staged into one fixed device buffer (``stage``: every mask row of the batch, padding included;
rows without a grammar allow every token) and unpacked there by device work only
(``apply_staged``: a disallowed token's logit becomes -inf), which a graph records. Paths and
drafts reach the host through fixed pinned buffers. The host staging is double-buffered as the
step inputs are (inputs.py). The masks of EXTEND rows come in the plan and are applied eagerly
(``apply``). The unpacking's temporaries (an int32 and a bool a logit of a masked row) are
freed before sampling's scratch is taken, inside the memory plan's
``SAMPLING_BYTES_PER_LOGIT``; the fixed buffers take ``rows * width`` mask rows.

The host waits inside a step only in these fills (``syncs_allowed``, sync_check.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from outrider.daemon.engine.plan import StepPlan
from outrider.daemon.engine.sync_check import syncs_allowed
from outrider.plugins.speculative.base import Drafts

_BITS = 32

# Cut the graph being captured here; the replay runs the fill between the two graphs.
Cut = Callable[[Callable[[], None]], None]


class MaskHoles:
    """The points where a step waits for the host's masks (module docstring)."""

    def __init__(self) -> None:
        self._cut: Cut | None = None

    def wait(self, fill: Callable[[], None]) -> None:
        """The host's ``fill`` (it stages masks the step reads next): run now, or, while a
        graph is captured, recorded for each replay to run here."""
        if self._cut is None:
            fill()
        else:
            self._cut(fill)

    @contextmanager
    def cutting(self, cut: Cut) -> Iterator[None]:
        """While a graph is captured: each ``wait`` calls ``cut`` instead."""
        self._cut = cut
        try:
            yield
        finally:
            self._cut = None


class GrammarRows(Protocol):
    """The grammar rows of a decode plan, in plan order (daemon/grammar/state.py). Each
    method writes into ``out``, int32 words ``[n, ceil(V / 32)]`` on the host."""

    def masks(self, out: torch.Tensor, rows: Sequence[int]) -> None:
        """Row ``rows[i]``: grammar row ``i``'s next mask from its state now."""
        ...

    def node_masks(
        self,
        out: torch.Tensor,
        firsts: Sequence[int],
        tokens: torch.Tensor,
        parents: torch.Tensor | None,
    ) -> None:
        """Given their drafts on the host (``[rows, W - 1]``) and a tree's parents (or
        None), rows ``firsts[i] ..``: grammar row ``i``'s verify nodes' masks, node after
        node."""
        ...

    def path_masks(self, out: torch.Tensor, firsts: Sequence[int], paths: torch.Tensor) -> None:
        """Given the paths to their draft places on the host (``[rows, n, d]``), rows
        ``firsts[i] ..``: the mask of each of grammar row ``i``'s places, place after place
        (``DraftGuide.restrict``)."""
        ...

    def guides_paths(self) -> bool:
        """Whether some row's draft places past the first take masks (else they allow every
        token, and their paths are not read)."""
        ...


def _nothing() -> None:
    pass


# Writes the masks of some of a step's mask rows into its host staging rows (``out``) and
# returns which; every other row allows every token.
MaskFill = Callable[[torch.Tensor], Sequence[int]]


def _no_masks(out: torch.Tensor) -> Sequence[int]:
    return ()


@dataclass(frozen=True)
class HostTurn:
    """The step being launched, as the host's fills inside it read it (padding included)."""

    plan: StepPlan
    bs: int  # rows staged, padding included
    grammar: GrammarRows | None  # its grammar rows' states (None: masks in the plan, if any)
    # Processes the step before: every fill calls it first, before it waits for the device
    # (the mask methods below read the states it brings up to date).
    settle: Callable[[], None] = _nothing

    def row_masks(self, out: torch.Tensor) -> Sequence[int]:
        """A plain step's masks (a ``MaskFill``): one a row."""
        rows = self.plan.masked_rows
        if self.grammar is not None:
            self.grammar.masks(out, rows)
        elif self.plan.masks:
            out[rows] = _words(self.plan.masks, len(rows))
        else:
            return ()
        return rows

    def guides_paths(self) -> bool:
        """Whether the masks of draft places past the first read their paths."""
        return self.grammar is not None and self.grammar.guides_paths()

    def path_masks(self, out: torch.Tensor, paths: torch.Tensor) -> Sequence[int]:
        """The masks of a drafting step's draft places (a ``MaskFill``, given every row's
        paths to them on the host: ``[bs * n, d]``, row after row)."""
        if self.grammar is None:
            return ()
        n = paths.shape[0] // self.bs
        rows = self.plan.masked_rows
        grouped = paths.view(self.bs, n, paths.shape[1])
        if len(rows) < self.bs:  # masked rows ascend: every row is all of them in order
            grouped = grouped[rows]
        self.grammar.path_masks(out, [row * n for row in rows], grouped)
        return [row * n + place for row in rows for place in range(n)]

    def node_masks(
        self, out: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor | None
    ) -> Sequence[int]:
        """The masks of a drafting step's verify nodes (a ``MaskFill``, given every row's
        drafts on the host: ``[bs, W - 1]``, a tree's parents alike)."""
        if self.grammar is None:
            return ()
        rows, width = self.plan.masked_rows, tokens.shape[1] + 1
        shape = None if parents is None else parents[rows]
        self.grammar.node_masks(out, [row * width for row in rows], tokens[rows], shape)
        return [row * width + node for row in rows for node in range(width)]


def _words(masks: bytes, n: int) -> torch.Tensor:
    """``n`` packed mask rows (``StepPlan.masks``) as int32 words ``[n, ceil(V / 32)]``."""
    return torch.frombuffer(bytearray(masks), dtype=torch.int32).view(n, -1)


def masked_copy(logits: torch.Tensor, adjusted: torch.Tensor | None) -> torch.Tensor:
    """The logits grammar masks may write -inf into: the adjusted ones, or a float32 copy
    (the raw logits give the logprobs)."""
    return adjusted if adjusted is not None else logits.float().clone()


@dataclass
class HostTimes:
    """The host's mask work inside the steps launched since the last ``take`` (the step
    log's, scheduler/step_log.py): seconds filling masks and queueing their copies
    (``fill_s``), seconds waiting for the device inside the fills (``wait_s``) and how many
    such waits (``waits``; on the CPU, where a wait returns at once, those a GPU would make).
    The step before's processing, which the first fill of a step may run (``settle``), is
    neither."""

    fill_s: float = 0.0
    wait_s: float = 0.0
    waits: int = 0

    def take(self) -> HostTimes:
        """The times so far, then zeros."""
        taken = replace(self)
        self.fill_s, self.wait_s, self.waits = 0.0, 0.0, 0
        return taken

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """A wait for the device, timed and counted."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.wait_s += time.perf_counter() - start
            self.waits += 1


class TokenMasks:
    def __init__(self, vocab_size: int, rows: int, width: int, device: torch.device) -> None:
        """``rows``: the most a decode batch has, padding included; ``width``: its tokens a
        row (verify nodes, or draft places at one depth)."""
        self.vocab_size = vocab_size
        self.device = device
        self.times = HostTimes()
        self._shifts = torch.arange(_BITS, dtype=torch.int32, device=device)
        words = -(-vocab_size // _BITS)
        cuda = device.type == "cuda"
        # Every token allowed at first, so that a capture from scratch rows never samples
        # from an all -inf row.
        self.staged = torch.full((rows * width, words), -1, dtype=torch.int32, device=device)
        self._host = [
            torch.empty((rows * width, words), dtype=torch.int32, pin_memory=cuda) for _ in range(2)
        ]
        self._parity = 0
        self._paths = torch.empty(rows * width * width, dtype=torch.int64, pin_memory=cuda)
        self._drafts = torch.empty((2, rows * width), dtype=torch.int64, pin_memory=cuda)
        # A step whose places the host chooses (``GrammarGuide.candidates``): each place's
        # mask rows of their own, and the places' best ids.
        self.walk_rows = min(rows, WALK_ROWS)
        self._apart = torch.empty(
            (self.walk_rows * width, words), dtype=torch.int32, pin_memory=cuda
        )
        self._choices = torch.empty(
            self.walk_rows * width * WALK_CANDIDATES, dtype=torch.int64, pin_memory=cuda
        )

    def stage(self, n: int, fill: MaskFill = _no_masks) -> None:
        """Queue the masks of ``n`` mask rows into ``staged``: those ``fill`` writes into
        the host's staging rows, every other row allowing every token."""
        # NOTE: a host set is refilled two stages later, once its copy ran: steps alternate
        # as the inputs do, and within a drafting step every stage but the first waits for
        # the device first, for all its work queued or for a mark queued after the stage
        # before (a place that does not wait, ``allow_every`` or ``stage_apart``, writes no
        # host set).
        host, self._parity = self._host[self._parity][:n], self._parity ^ 1
        self._send(host, fill)

    def stage_apart(self, place: int, n: int, fill: MaskFill) -> None:
        """As ``stage``, for draft place ``place`` of a step whose places the host chooses,
        from host rows no other stage writes: such a fill need not wait for the device (the
        copy of a place's rows runs before the step's verify nodes' fill, which waits for the
        drafts, and so before the next step's same place)."""
        first = place * self.walk_rows
        self._send(self._apart[first : first + n], fill)

    def _send(self, host: torch.Tensor, fill: MaskFill) -> None:
        """``fill`` into ``host`` (rows it leaves allow every token), queued into ``staged``."""
        start = time.perf_counter()
        n = host.shape[0]
        filled = fill(host)
        if len(filled) < n:
            host[sorted(set(range(n)).difference(filled))] = -1
        self.staged[:n].copy_(host, non_blocking=True)
        self.times.fill_s += time.perf_counter() - start

    def allow_every(self, n: int) -> None:
        """Queue every token allowed in ``n`` staged rows: device work alone, so that a fill
        which did not wait for the device writes no host set whose copy may be pending."""
        self.staged[:n].fill_(-1)

    def apply_staged(self, choose: torch.Tensor, columns: torch.Tensor | None = None) -> None:
        """Set to -inf, in ``choose`` (``[n, C]``), every logit the staged mask of its row
        does not allow (device work only: graph-safe). ``columns: [C]``: the token of each
        column, for a draft's own vocabulary (None: column ``c`` is token ``c``; ids past the
        vocabulary are refused under a grammar); a draft row whose columns hold none of the
        allowed tokens keeps its logits (an all -inf row has no distribution; the verify
        refuses what it drafts there)."""
        allowed = self._allowed(self.staged[: choose.shape[0]])
        if columns is None:
            choose[:, : self.vocab_size].masked_fill_(~allowed, float("-inf"))
            return
        # One column past the vocabulary for the tokens at or past it: allowed only in the
        # rows without a grammar (every token staged).
        allowed = torch.cat([allowed, allowed.all(dim=1, keepdim=True)], dim=1)
        allowed = allowed.index_select(1, columns.clamp(max=self.vocab_size))
        allowed |= ~allowed.any(dim=1, keepdim=True)
        choose.masked_fill_(~allowed, float("-inf"))

    def paths_to_host(self, paths: torch.Tensor) -> torch.Tensor:
        """``paths`` (``[R, d]``) copied into the fixed pinned buffer, behind the work
        queued; the host reads them once the device is there (``wait_for_device``)."""
        host = _leading(self._paths, paths.shape)
        host.copy_(paths, non_blocking=True)
        return host

    def choices_to_host(self, ids: torch.Tensor) -> torch.Tensor:
        """Each draft place's best ids (``[bs, n, k]``) copied into a fixed pinned buffer, as
        ``paths_to_host``."""
        host = _leading(self._choices, ids.shape)
        host.copy_(ids, non_blocking=True)
        return host

    def drafts_to_host(self, drafts: Drafts) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A step's drafts (and a tree's parents) copied into fixed pinned buffers, as
        ``paths_to_host``."""
        tokens = _leading(self._drafts[0], drafts.tokens.shape)
        tokens.copy_(drafts.tokens, non_blocking=True)
        if drafts.parents is None:
            return tokens, None
        parents = _leading(self._drafts[1], drafts.parents.shape)
        parents.copy_(drafts.parents, non_blocking=True)
        return tokens, parents

    def wait_for_device(self) -> None:
        """The host waits for the work queued (a fill reading what was copied to it)."""
        with self.times.waiting():
            if self.device.type == "cuda":
                with syncs_allowed(self.device):
                    torch.cuda.current_stream().synchronize()

    def apply(self, choose: torch.Tensor, rows: list[int], masks: bytes) -> None:
        """Eagerly: set to -inf, in ``choose`` (``[R, V]``), every logit of row ``rows[i]``
        that mask ``i`` (of ``masks``) does not allow (EXTEND rows)."""
        n = len(rows)
        if not n:
            return
        pinned = self.device.type == "cuda"
        host = _words(masks, n)
        host_rows = torch.tensor(rows, dtype=torch.int64)
        if pinned:
            host, host_rows = host.pin_memory(), host_rows.pin_memory()
        words = host.to(self.device, non_blocking=True)
        index = host_rows.to(self.device, non_blocking=True)
        allowed = self._allowed(words)
        picked = choose.index_select(0, index)
        picked[:, : self.vocab_size].masked_fill_(~allowed, float("-inf"))
        choose.index_copy_(0, index, picked)

    def _allowed(self, words: torch.Tensor) -> torch.Tensor:
        """Mask rows (int32 words ``[n, ceil(V / 32)]``) unpacked: ``[n, V]`` bool."""
        bits = (words.unsqueeze(-1) >> self._shifts) & 1  # [n, words, 32]
        return bits.view(words.shape[0], -1)[:, : self.vocab_size].bool()


def _leading(buffer: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The first elements of flat ``buffer`` viewed as ``shape``: contiguous, since a copy
    from the device into a strided host view goes through an unpinned temporary (refused
    while a graph is captured)."""
    return buffer[: shape.numel()].view(shape)


class DeviceMark:
    """A point of a step's device work the host may wait for: an event recorded there (at
    once eagerly, between two segments of a replayed graph); nothing to wait for on the
    CPU. Waits are timed into ``times``."""

    def __init__(self, device: torch.device, times: HostTimes) -> None:
        self.device = device
        self.times = times
        self.event = torch.cuda.Event() if device.type == "cuda" else None

    def record(self) -> None:
        if self.event is not None:
            self.event.record()

    def wait(self) -> None:
        with self.times.waiting():
            if self.event is not None:
                with syncs_allowed(self.device):
                    self.event.synchronize()


def _no_plan() -> StepPlan:
    """A plan of no rows: the turn outside any launch, and a capture's."""
    return StepPlan("decode", [], [], [], [], [], [], [], [], [], 0, True)


class HostMasks:
    """A runner's grammar masks on the host: the launch's ``HostTurn``, the step's waits
    (``holes``) and the fills there, over ``masks``' fixed buffers."""

    def __init__(self, masks: TokenMasks) -> None:
        self.masks = masks
        self.holes = MaskHoles()
        self.turn = HostTurn(_no_plan(), 0, None)
        # A drafting step's drafts on the host; a prepared draft place's paths alike.
        self.drafts_copied = DeviceMark(masks.device, masks.times)
        self.paths_copied = DeviceMark(masks.device, masks.times)

    def begin(
        self, plan: StepPlan, grammar: GrammarRows | None, settle: Callable[[], None] | None
    ) -> None:
        """A launch of ``plan`` starts: its fills read ``grammar``, once ``settle`` ran (at
        most once, at the first fill that needs the states)."""
        done = settle is None

        def settle_once() -> None:
            nonlocal done
            if not done:
                done = True
                assert settle is not None
                with syncs_allowed(self.masks.device):  # it waits for the step before's
                    settle()

        self.turn = HostTurn(plan, plan.bs, grammar, settle_once)

    def padded(self, bs: int) -> None:
        """The launch replays a graph of ``bs`` rows: its fills stage that many."""
        self.turn = replace(self.turn, bs=bs)

    @contextmanager
    def scratch(self, bs: int) -> Iterator[None]:
        """While a graph of ``bs`` scratch rows is captured: fills that allow every token and
        never settle the live step before."""
        turn, self.turn = self.turn, HostTurn(_no_plan(), bs, None)
        try:
            yield
        finally:
            self.turn = turn

    def guide(self) -> GrammarGuide:
        """A drafting step's guide: its fills read the turn when they run."""
        return GrammarGuide(self.masks, self.holes, lambda: self.turn, self.paths_copied)

    def wait_rows(self) -> None:
        """A plain step waits for its rows' masks (staged where ``apply_staged`` reads)."""

        def fill() -> None:
            self.turn.settle()
            self.masks.stage(self.turn.bs, self.turn.row_masks)

        self.holes.wait(fill)

    def drafts_to_host(self, drafts: Drafts) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A drafting step's drafts copied to the host (``TokenMasks.drafts_to_host``), and
        the point after the copy marked (a cut of a replayed graph), so that the nodes'
        masks wait for the copy only, while the verify's forward runs."""
        on_host = self.masks.drafts_to_host(drafts)
        self.holes.wait(self.drafts_copied.record)
        return on_host

    def wait_nodes(self, nodes: int, drafts: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        """A drafting step waits for the masks of its ``nodes`` verify nodes, given its
        ``drafts`` on the host (``drafts_to_host``)."""

        def fill() -> None:
            self.turn.settle()
            self.drafts_copied.wait()
            self.masks.stage(nodes, lambda out: self.turn.node_masks(out, *drafts))

        self.holes.wait(fill)


class GrammarGuide:
    """A drafting step's ``DraftGuide``: each draft place's mask from the host, at a
    ``MaskHoles`` wait (the launch's turn gives the states: ``turn()`` at fill time, so that
    a replayed graph's fills read the step replayed).

    Places chosen on the host (``candidates``, a batch of ``TokenMasks.walk_rows`` rows at
    most): a place's fill masks each grammar row as any place's, then takes its masked argmax
    where the host can tell it (the first of the place's best ids the mask allows, or the one
    id a mask allows alone: ``_told_argmax``) and leaves the place that id alone, so that
    the device draws it; the host then knows each row's path to the next place, whose fill
    does not wait for the device. After a place where it could not tell some row's, the next
    place waits and reads the paths the device drew. The first place waits for nothing and
    the best ids reach the host with the second place's wait, so a step waits once, plus
    once after each place the host could not choose."""

    def __init__(
        self,
        masks: TokenMasks,
        holes: MaskHoles,
        turn: Callable[[], HostTurn],
        paths_copied: DeviceMark,
    ) -> None:
        self.masks = masks
        self.holes = holes
        self.turn = turn
        self.paths_copied = paths_copied
        self._prepared: tuple[torch.Tensor, torch.Tensor] | None = None  # (paths, on the host)
        self._choices: torch.Tensor | None = None  # the step's best ids a place, on the host
        # Per grammar row, the ids the host chose on its path so far (fill time; None: it
        # must read the paths from the device).
        self._known: list[list[int]] | None = None

    def prepare(self, paths: torch.Tensor) -> None:
        # The paths on the host, and the point after their copy marked (a cut of a replayed
        # graph): ``restrict``'s fill for them waits for the copy alone.
        self._prepared = (paths, self.masks.paths_to_host(paths))
        self.holes.wait(self.paths_copied.record)

    def candidate_count(self, bs: int) -> int:
        return WALK_CANDIDATES if bs <= self.masks.walk_rows else 0

    def candidates(self, ids: torch.Tensor) -> None:
        self._choices = self.masks.choices_to_host(ids)

    def restrict(
        self, logits: torch.Tensor, paths: torch.Tensor, columns: torch.Tensor | None = None
    ) -> None:
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared[0] is paths:
            marked, host = True, prepared[1]
        else:
            marked, host = False, self.masks.paths_to_host(paths)
        place, choices = host.shape[1], self._choices
        # Chosen places: one a batch row, whose columns are the ids.
        assert choices is None or (columns is None and choices.shape[0] == host.shape[0])
        narrow = logits.shape[-1] <= self.masks.vocab_size

        def fill() -> None:
            turn = self.turn()
            turn.settle()  # while the device runs what was queued
            best = choices if turn.grammar is not None else None  # a scratch turn has none
            if place:  # past the first place (whose path is empty: no wait)
                if not turn.guides_paths():  # no row reads its path
                    self._known = None
                    self.masks.allow_every(host.shape[0])
                    return
                if best is not None and self._known is not None:
                    walked = self._walked_paths(turn, place)
                    self._stage_chosen(turn, place, walked, best, narrow)
                    return
                if marked:
                    self.paths_copied.wait()  # the forward since runs on
                else:
                    self.masks.wait_for_device()
            if best is None or not place:
                self._known = None
                self.masks.stage(host.shape[0], lambda out: turn.path_masks(out, host))
                return
            self._known = [host[row].tolist() for row in turn.plan.masked_rows]
            self._stage_chosen(turn, place, host, best, narrow)

        self.holes.wait(fill)
        self.masks.apply_staged(logits, columns)

    def _walked_paths(self, turn: HostTurn, place: int) -> torch.Tensor:
        """Every row's path to ``place`` (``[bs, place]``) from the ids the host chose."""
        assert self._known is not None
        paths = torch.zeros((turn.bs, place), dtype=torch.int64)
        paths[list(turn.plan.masked_rows)] = torch.tensor(self._known, dtype=torch.int64)
        return paths

    def _stage_chosen(
        self,
        turn: HostTurn,
        place: int,
        paths: torch.Tensor,
        choices: torch.Tensor,
        narrow: bool,
    ) -> None:
        """Stage ``place``'s masks after ``paths``, each grammar row's cut to its masked
        argmax where the host can tell it (``_told_argmax``; ``narrow``: the logits have no
        column past the vocabulary), and note the chosen ids (``_known``; -1 where the
        device draws: the list is then dropped)."""
        known = self._known
        assert known is not None
        rows = np.asarray(turn.plan.masked_rows, dtype=np.int64)
        best = choices[:, place].numpy()[rows]  # [grammar rows, k]

        def chosen(out: torch.Tensor) -> Sequence[int]:
            filled = turn.path_masks(out, paths)
            words = out.numpy().view(np.uint32)
            told = _told_argmax(words, rows, best, self.masks.vocab_size, narrow)
            if (told < 0).any():  # the device draws those places: the next one waits
                self._known = None
            took = told >= 0
            ids = told[took]
            words[rows[took]] = 0
            words[rows[took], ids >> 5] = np.left_shift(1, ids & 31).astype(np.uint32)
            for ids_so_far, token in zip(known, told.tolist(), strict=True):
                ids_so_far.append(token)
            return filled

        self.masks.stage_apart(place, turn.bs, chosen)


def _told_argmax(
    words: np.ndarray, rows: np.ndarray, best: np.ndarray, vocab_size: int, narrow: bool
) -> np.ndarray:
    """Per row ``rows[i]`` of mask rows ``words`` (uint32 words), its place's masked argmax
    where the host can tell it, else -1: the first of its best ids ``best[i]`` (best first)
    the mask allows, before any id past the vocabulary (whose column no mask covers: it
    might outrank an id chosen after it); else, where the logits are ``narrow`` (no column
    past the vocabulary) and none of its ids is past it, the one id its mask allows alone."""
    inside = np.logical_and.accumulate(best < vocab_size, axis=1)
    ids = np.where(inside, best, 0)
    bits = (words[rows[:, None], ids >> 5] >> (ids & 31).astype(np.uint32)) & 1
    allowed = bits.astype(bool) & inside
    told = np.where(
        allowed.any(axis=1), np.take_along_axis(best, allowed.argmax(1)[:, None], 1)[:, 0], -1
    )
    if narrow:
        for i in np.flatnonzero((told < 0) & inside[:, -1]):
            told[i] = _alone(words[rows[i]])
    return told


def _alone(words: np.ndarray) -> int:
    """The id mask row ``words`` allows where it allows one alone, else -1."""
    nonzero = np.flatnonzero(words)
    if nonzero.size != 1 or int(words[nonzero[0]]).bit_count() != 1:
        return -1
    return int(nonzero[0]) * 32 + int(words[nonzero[0]]).bit_length() - 1


# Places chosen on the host (GrammarGuide): the batch rows up to which a step hands over its
# places' best ids, and how many a place. With the embedded family's trained DFlash draft
# under the review schema (BENCHMARKS.md) a step waits after each place where some row's
# masked argmax was not among them (nor alone in its mask): with 64 ids 1.682 waits a step
# at one row and 3.404 at four, with 256 1.035 and 1.763, with 1,024 0.811 and 1.070
# (without the ids 4.4 and 5.6). With 256 ids and the masks of one id the guide waits 1.0 to
# 2.3 times a step from one row to 32, against 4.4 to 5.8: the rows are the widest batch
# those figures cover.
WALK_ROWS = 32
WALK_CANDIDATES = 256
