"""Runs the draft's deferred catch-ups that the host's counts call for (deferred.py), before
the plan that called for them writes anything: replayed from captured catch-up graphs
(graphs.py) when the batch fits one whole or in its two pieces (``DeferredCatchUp.split``),
else eagerly over exact rows. A catch-up graph is captured from rows on the scratch slot (no
live state), the first time its key is needed or before READY.
"""

from __future__ import annotations

from outrider.daemon.engine.deferred import CatchUp, DeferredCatchUp, Padding
from outrider.daemon.engine.graph_steps import GraphPlanning
from outrider.daemon.engine.graphs import CatchUpKey, DecodeGraphs
from outrider.daemon.engine.slots import KnownStarts, SlotState
from outrider.plugins.device import HostLengths
from outrider.plugins.speculative.base import SpeculativeWorker


class CatchUpRunner:
    """The worker's catch-ups over the positions ``deferred`` counts."""

    def __init__(
        self,
        deferred: DeferredCatchUp,
        worker: SpeculativeWorker,
        slots: SlotState,
        starts: KnownStarts,
        planning: GraphPlanning,
    ) -> None:
        self.deferred = deferred
        self.worker = worker
        self.slots = slots
        self.starts = starts
        self.planning = planning

    def run(self, catch_up: CatchUp, graphs: DecodeGraphs | None) -> None:
        """The draft's catch-up on ``catch_up``'s buffered positions: replayed from ``graphs``
        when they fit, whole or in two pieces (captured first from scratch rows when new),
        else eagerly."""
        deferred = self.deferred
        pieces = _graphed_pieces(graphs, deferred, catch_up) if graphs is not None else None
        if graphs is None or pieces is None:
            shape = deferred.stage(catch_up, None, self.starts.of_slots(catch_up.slots))
            self.worker.catch_up_deferred(deferred.rows(shape, self.slots.relay_starts))
            return
        for piece, key in pieces:
            if key not in graphs.catch_ups:
                self.capture(key, graphs)
            padding = Padding(key.rows, key.row_len)
            shape = deferred.stage(piece, padding, self.starts.of_slots(piece.slots))
            if shape.host is not None:
                self._plan(key, shape.host)
            graphs.replay_catch_up(key)

    def capture(self, key: CatchUpKey, graphs: DecodeGraphs) -> None:
        """Capture ``key``'s catch-up graph from rows on the scratch slot (no live state)."""
        deferred = self.deferred
        scratch = CatchUp(slots=[], counts=[], max_kv=key.max_kv, min_start=key.row_len)
        # Every row padding: no live start to read (nor wait for).
        no_starts: list[int] | None = None if self.starts.copies is None else []
        shape = deferred.stage(scratch, Padding(key.rows, key.row_len), no_starts)
        if shape.host is not None:
            self._plan(key, shape.host)
        starts = self.slots.relay_starts
        graphs.capture_catch_up(
            key, lambda: self.worker.catch_up_deferred(deferred.rows(shape, starts))
        )

    def _plan(self, key: CatchUpKey, host: HostLengths) -> None:
        """Let the draft's backends that schedule on the host plan ``key``'s catch-up graph:
        its one forward ends each row at its length (``DeferredRows.starts``)."""
        self.planning.plan(key, host.seq_lens, key.rows, key.row_len, key.max_kv)


def _graphed_pieces(
    graphs: DecodeGraphs, deferred: DeferredCatchUp, catch_up: CatchUp
) -> list[tuple[CatchUp, CatchUpKey]] | None:
    """``catch_up`` as batches that captured graphs replay, each with its key: the batch whole,
    or its two pieces (``DeferredCatchUp.split``); None where neither fits."""
    key = graphs.catch_up_key(catch_up)
    if key is not None:
        return [(catch_up, key)]
    pieces = deferred.split(catch_up, graphs.catch_up_lens)
    if pieces is None:
        return None
    keyed = []
    for piece in pieces:
        key = graphs.catch_up_key(piece)
        if key is None:
            return None
        keyed.append((piece, key))
    return keyed
