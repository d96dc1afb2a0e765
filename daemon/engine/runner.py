"""The in-process executor: runs a ``StepPlan`` on the device without a host sync.

```
launch(plan):  stage inputs -> admissions and page writes -> EXTEND or decode -> result copy
EXTEND:        forward -> sample the rows that end their prompt -> seed their relay
decode:        relay -> draft -> forward over (root, drafts) -> verify -> advance the relay
               -> the worker's catch-up
plain decode:  relay -> forward over the root -> sample -> advance the relay -> catch-up
               (or its inputs buffered, for one batch later: engine/deferred.py)
collect:       wait for the copy -> StepOutput
```
Inputs live in fixed device buffers (inputs.py), per-slot state in ``SlotState`` (slots.py),
the accept rule in ``Verifier`` (verify.py), result copies in ``ResultCopies`` (results.py).
Input copies, the forward, sampling and relay writes run on the compute stream; only the
result copy (device -> host) runs on a side stream, gated by an event.

A decode batch of width 1 is a plain step (``StepPlan.drafting`` False): plain decoding, and
the steps a speculative engine's drafting policy runs without drafts (scheduler/drafting.py).
It commits the target's own draw at the row's output index, which is the token a drafting
step commits there too (the chain and tree rules and coupled drafts commit the target's
draws), so seeded outputs do not depend on which steps draft. The worker's catch-up sees it
as a verify of the root alone that accepted nothing (``Accepted`` one column wide), so its
state stays current without drafting; a worker that defers it (``deferred_positions``)
buffers the step's inputs instead, and the runner has it catch up in one batch before the
slot drafts again (engine/deferred.py).

Rows whose requests do not feed the draft (``StepPlan.unfed``, scheduler/drafting.py) take
part in a batch as any other, but a batch of such rows alone is the target's: its forward
captures nothing, and no worker hook runs (a plain step replays a graph of its own).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from outrider.daemon.engine.accept import check_tree, tree_geometry
from outrider.daemon.engine.deferred import CatchUp, DeferredCatchUp, Padding
from outrider.daemon.engine.graphs import CatchUpKey, DecodeGraphs, GraphKey
from outrider.daemon.engine.inputs import Capacity, InputBuffers, StepInputs, host_values
from outrider.daemon.engine.plan import StepOutput, StepPlan
from outrider.daemon.engine.results import Launched, ResultCopies, StepResults
from outrider.daemon.engine.slots import HostStarts, SlotState
from outrider.daemon.engine.timing import PhaseTimer, TimedPhase
from outrider.daemon.engine.verify import Verifier
from outrider.plugins.api import Phase, StepShape
from outrider.plugins.attention.base import AttentionBackend, GraphBounds
from outrider.plugins.device import (
    BatchLayout,
    ForwardBatch,
    HostLengths,
    KVCache,
    flat_kv_index,
)
from outrider.plugins.sampling import sample
from outrider.plugins.speculative.base import (
    Accepted,
    DecodeView,
    ExtendView,
    SpeculativeWorker,
)

if TYPE_CHECKING:
    from outrider.daemon.engine.ranks import RankChannel


class CausalLM(Protocol):
    def forward(self, input_ids: torch.Tensor, fb: ForwardBatch) -> torch.Tensor: ...
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class RunnerLimits:
    max_slots: int
    max_pages: int  # per request: ceil((context_length + reservation) / page_size)
    max_tokens: int  # per step
    vocab_limit: int  # sampled ids stay below this (the tokenizer's length)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        backends: Mapping[Phase, AttentionBackend],
        slots: SlotState,
        worker: SpeculativeWorker,
        shape: StepShape,
        limits: RunnerLimits,
        device: torch.device,
        simulate_acceptance: float = 0.0,
        graphs: DecodeGraphs | None = None,
        exact_cycle_lengths: bool = False,
        draft_backends: Sequence[AttentionBackend] = (),
    ) -> None:
        """``simulate_acceptance`` (debug, > 0): verify.py's ``SimulatedAcceptance``;
        ``graphs``: decode batches replay CUDA graphs (graphs.py), None: all eager;
        ``exact_cycle_lengths``: a backend of the speculative cycle (verify or draft) plans on
        the host from exact lengths, so each cycle first waits for the previous one's
        (``HostStarts``); ``draft_backends``: the worker's backends, which plan their part of
        the decode graphs too (``AttentionBackend.plan_replay``)."""
        self.model = model
        self.kv = kv
        self.backends = backends
        self.slots = slots
        self.worker = worker
        self.shape = shape
        self.limits = limits
        self.device = device
        self.decode_phase: Phase = "verify" if shape.speculative else "decode"
        self.sync_check = False
        self.timer: PhaseTimer | None = None  # benchmarks: device time per decode phase
        rows = limits.max_slots + 1
        # A step can at most rewrite the whole request table.
        pages = limits.max_slots * limits.max_pages
        self.inputs = InputBuffers(Capacity(limits.max_tokens, rows, pages), device)
        self.results = ResultCopies(rows, shape.max_commit, device)
        self.verifier = Verifier(shape, kv, slots, limits.vocab_limit, device, simulate_acceptance)
        self.offsets = torch.arange(shape.width, device=device)  # [W]
        self.ones = torch.ones(rows, 1, dtype=torch.int64, device=device)  # plain commits
        self.zeros = torch.zeros(rows, 1, dtype=torch.int64, device=device)  # plain paths
        self.graphs = graphs
        self.host_starts = (
            HostStarts(slots.relay_starts) if exact_cycle_lengths and shape.speculative else None
        )
        # Every backend a decode graph runs, once each.
        self.graph_backends = tuple(dict.fromkeys((backends[self.decode_phase], *draft_backends)))
        # Plain steps buffer the draft's catch-up (deferred.py); None: they run it at once.
        self.deferred = (
            DeferredCatchUp(worker.deferred_positions, rows, device)
            if worker.deferred_positions
            else None
        )
        # Rank 0 of tensor-parallel ranks: every plan goes to the other ranks first (ranks.py).
        self.channel: RankChannel | None = None

    def lead(self, channel: RankChannel) -> None:
        """Tensor parallelism, rank 0: send every launched plan to the other ranks."""
        assert channel.leader, "rank 0 leads"
        self.channel = channel

    def enable_sync_check(self, on: bool) -> None:
        """Debug: make any host synchronisation inside ``launch`` raise (CUDA only)."""
        self.sync_check = on and self.device.type == "cuda"

    def enable_phase_timing(self) -> PhaseTimer:
        """Benchmarks: time the draft, verify and catch-up of every decode batch from now on."""
        self.timer = PhaseTimer(self.device)
        return self.timer

    def launch(self, plan: StepPlan) -> Launched:
        """Queue ``plan`` on the device and return a handle for ``collect``. With
        ``sync_check`` (CUDA), any host synchronisation inside raises. Rank 0 of
        tensor-parallel ranks sends ``plan`` to the others first."""
        if self.channel is not None:
            self.channel.send(plan)
        if not self.sync_check:
            return self._launch(plan)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return self._launch(plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def collect(self, launched: Launched) -> StepOutput:
        """Wait for ``launched``'s results and return them on the host."""
        return self.results.collect(launched)

    def _launch(self, plan: StepPlan) -> Launched:
        deferred, catch_up = self.deferred, None
        if deferred is not None:
            catch_up = deferred.due(plan)
            if catch_up is not None:  # before the plan writes anything (deferred.py)
                self._catch_up(deferred, catch_up)
        launched = self._launch_plan(plan)
        if deferred is not None:
            deferred.advance(plan, catch_up)
        if self.host_starts is not None:
            self.host_starts.refresh()
        return launched

    def _launch_plan(self, plan: StepPlan) -> Launched:
        max_kv = self._max_kv(plan)
        if plan.kind == "decode" and self.graphs is not None:
            key = self.graphs.key(plan, max_kv)
            if key is not None:
                return self._replay(plan, key, self.graphs)
        values = host_values(plan, poison_released=self.slots.relay_check)
        inputs = self.inputs.stage(plan, values)
        self.slots.apply(inputs)
        if plan.kind == "extend":
            return self.results.copy(plan, self._extend(plan, inputs, max_kv))
        return self.results.copy(plan, self._decode(plan, inputs, max_kv))

    def _replay(self, plan: StepPlan, key: GraphKey, graphs: DecodeGraphs) -> Launched:
        """``plan`` padded to ``key``'s batch and replayed from its graph (captured first from
        scratch rows when new)."""
        if key not in graphs.graphs:
            self.capture_graph(key)
        padded = graphs.pad(plan, key)
        inputs = self.inputs.stage(padded, host_values(padded, poison_released=False))
        self.slots.apply(inputs)
        self._plan_replay(padded, key)
        self._mark("graph")
        results = graphs.replay(key)
        self._mark("end")
        launched = self.results.copy(plan, results)
        graphs.last_copy = launched.done
        return launched

    def _catch_up(self, deferred: DeferredCatchUp, catch_up: CatchUp) -> None:
        """The draft's catch-up on ``catch_up``'s buffered positions: replayed from graphs
        when they fit, whole or in two pieces (captured first from scratch rows when new),
        else eagerly."""
        graphs = self.graphs
        pieces = _graphed_pieces(graphs, deferred, catch_up) if graphs is not None else None
        if graphs is None or pieces is None:
            shape = deferred.stage(catch_up, None, self._catch_up_starts(catch_up))
            self.worker.catch_up_deferred(deferred.rows(shape, self.slots.relay_starts))
            return
        for piece, key in pieces:
            if key not in graphs.catch_ups:
                self.capture_catch_up(key)
            padding = Padding(key.rows, key.row_len)
            shape = deferred.stage(piece, padding, self._catch_up_starts(piece))
            if shape.host is not None:
                self._plan_catch_up(key, shape.host)
            graphs.replay_catch_up(key)

    def _catch_up_starts(self, catch_up: CatchUp) -> list[int] | None:
        """The exact starts of ``catch_up``'s slots where a backend plans on the host (the
        first read waits for the previous step), else None."""
        return None if self.host_starts is None else self.host_starts.read(catch_up.slots)

    def capture_catch_up(self, key: CatchUpKey) -> None:
        """Capture ``key``'s catch-up graph from rows on the scratch slot (no live state)."""
        graphs, deferred = self.graphs, self.deferred
        assert graphs is not None and deferred is not None, "graphs and deferral are on"
        scratch = CatchUp(slots=[], counts=[], max_kv=key.max_kv, min_start=key.row_len)
        # Every row padding: no live start to read (nor wait for).
        no_starts: list[int] | None = None if self.host_starts is None else []
        shape = deferred.stage(scratch, Padding(key.rows, key.row_len), no_starts)
        if shape.host is not None:
            self._plan_catch_up(key, shape.host)
        starts = self.slots.relay_starts
        graphs.capture_catch_up(
            key, lambda: self.worker.catch_up_deferred(deferred.rows(shape, starts))
        )

    def _plan_catch_up(self, key: CatchUpKey, host: HostLengths) -> None:
        """Let the draft's backends that schedule on the host plan ``key``'s catch-up graph:
        its one forward ends each row at its length (``DeferredRows.starts``)."""
        bounds = GraphBounds(key.rows, key.row_len, key.max_kv, self.kv.page_size)
        for backend in self.graph_backends:
            backend.plan_replay(key, host.seq_lens, bounds)

    def capture_graph(self, key: GraphKey) -> None:
        """Capture ``key``'s decode graph from a batch of scratch rows (no live state)."""
        graphs = self.graphs
        assert graphs is not None, "graphs are on"
        scratch = graphs.scratch_plan(key)
        staged = self.inputs.stage(scratch, host_values(scratch, poison_released=False))
        self._plan_replay(scratch, key)
        timer, self.timer = self.timer, None  # no timing events inside a graph
        try:
            graphs.capture(key, lambda: self._padded_decode(scratch, staged, key.max_kv))
        finally:
            self.timer = timer

    def _plan_replay(self, plan: StepPlan, key: GraphKey) -> None:
        """Let the backends that schedule on the host plan ``key``'s graph for ``plan`` (its
        exact starts, when the host has them)."""
        starts = self._host_starts(plan)
        if starts is not None:
            bounds = GraphBounds(key.bs, key.width, key.max_kv, self.kv.page_size)
            for backend in self.graph_backends:
                backend.plan_replay(key, starts, bounds)

    def _padded_decode(
        self, plan: StepPlan, inputs: StepInputs[torch.Tensor], max_kv: int
    ) -> StepResults:
        results = self._decode(plan, inputs, max_kv)
        self.slots.reset_scratch()
        return results

    def _extend(
        self, plan: StepPlan, inputs: StepInputs[torch.Tensor], max_kv: int
    ) -> StepResults | None:
        """Prompt chunks: the forward, then one sampled token per row whose chunk ends its
        prompt, which seeds the row's relay (next input, KV length, output count)."""
        fb = self._forward_batch(
            plan, inputs, "extend", inputs.positions, max_kv, self._host_starts(plan)
        )
        if self.worker.deferred is not None:  # each row's slot starts afresh (deferred.py)
            self.worker.deferred.clear(inputs.slots)
        hidden = self.model.forward(inputs.input_ids, fb)  # [T, H]
        view = ExtendView(
            fb, inputs.input_ids, inputs.next_tokens, inputs.sample_rows, inputs.sample_slots
        )
        if not plan.sample_rows:
            if not plan.target_only:
                self.worker.after_extend(view)
            return None
        logits = self.model.compute_logits(hidden[inputs.sample_index])  # [n, V]
        batch = self.slots.sampling(inputs.sample_slots, plan)
        out = sample(logits, batch, inputs.sample_positions, vocab_limit=self.limits.vocab_limit)
        last_positions = inputs.positions[inputs.sample_index]
        self.slots.write(
            inputs.sample_slots, out.tokens, last_positions + 1, inputs.sample_positions + 1
        )
        inputs.next_tokens.index_copy_(0, inputs.sample_rows, out.tokens)
        if not plan.target_only:
            if self.deferred is not None and self.deferred.buffers(plan):
                self.worker.defer_extend(view)
            else:
                self.worker.after_extend(view)
        return StepResults(
            tokens=out.tokens.unsqueeze(1),
            commit_lens=None,
            logprob=out.logprob.unsqueeze(1),
            top_ids=out.top_ids.unsqueeze(1),
            top_logprobs=out.top_logprobs.unsqueeze(1),
        )

    def _decode(self, plan: StepPlan, inputs: StepInputs[torch.Tensor], max_kv: int) -> StepResults:
        """Every row verifies ``width`` tokens (root + drafts) at positions taken from the
        relay, and commits ``commit_len`` of them (verify.py). ``max_kv``: the KV bound of
        every layout of the step."""
        if not plan.drafting:
            return self._plain(plan, inputs, max_kv)
        bs, width, max_commit = plan.bs, self.shape.width, self.shape.max_commit
        relay = self.slots.read(inputs.slots)
        tokens = inputs.input_ids.view(bs, width)
        tokens[:, 0] = relay.roots
        sampling = self.slots.sampling(inputs.slots, plan)
        view = DecodeView(
            inputs.slots, relay.roots, relay.starts, relay.out_lens, sampling, max_kv,
            self._host_starts(plan),
        )  # fmt: skip
        self._mark("draft")
        drafts = self.worker.draft(view)
        self._mark("verify")
        tokens[:, 1:] = drafts.tokens  # [bs, W - 1]
        offsets = self.offsets.expand(bs, width)  # [bs, W]
        depth, visible = offsets, None
        if drafts.parents is not None:
            if self.slots.relay_check:
                check_tree(drafts.tokens, drafts.parents)
            depth, visible = tree_geometry(drafts.parents, max_commit - 1)
        starts = relay.starts.unsqueeze(1)  # [bs, 1]
        torch.add(starts, depth, out=inputs.positions.view(bs, width))
        torch.add(relay.starts, width, out=inputs.seq_lens)
        # A tree's nodes share positions but not KV slots: node i's KV sits at start + i.
        kv_positions = starts + offsets
        fb = self._forward_batch(
            plan, inputs, self.decode_phase, kv_positions, max_kv, view.host_starts, visible
        )
        hidden = self.model.forward(inputs.input_ids, fb)  # [bs * W, H]
        logits = self.model.compute_logits(hidden)  # [bs * W, V]
        verified = self.verifier.verify(plan, inputs, relay, drafts, depth, logits)
        committed, lens, path = verified.committed(), verified.commit_lens, verified.path
        bonus = committed.gather(1, (lens - 1).unsqueeze(1)).squeeze(1)
        self.slots.write(inputs.slots, bonus, relay.starts + lens, relay.out_lens + lens)
        self._mark("catch_up")
        self.worker.after_accept(view, fb, Accepted(committed, lens, path))
        self._mark("end")
        out = verified.sampled
        k = out.top_ids.shape[-1]
        node = path.unsqueeze(2).expand(bs, max_commit, k)
        return StepResults(
            tokens=committed,
            commit_lens=lens,
            logprob=out.logprob.view(bs, width).gather(1, path),
            top_ids=out.top_ids.view(bs, width, k).gather(1, node),
            top_logprobs=out.top_logprobs.view(bs, width, k).gather(1, node),
        )

    def _plain(self, plan: StepPlan, inputs: StepInputs[torch.Tensor], max_kv: int) -> StepResults:
        """Every row's root at its relay position, and the target's draw after it (output
        index ``out_len``): one token a row; the worker catches up as after a verify of the
        root alone."""
        bs = plan.bs
        relay = self.slots.read(inputs.slots)
        inputs.input_ids.copy_(relay.roots)
        inputs.positions.copy_(relay.starts)
        torch.add(relay.starts, 1, out=inputs.seq_lens)
        sampling = self.slots.sampling(inputs.slots, plan)
        view = DecodeView(
            inputs.slots, relay.roots, relay.starts, relay.out_lens, sampling, max_kv,
            self._host_starts(plan),
        )  # fmt: skip
        self._mark("verify")
        fb = self._forward_batch(
            plan, inputs, self.decode_phase, relay.starts, max_kv, view.host_starts
        )
        hidden = self.model.forward(inputs.input_ids, fb)  # [bs, H]
        logits = self.model.compute_logits(hidden)  # [bs, V]
        out = sample(logits, sampling, relay.out_lens, vocab_limit=self.limits.vocab_limit)
        self.slots.write(inputs.slots, out.tokens, relay.starts + 1, relay.out_lens + 1)
        tokens, lens, path = out.tokens.unsqueeze(1), self.ones[:bs], self.zeros[:bs]  # [bs, 1]
        self._mark("catch_up")
        accepted = Accepted(tokens, lens.view(bs), path)
        if not plan.target_only:
            if self.deferred is not None:
                self.worker.defer(view, fb, accepted)
            else:
                self.worker.after_accept(view, fb, accepted)
        self._mark("end")
        return StepResults(
            tokens=tokens,
            commit_lens=lens.view(bs),
            logprob=out.logprob.unsqueeze(1),
            top_ids=out.top_ids.unsqueeze(1),
            top_logprobs=out.top_logprobs.unsqueeze(1),
        )

    def _forward_batch(
        self,
        plan: StepPlan,
        inputs: StepInputs[torch.Tensor],
        phase: Phase,
        kv_positions: torch.Tensor,
        max_kv: int,
        starts: tuple[int, ...] | None,
        tree_mask: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """The target's forward over ``inputs``; token ``i``'s K/V goes to its row's position
        ``kv_positions[i]``; ``starts``: the rows' exact starts, where the host has them
        (``_host_starts``)."""
        page_table, page_size = self.slots.page_table, self.kv.page_size
        host = None
        if starts is not None:
            ends = tuple(start + q for start, q in zip(starts, plan.q_lens, strict=True))
            host = HostLengths(tuple(plan.q_lens), ends)
        out_loc = flat_kv_index(page_table, inputs.token_slots, kv_positions.reshape(-1), page_size)
        layout = BatchLayout(
            page_table=page_table,
            page_size=page_size,
            slots=inputs.slots,
            positions=inputs.positions,
            out_loc=out_loc,
            q_start=inputs.q_start,
            seq_lens=inputs.seq_lens,
            q_pad_index=inputs.q_pad_index,
            bs=plan.bs,
            max_q=max(plan.q_lens),
            max_kv=max_kv,
            tree_mask=tree_mask,
            host=host,
        )
        capture = () if plan.target_only else self.worker.capture_layers
        return ForwardBatch.bind(layout, self.backends[phase], self.kv, capture)

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _mark(self, phase: TimedPhase) -> None:
        if self.timer is not None:
            self.timer.mark(phase)

    def _host_starts(self, plan: StepPlan) -> tuple[int, ...] | None:
        """The exact starts of ``plan``'s rows when the host knows them: prompt chunks, and
        plain decode (whose ``starts`` are exact: every step commits one token a row). A
        speculative cycle's starts (the accepted lengths) exist only on the device: the host
        has them only by waiting for the previous cycle (``host_starts``). None under a
        graph's capture, which must not wait (its backends were planned beforehand)."""
        if self._capturing():
            return None
        if plan.kind == "decode" and self.shape.speculative:
            return None if self.host_starts is None else tuple(self.host_starts.read(plan.slots))
        return tuple(plan.starts)

    def _max_kv(self, plan: StepPlan) -> int:
        """The host's bound on any row's KV length during ``plan``; decode starts are upper
        bounds on the committed lengths."""
        if plan.kind == "extend":
            return max(s + q for s, q in zip(plan.starts, plan.q_lens, strict=True))
        return max(plan.starts) + (self.shape.kv_span if plan.drafting else 1)


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
