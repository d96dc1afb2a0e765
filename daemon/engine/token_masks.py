"""``TokenMasks``: grammar masks (daemon/grammar/) applied to the logits sampled rows choose
from (a copy: the logprobs stay the model's). A plain step's masks come from the host in the
middle of the step, at a ``MaskHoles`` wait (from its plan's ``StepPlan.masks``, or computed
from the grammar states once the previous step is processed); a drafting step's, one per
verify node, once its drafts are known (runner.py). ``GrammarGuide`` masks a draft's logits
the same way, one draft place at a time (``DraftGuide``, plugins/speculative/base.py).

``MaskHoles`` is where a step waits for the host: eagerly the host's fill runs there and
then; while a graph is captured the graph is cut there (graphs.py), and each replay runs the
recorded fill between the two graphs.

Masks are int32 words, bit ``t`` of a row set where token ``t`` may come. They travel
through pinned host memory to the device and are unpacked there: a disallowed token's
logit becomes -inf. A plain decode step's masks are staged into a fixed device buffer
(``stage``: every row of the batch, padding included, rows without a grammar allowing every
token), which its CUDA graph reads (``apply_staged``); the host staging is double-buffered
as the step inputs are (inputs.py). The masks of EXTEND rows, verify nodes and draft places
are applied eagerly (``apply``) and allocated per step (torch's caching allocators). The
unpacking's temporaries (an int32 and a bool a logit of a masked row) are freed before
sampling's scratch is taken, inside the memory plan's ``SAMPLING_BYTES_PER_LOGIT``.

The host waits inside a step only here (``syncs_allowed``, sync_check.py): for the grammar
rows' drafts before their verify nodes' masks (``drafts_to_host``, ``apply_node_masks``), and
for each draft place's path under a guide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

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
    """The grammar rows of a decode plan, in plan order (daemon/grammar/state.py)."""

    def masks(self) -> bytes:
        """Their next masks from their states now, row after row (``StepPlan.masks``)."""
        ...

    def node_masks(self, tokens: torch.Tensor, parents: torch.Tensor | None) -> bytes:
        """Given their drafts on the host (``[rows, W - 1]``) and a tree's parents (or
        None), their verify nodes' masks, row after row, node after node."""
        ...

    def path_masks(self, paths: torch.Tensor) -> bytes:
        """Given the paths to their draft places on the host (``[rows, n, d]``), each
        place's mask, row after row, place after place (``DraftGuide.restrict``)."""
        ...


@dataclass(frozen=True)
class DraftsOnHost:
    tokens: torch.Tensor  # [rows, W - 1], host
    parents: torch.Tensor | None  # a tree's, host
    ready: torch.cuda.Event | None  # recorded behind the copy (CUDA)


def drafts_to_host(rows: list[int], drafts: Drafts, device: torch.device) -> DraftsOnHost:
    """The drafts of batch rows ``rows`` (and a tree's shape), copied to the host behind the
    draft, so that the verify's forward is queued before anything waits for them."""
    pinned = device.type == "cuda"
    host_rows = torch.tensor(rows, dtype=torch.int64)
    index = (host_rows.pin_memory() if pinned else host_rows).to(device, non_blocking=True)
    parts = [drafts.tokens.index_select(0, index)]
    if drafts.parents is not None:
        parts.append(drafts.parents.index_select(0, index))
    host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=pinned) for p in parts]
    for h, p in zip(host, parts, strict=True):
        h.copy_(p, non_blocking=True)
    ready = torch.cuda.Event() if pinned else None
    if ready is not None:
        ready.record()
    return DraftsOnHost(host[0], host[1] if len(host) > 1 else None, ready)


def masked_copy(logits: torch.Tensor, adjusted: torch.Tensor | None) -> torch.Tensor:
    """The logits grammar masks may write -inf into: the adjusted ones, or a float32 copy
    (the raw logits give the logprobs)."""
    return adjusted if adjusted is not None else logits.float().clone()


