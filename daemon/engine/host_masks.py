"""The host's side of a step's grammar masks (token_masks.py): ``HostMasks``, the runner's
(the launch's turn, the step's waits, the fills there), and ``GrammarGuide``, which masks a
draft's logits one draft place at a time (``DraftGuide``, plugins/speculative/base.py).

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
host chooses the places whose masked argmax it can tell, and waits only after a place it
could not; those places stage from host rows of their own (``TokenMasks.stage_apart``),
since their fills do not wait. Every wait is timed (``HostTimes``, the step log's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import torch

from outrider.daemon.engine.plan import StepPlan
from outrider.daemon.engine.sync_check import syncs_allowed
from outrider.daemon.engine.token_masks import (
    WALK_CANDIDATES,
    GrammarRows,
    HostTimes,
    HostTurn,
    MaskHoles,
    TokenMasks,
)
from outrider.plugins.speculative.base import Drafts


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
    once after each place the host could not choose. A block guides its first
    ``block_guided`` places only (``guided_places``: its worker drafts the others freely)."""

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

    def guided_places(self, bs: int, places: int) -> int:
        return min(places, block_guided(bs))

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


def block_guided(bs: int) -> int:
    """How many of a block's places a batch of ``bs`` rows guides: its masks within
    ``BLOCK_GUIDED_MASKS`` (a mask a row a place: every row may hold a grammar), and from
    ``BLOCK_GUIDED_PLACES[0]`` to ``[1]`` places. Of the batch's size, not of its grammar
    rows: a replayed graph's guided places are its capture's."""
    least, most = BLOCK_GUIDED_PLACES
    return min(most, max(least, BLOCK_GUIDED_MASKS // max(bs, 1)))


# A block's guided places (block_guided). On the H200's host a guided place costs about 0.11
# ms plus 0.04 ms a grammar row (its masks, the told argmax, the verify nodes' copies), against
# an unconstrained DFlash b16 turn of 5.4 ms at one row and 11.4 at 32; the family's trained
# DFlash (blocks of 8) gains less from each later place: 0.43, 0.26, 0.18, 0.16, 0.07, 0.08
# tokens a cycle for its second to seventh (BENCHMARKS.md). Past the seventh, or past three
# at 32 rows, a place's gain falls below what it costs.
BLOCK_GUIDED_MASKS = 96
BLOCK_GUIDED_PLACES = (3, 7)


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
        lone = np.flatnonzero((told < 0) & inside[:, -1])
        told[lone] = _alone(words[rows[lone]])
    return told


def _alone(words: np.ndarray) -> np.ndarray:
    """Per mask row of ``words`` (uint32 words ``[n, W]``), the id it allows where it allows
    one alone, else -1 (all rows at once: a row's own numpy calls cost microseconds)."""
    nonzero = words != 0
    word = nonzero.argmax(axis=1)
    value = words[np.arange(words.shape[0]), word].astype(np.int64)
    one = (np.count_nonzero(nonzero, axis=1) == 1) & (value & (value - 1) == 0)
    # A single set bit's index: exact in float64 for 32-bit values.
    bit = np.log2(np.maximum(value, 1)).astype(np.int64)
    return np.where(one, word * 32 + bit, -1)
