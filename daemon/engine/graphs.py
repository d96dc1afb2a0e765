"""CUDA graphs for decode batches (DESIGN.md 4.6): the whole decode step (plain decoding, or a
speculative cycle: draft, verify, accept, catch-up, relay writes) replayed from one graph per
key, with nothing but writes into fixed buffers in between.

A key is the padded batch size (a bucket), the KV bound every layout of the graph is built
with (a power of two, so that the torch backend's work stays within twice the eager bound),
and the sampling variant (all greedy or not; no logprobs or the most any request may ask,
trimmed on the host). Padding rows run on the scratch slot, whose request-table row points at
the scratch page: they read and write nothing of a live request.

A graph is captured the first time its key is needed, from a batch of scratch rows only: the
warm-up run and the capture touch no live state. Graphs share one memory pool; every replay
waits (on the device) for the previous step's result copy, whose source the next replay
overwrites.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import torch

from outrider.daemon.engine.plan import StepPlan
from outrider.daemon.engine.results import StepResults

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

log = logging.getLogger("outrider.graphs")

MIN_KV_BUCKET = 64


@dataclass(frozen=True)
class GraphKey:
    bs: int  # rows, padding included
    max_kv: int  # the KV bound of every layout in the graph
    all_greedy: bool
    max_logprobs: int  # 0, or the most any request may ask


def batch_buckets(max_bs: int) -> list[int]:
    """Padded batch sizes: every size up to 8, then every 8 (the small ones matter most)."""
    sizes = list(range(1, min(max_bs, 8) + 1)) + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class DecodeGraphs:
    """Keys, padding, capture and replay. ``decode(plan, inputs_of, max_kv)`` runs one decode
    step from staged inputs and returns its results (the runner's ``_decode``)."""

    def __init__(
        self,
        max_bs: int,
        max_kv: int,
        max_logprobs: int,
        scratch_slot: int,
    ) -> None:
        self.buckets = batch_buckets(max_bs)
        self.max_kv = max_kv
        self.max_logprobs = max_logprobs
        self.scratch_slot = scratch_slot
        self.pool: _POOL_HANDLE | None = None  # shared by every graph, made at the first
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, StepResults]] = {}
        self.last_copy: torch.cuda.Event | None = None

    def key(self, plan: StepPlan, kv_bound: int) -> GraphKey | None:
        """The graph for ``plan`` (a decode batch whose host KV bound is ``kv_bound``), None
        when it runs eagerly (larger than the largest bucket)."""
        bs = next((b for b in self.buckets if b >= plan.bs), 0)
        if not bs:
            return None
        kv = max(MIN_KV_BUCKET, 1 << (kv_bound - 1).bit_length())
        return GraphKey(
            bs=bs,
            max_kv=min(kv, self.max_kv),
            all_greedy=plan.all_greedy,
            max_logprobs=self.max_logprobs if plan.max_logprobs else 0,
        )

    def pad(self, plan: StepPlan, key: GraphKey) -> StepPlan:
        """``plan`` with ``key.bs`` rows (the extra ones on the scratch slot) and the key's
        sampling variant."""
        extra = key.bs - plan.bs
        width = plan.q_lens[0]
        return msgspec.structs.replace(
            plan,
            slots=plan.slots + [self.scratch_slot] * extra,
            starts=plan.starts + [0] * extra,
            q_lens=plan.q_lens + [width] * extra,
            sample_rows=list(range(key.bs)),
            all_greedy=key.all_greedy,
            max_logprobs=key.max_logprobs,
        )

    def scratch_plan(self, key: GraphKey, width: int) -> StepPlan:
        """A decode batch of ``key.bs`` scratch rows: what graphs are captured from."""
        return StepPlan(
            kind="decode",
            slots=[self.scratch_slot] * key.bs,
            starts=[0] * key.bs,
            q_lens=[width] * key.bs,
            input_ids=[],
            sample_rows=list(range(key.bs)),
            sample_positions=[],
            page_writes=[],
            page_values=[],
            slot_params=[],
            max_logprobs=key.max_logprobs,
            all_greedy=key.all_greedy,
        )

    def capture(self, key: GraphKey, run: Callable[[], StepResults]) -> None:
        """Capture ``run`` (a decode step over staged scratch rows) for ``key``."""
        started = time.monotonic()
        # NOTE: capture synchronises; a launch under the sync check must not raise for it.
        sync_mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            # NOTE: a capture stages one extra step, so the next staging reuses the host set of
            # the step still in flight out of turn: let every copy in flight finish first.
            torch.cuda.synchronize()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run()  # warm-up: lazy initialisations happen outside the graph
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = run()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(sync_mode)
        self.graphs[key] = (graph, outputs)
        log.info(
            "captured a decode graph: batch %d, KV bound %d, %s%s in %.2f s",
            key.bs, key.max_kv, "greedy" if key.all_greedy else "sampling",
            ", logprobs" if key.max_logprobs else "", time.monotonic() - started,
        )  # fmt: skip

    def replay(self, key: GraphKey) -> StepResults:
        """Replay ``key``'s graph over the inputs staged now; its static results."""
        graph, outputs = self.graphs[key]
        if self.last_copy is not None:
            torch.cuda.current_stream().wait_event(self.last_copy)
        graph.replay()
        return outputs
