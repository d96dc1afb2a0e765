"""CUDA graphs for decode batches (ARCHITECTURE.md 4.6): the whole decode step (plain decoding, or a
speculative cycle: draft, verify, accept, catch-up, relay writes) replayed from one graph per
key, with nothing but writes into fixed buffers in between.

A key is the padded batch size (a bucket), the row width (a speculative engine whose policy
may run plain steps has width-1 graphs beside its cycles; one that cuts its steps, a cycle of
each size; a width no start key holds, as a chain cut to a batch's caps, is captured on first
use), the KV bound every layout of the graph is built with, and the sampling variant (all
greedy or not; no logprobs or the most any request may ask, trimmed on the host). The KV bound
is bucketed only where a decode batch's attention backend declares ``graph_kv_bound`` (its work
grows with the bound: the ``torch`` backend's grows within twice the eager bound); otherwise
every graph is built with the largest bound. Padding rows run on the scratch slot, whose
request-table row points at the scratch page: they read and write nothing of a live request.

Before READY the engine captures every batch bucket x width x KV bucket (a drafting width up to
the most rows the memory plan gives it), greedy and sampled without logprobs, the sampled ones
cutting by top-k or top-p or not as a request that leaves its sampling out does
(``capture_all``), largest first so that the smaller captures reuse the pool's blocks; a logprob
variant, a variant with grammar rows (``GraphKey.masked``) and the sampled variant cutting the
other way (``GraphKey.cuts``) are captured the first time their key is needed. A step that waits
for the host's masks (``MaskHoles``, engine/token_masks.py) is captured as segments, cut at each
wait (engine/graph_capture.py: how one capture runs in the shared pool). A capture runs from a
batch of scratch rows only: its warm-up run and the capture touch no live state. Every replay
waits (on the device) for the previous step's result copy, whose source the next replay
overwrites. The start-up memory plan (engine/memory_plan.py) sizes the graphs' pool before any
graph exists, and the KV bound graphs are built with.

A speculative engine that defers its draft's catch-up (engine/deferred.py) also replays small
catch-up batches: up to ``CATCH_UP_ROWS[-1]`` rows, each padded to a bucket of lengths (from
``MIN_CATCH_UP_LEN``, doubling, up to the buffer's capacity), per KV bucket; larger ones, and
rows too short to pad, run eagerly. They are captured before READY with the decode graphs, from
scratch rows, and share their pool.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import msgspec
import torch

from outrider.daemon.engine.deferred import CatchUp
from outrider.daemon.engine.graph_capture import (
    CaptureProgress,
    GraphPool,
    Segment,
    reserved_after_release,
)
from outrider.daemon.engine.memory_plan import MIB, MemoryPlan, graph_pool_shortfall
from outrider.daemon.engine.plan import StepPlan
from outrider.daemon.engine.results import StepResults
from outrider.daemon.engine.step_memory import batch_buckets, kv_buckets, rows_at
from outrider.daemon.engine.token_masks import MaskHoles

log = logging.getLogger("outrider.graphs")

# Row buckets of captured catch-up batches: a catch-up is mostly an ended request's, or the
# rows of a small batch resuming drafting; larger batches spread an eager one over more rows.
CATCH_UP_ROWS = (1, 2, 4, 8)
MIN_CATCH_UP_LEN = 16  # the shortest padded row of a captured catch-up


@dataclass(frozen=True)
class GraphKey:
    bs: int  # rows, padding included
    max_kv: int  # the KV bound of every layout in the graph
    all_greedy: bool
    max_logprobs: int  # 0, or the most any request may ask
    width: int = 1  # tokens a row: the speculative width, or 1 for a plain step
    fed: bool = True  # False: a plain step of rows that do not feed the draft (the target's)
    masked: bool = False  # a step with grammar rows: its host's masks (token_masks.py)
    cuts: bool = False  # a sampled row cuts by top-k or top-p (``StepPlan.cuts``); greedy: no


@dataclass(frozen=True)
class CatchUpKey:
    rows: int  # padding rows included
    row_len: int  # tokens a row, padding included
    max_kv: int  # the KV bound of the graph's layout


def catch_up_lengths(capacity: int) -> list[int]:
    """Padded row lengths of captured catch-ups: doubling from ``MIN_CATCH_UP_LEN`` below the
    buffer's ``capacity``, then the capacity itself (none without deferral)."""
    sizes = []
    size = MIN_CATCH_UP_LEN
    while size < capacity:
        sizes.append(size)
        size *= 2
    return [*sizes, capacity] if capacity else []


