"""``TokenMasks``: grammar masks (daemon/grammar/) applied to the logits sampled rows choose
from (a copy: the logprobs stay the model's), and to a draft's logits one draft place at a
time; the host side that fills them inside a step (its waits, the launch's turn, the draft
guide) is host_masks.py. ``MaskHoles`` are those waits: eagerly the host's fill runs at the
wait; while a graph is captured the graph is cut there (graph_capture.py) and each replay
runs the recorded fill between the two segments. A fill reads the launch's ``HostTurn``: the
plan's masks, or its grammar rows' states, which it first brings up to date with the turn's
``settle`` (the loop's processing of the step before, scheduler/loop.py).

Masks are int32 words, bit ``t`` of a row set where token ``t`` may come. A decode step's are
staged into one fixed device buffer (``stage``: every mask row of the batch, padding included;
rows without a grammar allow every token) and unpacked there by device work only
(``apply_staged``: a disallowed token's logit becomes -inf), which a graph records. Paths and
drafts reach the host through fixed pinned buffers. The host staging is double-buffered as the
step inputs are (inputs.py); draft places the host chooses without waiting for the device
stage from host rows of their own (``stage_apart``). The masks of EXTEND rows come in the plan
and are applied eagerly (``apply``). The unpacking's temporaries (an int32 and a bool a logit
of a masked row) are freed before sampling's scratch is taken, inside the memory plan's
``SAMPLING_BYTES_PER_LOGIT``; the fixed buffers take ``rows * width`` mask rows.

The host waits inside a step only in these fills (``syncs_allowed``, sync_check.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Protocol

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