class TokenMasks:
    def __init__(self, vocab_size: int, rows: int, device: torch.device) -> None:
        """``rows``: the most a decode batch has, padding included."""
        self.vocab_size = vocab_size
        self.device = device
        self._shifts = torch.arange(_BITS, dtype=torch.int32, device=device)
        words = -(-vocab_size // _BITS)
        # A plain step's masks, where its graph reads them; every token allowed at first,
        # so that a capture from scratch rows never samples from an all -inf row.
        self.staged = torch.full((rows, words), -1, dtype=torch.int32, device=device)
        pinned = device.type == "cuda"
        self._host = [
            torch.empty((rows, words), dtype=torch.int32, pin_memory=pinned) for _ in range(2)
        ]
        self._parity = 0

    def stage(self, bs: int, rows: list[int], masks: bytes) -> None:
        """Queue a plain decode step's masks into ``staged``: row ``rows[i]`` takes mask
        ``i`` of ``masks``, every other row of the ``bs`` allows every token."""
        host, self._parity = self._host[self._parity], self._parity ^ 1
        host[:bs] = -1
        host[rows] = torch.frombuffer(bytearray(masks), dtype=torch.int32).view(len(rows), -1)
        self.staged[:bs].copy_(host[:bs], non_blocking=True)

    def apply_staged(self, choose: torch.Tensor) -> None:
        """Set to -inf, in ``choose`` (``[bs, V]``), every logit its row's staged mask does
        not allow (device work only: graph-safe)."""
        allowed = self._allowed(self.staged[: choose.shape[0]])
        choose[:, : self.vocab_size].masked_fill_(~allowed, float("-inf"))

    def apply_node_masks(
        self,
        choose: torch.Tensor,
        rows: list[int],
        width: int,
        drafts: DraftsOnHost,
        grammar: GrammarRows,
    ) -> None:
        """Wait for the drafts of batch rows ``rows`` (the device goes on with the verify's
        forward), have the host compute each of their ``width`` verify nodes' masks, and
        apply them to ``choose`` (``[bs * width, V]``)."""
        if drafts.ready is not None:
            with syncs_allowed(self.device):
                drafts.ready.synchronize()
        masks = grammar.node_masks(drafts.tokens, drafts.parents)
        self.apply(choose, [r * width + node for r in rows for node in range(width)], masks)

    def apply(
        self,
        choose: torch.Tensor,
        rows: list[int],
        masks: bytes,
        columns: torch.Tensor | None = None,
    ) -> None:
        """Set to -inf, in ``choose`` (``[R, C]``), every logit of row ``rows[i]`` whose
        token mask ``i`` (of ``masks``) does not allow, tokens at or past the masks'
        vocabulary included. ``columns: [C]``: the token of each column (None: column ``c``
        is token ``c``), for a draft's own vocabulary."""
        n = len(rows)
        if not n:
            return
        pinned = self.device.type == "cuda"
        host = torch.frombuffer(bytearray(masks), dtype=torch.int32).view(n, -1)
        host_rows = torch.tensor(rows, dtype=torch.int64)
        if pinned:
            host, host_rows = host.pin_memory(), host_rows.pin_memory()
        words = host.to(self.device, non_blocking=True)
        index = host_rows.to(self.device, non_blocking=True)
        allowed = self._allowed(words)
        # One column past the vocabulary, never allowed, for the tokens at or past it.
        allowed = torch.nn.functional.pad(allowed, (0, 1))
        if columns is None:
            width = choose.shape[1]
            if width > self.vocab_size:
                allowed = torch.nn.functional.pad(allowed, (0, width - self.vocab_size - 1))
            allowed = allowed[:, :width]
        else:
            allowed = allowed.index_select(1, columns.clamp(max=self.vocab_size))
        # A draft whose vocabulary holds none of the tokens allowed keeps its logits (an all
        # -inf row has no distribution); the verify refuses what it drafts there. A target's
        # mask always allows a token of its vocabulary.
        allowed |= ~allowed.any(dim=1, keepdim=True)
        picked = choose.index_select(0, index)
        choose.index_copy_(0, index, picked.masked_fill(~allowed, float("-inf")))

    def _allowed(self, words: torch.Tensor) -> torch.Tensor:
        """Mask rows (int32 words ``[n, ceil(V / 32)]``) unpacked: ``[n, V]`` bool."""
        bits = (words.unsqueeze(-1) >> self._shifts) & 1  # [n, words, 32]
        return bits.view(words.shape[0], -1)[:, : self.vocab_size].bool()


class GrammarGuide:
    """A drafting step's ``DraftGuide``: masks from the host's grammar states, one call a
    draft place (each waits for the paths to reach the host)."""

    def __init__(self, masks: TokenMasks, grammar: GrammarRows, rows: list[int], bs: int) -> None:
        """``rows``: the grammar rows' indices among the step's ``bs`` rows."""
        self.masks = masks
        self.grammar = grammar
        self.rows = rows
        self.bs = bs

    def restrict(
        self, logits: torch.Tensor, paths: torch.Tensor, columns: torch.Tensor | None = None
    ) -> None:
        n = logits.shape[0] // self.bs
        places = [row * n + place for row in self.rows for place in range(n)]
        with syncs_allowed(paths.device):
            index = torch.tensor(places, dtype=torch.int64).to(paths.device)
            host = paths.index_select(0, index).cpu()
        masks = self.grammar.path_masks(host.view(len(self.rows), n, -1))
        self.masks.apply(logits, places, masks, columns)