@dataclass(frozen=True)
class CaptureSet:
    """What ``capture_all`` captured before READY."""

    keys: list[GraphKey]
    seconds: float
    pool_bytes: int  # device memory the graphs kept (reserved after minus before)


class DecodeGraphs:
    """Keys, padding, capture and replay of the runner's decode batches."""

    def __init__(
        self,
        max_bs: int,
        max_kv: int,
        max_logprobs: int,
        scratch_slot: int,
        kv_bounded: bool = True,
        widths: tuple[int, ...] = (1,),
        catch_up_capacity: int = 0,
        unfed_plain: bool = False,
        drafting_rows: tuple[tuple[int, int], ...] = (),
        sampled_cuts: bool = False,
    ) -> None:
        """``kv_bounded``: some backend of a decode batch declares ``graph_kv_bound``;
        ``widths``: the row widths decode batches run with (the speculative width, and 1
        where plain steps run); ``catch_up_capacity``: the positions a slot's plain steps
        buffer for the draft's catch-up (0: none); ``unfed_plain``: plain steps of rows that
        do not feed the draft run too (their own graphs: the target's step alone);
        ``drafting_rows``: the most rows of each drafting width (``MemoryPlan.rows_at``);
        ``sampled_cuts``: whether the sampled graphs captured at start cut by top-k or top-p
        (what requests that leave the sampling fields out do), the other kind's captured on
        first use."""
        self.buckets = batch_buckets(max_bs)
        self.drafting_rows = drafting_rows
        self.sampled_cuts = sampled_cuts
        self.catch_up_rows = [rows for rows in CATCH_UP_ROWS if rows <= max_bs]
        self.catch_up_lens = catch_up_lengths(catch_up_capacity)
        self.widths = sorted(widths, reverse=True)
        self.unfed_plain = unfed_plain
        self.kv_buckets = kv_buckets(max_kv, kv_bounded)
        self.max_kv = max_kv
        self.max_logprobs = max_logprobs
        self.scratch_slot = scratch_slot
        self.pool = GraphPool()  # every graph's memory and warm-up stream
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, StepResults]] = {}
        # The segments before a key's last graph, where its step waits for the host.
        self.segments: dict[GraphKey, list[Segment]] = {}
        self.catch_ups: dict[CatchUpKey, torch.cuda.CUDAGraph] = {}
        self.catch_up_replays = 0
        self.last_copy: torch.cuda.Event | None = None
        self.started = False  # capture_all is done: later captures are first uses

    def key(self, plan: StepPlan, kv_bound: int) -> GraphKey | None:
        """The graph for ``plan`` (a decode batch whose host KV bound is ``kv_bound``), None
        when it runs eagerly (larger than the largest bucket, or adjusting logits)."""
        bs = next((b for b in self.buckets if b >= plan.bs), 0)
        kv = next((b for b in self.kv_buckets if b >= kv_bound), 0)
        masked = bool(plan.masked_rows)
        if not bs or not kv or plan.adjusts:
            return None
        return GraphKey(
            bs=bs,
            max_kv=kv,
            all_greedy=plan.all_greedy,
            max_logprobs=self.max_logprobs if plan.max_logprobs else 0,
            width=plan.q_lens[0],
            fed=not plan.target_only,
            masked=masked,
            cuts=plan.cuts and not plan.all_greedy,
        )

    def catch_up_key(self, catch_up: CatchUp) -> CatchUpKey | None:
        """The graph for ``catch_up``, None when it runs eagerly: more rows than the largest
        bucket, a count past the buffer, or a row whose length may be under the padded row
        length (``catch_up.min_start``)."""
        rows = next((r for r in self.catch_up_rows if r >= len(catch_up.slots)), 0)
        length = next((n for n in self.catch_up_lens if n >= max(catch_up.counts)), 0)
        kv = next((b for b in self.kv_buckets if b >= catch_up.max_kv), 0)
        if not rows or not length or not kv or catch_up.min_start < length:
            return None
        return CatchUpKey(rows, length, kv)

    def start_keys(self) -> list[GraphKey]:
        """The keys captured before READY: every batch bucket x width x KV bucket (and the
        unfed plain step), a drafting width up to its most rows, sampled and greedy, without
        logprobs; largest first (KV bound, then tokens, then width), so later captures fit in
        the blocks the earlier ones freed."""
        variants = [(width, True) for width in self.widths]
        if self.unfed_plain:
            variants.append((1, False))
        steps = [
            (bs, width, fed)
            for bs in self.buckets
            for width, fed in variants
            if bs <= rows_at(self.drafting_rows, width, self.buckets[-1])
        ]
        steps.sort(key=lambda step: (step[0] * step[1], step[1], step[2]), reverse=True)
        return [
            GraphKey(bs, kv, all_greedy, 0, width, fed, cuts=self.sampled_cuts and not all_greedy)
            for kv in reversed(self.kv_buckets)
            for bs, width, fed in steps
            for all_greedy in (False, True)
        ]

    def catch_up_start_keys(self) -> list[CatchUpKey]:
        """The catch-up keys captured before READY: every row bucket x length x KV bucket,
        largest first."""
        return [
            CatchUpKey(rows, length, kv)
            for kv in reversed(self.kv_buckets)
            for rows in reversed(self.catch_up_rows)
            for length in reversed(self.catch_up_lens)
        ]

    def capture_all(
        self,
        capture: Callable[[GraphKey], None],
        plan: MemoryPlan,
        progress: CaptureProgress | None = None,
        capture_catch_up: Callable[[CatchUpKey], None] | None = None,
    ) -> CaptureSet:
        """Capture every key of ``start_keys`` not captured yet with ``capture``
        (``GraphSteps.capture``), then every catch-up key with ``capture_catch_up``
        (``CatchUpRunner.capture``), log the set in one line, and warn when the graphs kept
        more memory than ``plan`` left for them (``graph_pool_shortfall``)."""
        keys = [key for key in self.start_keys() if key not in self.graphs]
        runs = [partial(capture, key) for key in keys]
        catch_ups = 0
        if capture_catch_up is not None:
            new = [key for key in self.catch_up_start_keys() if key not in self.catch_ups]
            runs += [partial(capture_catch_up, key) for key in new]
            catch_ups = len(new)
        reserved = reserved_after_release()
        started = time.monotonic()
        for done, run in enumerate(runs, 1):
            run()
            if progress is not None:
                progress(done, len(runs))
        captured = CaptureSet(keys, time.monotonic() - started, reserved_after_release() - reserved)
        self.started = True
        estimate = plan.graph_estimate
        log.info(
            "captured %d decode graphs (batch %s, width %s, KV bound %s, greedy + sampled)%s in "
            "%.1f s, pool %d MiB (estimate %d MiB); logprob variants are captured on first use",
            len(keys), _span(self.buckets), "/".join(map(str, self.widths)),
            _span(self.kv_buckets), self._catch_up_span(catch_ups), captured.seconds,
            captured.pool_bytes // MIB, estimate // MIB,
        )  # fmt: skip
        shortfall = graph_pool_shortfall(plan, captured.pool_bytes)
        if shortfall:
            log.warning(
                "the CUDA graph pool (%d MiB) passes its estimate (%d MiB) by %d MiB more than "
                "the device memory left beside the KV pool: lower --gpu-memory-fraction or "
                "--cuda-graph-max-bs if serving runs out of device memory",
                captured.pool_bytes // MIB, estimate // MIB, shortfall // MIB,
            )  # fmt: skip
        elif captured.pool_bytes > estimate:
            log.debug(
                "graph pool estimate off by %+.1f%% (%d MiB captured, %d MiB estimated), "
                "within the %d MiB left beside the KV pool",
                100 * (captured.pool_bytes / estimate - 1), captured.pool_bytes // MIB,
                estimate // MIB, plan.headroom_bytes // MIB,
            )  # fmt: skip
        return captured

    def pad(self, plan: StepPlan, key: GraphKey) -> StepPlan:
        """``plan`` with ``key.bs`` rows (the extra ones on the scratch slot) and the key's
        sampling variant."""
        extra = key.bs - plan.bs
        width = plan.q_lens[0]
        scratch = [self.scratch_slot] * extra
        return msgspec.structs.replace(
            plan,
            slots=plan.slots + scratch,
            starts=plan.starts + [0] * extra,
            q_lens=plan.q_lens + [width] * extra,
            sample_rows=list(range(key.bs)),
            all_greedy=key.all_greedy,
            max_logprobs=key.max_logprobs,
            unfed=plan.unfed if key.fed else plan.unfed + scratch,
            cuts=key.cuts,
        )

    def scratch_plan(self, key: GraphKey) -> StepPlan:
        """A decode batch of ``key.bs`` scratch rows: what graphs are captured from."""
        return StepPlan(
            kind="decode",
            slots=[self.scratch_slot] * key.bs,
            starts=[0] * key.bs,
            q_lens=[key.width] * key.bs,
            input_ids=[],
            sample_rows=list(range(key.bs)),
            sample_positions=[],
            page_writes=[],
            page_values=[],
            slot_params=[],
            max_logprobs=key.max_logprobs,
            all_greedy=key.all_greedy,
            unfed=[] if key.fed else [self.scratch_slot] * key.bs,
            masked_rows=list(range(key.bs)) if key.masked else [],
            cuts=key.cuts,
        )

    def capture(
        self, key: GraphKey, run: Callable[[], StepResults], holes: MaskHoles | None = None
    ) -> None:
        """Capture ``run`` (a decode step over staged scratch rows) for ``key``, cut into
        segments at each of ``holes``' waits."""
        started = time.monotonic()
        graph, outputs, segments = self.pool.capture(run, holes)
        self.graphs[key] = (graph, outputs)
        if segments:
            self.segments[key] = segments
        # Start-up captures are summed up by capture_all; a later one is a first use.
        log.log(
            logging.INFO if self.started else logging.DEBUG,
            "captured a decode graph%s: batch %d, width %d%s, KV bound %d, %s%s%s in %.2f s",
            " on first use" if self.started else "", key.bs, key.width,
            "" if key.fed else " (unfed)", key.max_kv,
            "greedy" if key.all_greedy else "sampling" + (" with cuts" if key.cuts else ""),
            ", logprobs" if key.max_logprobs else "", ", grammar masks" if key.masked else "",
            time.monotonic() - started,
        )  # fmt: skip

    def capture_catch_up(self, key: CatchUpKey, run: Callable[[], None]) -> None:
        """Capture ``run`` (a catch-up over staged scratch rows) for ``key``."""
        self.catch_ups[key] = self.pool.capture(run)[0]
        log.debug("captured a catch-up graph: %s", key)

    def replay_catch_up(self, key: CatchUpKey) -> None:
        """Replay ``key``'s catch-up over the rows staged now."""
        self.catch_ups[key].replay()
        self.catch_up_replays += 1

    def _catch_up_span(self, captured: int) -> str:
        if not captured:
            return ""
        return (
            f" and {captured} catch-up graphs (rows {_span(self.catch_up_rows)}, length "
            f"{_span(self.catch_up_lens)})"
        )

    def replay(self, key: GraphKey) -> StepResults:
        """Replay ``key``'s graph over the inputs staged now (its segments first, each
        followed by its host fill); its static results."""
        graph, outputs = self.graphs[key]
        if self.last_copy is not None:
            torch.cuda.current_stream().wait_event(self.last_copy)
        for segment, fill in self.segments.get(key, ()):
            segment.replay()
            fill()
        graph.replay()
        return outputs


def _span(sizes: list[int]) -> str:
    return f"{sizes[0]}..{sizes[-1]}" if len(sizes) > 1 else str(sizes[0])
