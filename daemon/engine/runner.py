"""The in-process executor: runs a ``StepPlan`` on the device without a host sync.

```
launch(plan):  deferred catch-ups due -> stage inputs -> admissions and page writes
               -> EXTEND or decode (eager, or replayed from its graph) -> result copy
EXTEND:        forward -> sample the rows that end their prompt -> seed their relay
decode:        relay -> draft -> forward over (root, drafts) -> verify -> advance the relay
               -> the worker's catch-up
plain decode:  relay -> forward over the root -> sample -> advance the relay -> catch-up
               (or its inputs buffered, for one batch later: engine/deferred.py)
collect:       wait for the copy -> StepOutput
```
Every step writes its tokens into the token history; a plan that ``adjusts`` runs eagerly and
samples from the adjusted logits (penalties.py); grammar rows sample from a masked copy
(token_masks.py). A decode step with grammar rows waits for their masks from the host (a
``MaskHoles`` wait: the host's fill there, between two segments of its graph when replayed):
a plain step between its logits and its sampling, a drafting step before each draft place
its worker chooses under the ``GrammarGuide`` (host_masks.py) and before its verify. The
masks come in the plan, or from the grammar states once the launch's ``settle`` has
processed the step before (scheduler/loop.py): the host does that work while the device
runs what was queued first.
Inputs live in fixed device buffers (inputs.py), per-slot state in ``SlotState`` (slots.py),
the accept rule in ``Verifier`` (verify.py), result copies in ``ResultCopies`` (results.py);
graph replays and captures of decode batches in ``GraphSteps`` (graph_steps.py), deferred
catch-ups in ``CatchUpRunner`` (catch_up.py).
Input copies, the forward, sampling and relay writes run on the compute stream; only the
result copy (device -> host) runs on a side stream, gated by an event.

A decode batch of width 1 is a plain step (``StepPlan.drafting`` False): plain decoding, and
the steps a speculative engine's drafting policy runs without drafts (scheduler/drafting.py).
It commits the target's own draw at the row's output index, which is the token a drafting
step commits there too (the chain and tree rules and coupled drafts commit the target's
draws), so seeded outputs do not depend on which steps draft. The worker's catch-up sees it
as a verify of the root alone that accepted nothing (``Accepted`` one column wide), so its
state stays current without drafting; a worker that defers it (``deferred_positions``)
buffers the step's inputs instead, and catches up in one batch before the slot drafts again
(engine/deferred.py). A drafting batch of a chain may be narrower than the engine's shape:
the chain cut short (``StepShape.cut`` of the plan's width; the worker drafts
``DecodeView.drafts``), which verifies, commits and counts as a chain of that depth.

Rows whose requests do not feed the draft (``StepPlan.unfed``, scheduler/drafting.py) take
part in a batch as any other, but a batch of such rows alone is the target's: its forward
captures nothing, and no worker hook runs (a plain step replays a graph of its own).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from outrider.daemon.engine.accept import check_tree, tree_geometry
from outrider.daemon.engine.catch_up import CatchUpRunner
from outrider.daemon.engine.deferred import DeferredCatchUp
from outrider.daemon.engine.graph_steps import GraphPlanning, GraphSteps
from outrider.daemon.engine.graphs import DecodeGraphs
from outrider.daemon.engine.host_masks import HostMasks
from outrider.daemon.engine.inputs import (
    Capacity,
    InputBuffers,
    StepInputs,
    batch_layout,
    host_values,
)
from outrider.daemon.engine.penalties import Adjuster
from outrider.daemon.engine.plan import StepOutput, StepPlan
from outrider.daemon.engine.results import Launched, ResultCopies, StepResults
from outrider.daemon.engine.slots import HostStarts, KnownStarts, SlotState
from outrider.daemon.engine.sync_check import sync_checked
from outrider.daemon.engine.timing import PhaseTimer
from outrider.daemon.engine.token_masks import GrammarRows, TokenMasks, masked_copy
from outrider.daemon.engine.verify import Verifier
from outrider.plugins.api import Phase, StepShape
from outrider.plugins.attention.base import AttentionBackend
from outrider.plugins.device import ForwardBatch, KVCache
from outrider.plugins.sampling import sample
from outrider.plugins.speculative.base import (
    Accepted,
    DecodeView,
    ExtendView,
    SpeculativeWorker,
)

if TYPE_CHECKING:
    from outrider.daemon.engine.ranks import RankChannel


def target_phases(shape: StepShape) -> tuple[Phase, Phase]:
    """The attention phases the target runs: prompts, and decode steps (the verify phase under
    speculation, width-1 steps of adaptive drafting included). Draft phases are the draft's."""
    return ("extend", "verify" if shape.speculative else "decode")


class CausalLM(Protocol):
    def forward(self, input_ids: torch.Tensor, fb: ForwardBatch) -> torch.Tensor: ...
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class RunnerLimits:
    max_slots: int
    max_pages: int  # per request: ceil((context_length + reservation) / page_size)
    max_tokens: int  # per step
    vocab_limit: int  # sampled ids stay below this (the tokenizer's length)
    vocab_size: int  # the model's: the width of a grammar mask (token_masks.py)


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
        verifier: Verifier,
        device: torch.device,
        graphs: DecodeGraphs | None = None,
        exact_cycle_lengths: bool = False,
        draft_backends: Sequence[AttentionBackend] = (),
    ) -> None:
        """``verifier``: the accept rule of drafting steps (verify.py);
        ``graphs``: decode batches replay CUDA graphs (graph_steps.py), None: all eager;
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
        self.decode_phase = target_phases(shape)[1]
        self.sync_check = False
        self.timer = PhaseTimer(device)  # benchmarks: device time per decode phase
        rows = limits.max_slots + 1
        # A step can at most rewrite the whole request table.
        pages = limits.max_slots * limits.max_pages
        self.inputs = InputBuffers(Capacity(limits.max_tokens, rows, pages), device)
        self.results = ResultCopies(rows, shape.max_commit, device)
        self.verifier = verifier
        self.adjuster = Adjuster(kv, slots, device)
        self.token_masks = TokenMasks(limits.vocab_size, rows, shape.width, device)
        self.host_masks = HostMasks(self.token_masks)
        self.offsets = torch.arange(shape.width, device=device)  # [W]
        # A chain's node j sees the nodes 0 .. j (the tree's ``visible``).
        self.chain_visible = torch.ones(
            shape.width, shape.width, dtype=torch.bool, device=device
        ).tril()
        self.ones = torch.ones(rows, 1, dtype=torch.int64, device=device)  # plain commits
        self.zeros = torch.zeros(rows, 1, dtype=torch.int64, device=device)  # plain paths
        self.graphs = graphs
        self.host_starts = (
            HostStarts(slots.relay_starts) if exact_cycle_lengths and shape.speculative else None
        )
        self.starts = KnownStarts(shape.speculative, device.type == "cuda", self.host_starts)
        planning = GraphPlanning(
            tuple(dict.fromkeys((backends[self.decode_phase], *draft_backends))), kv.page_size
        )
        self.graph_steps = GraphSteps(
            self.inputs, slots, self.results, planning, self.starts, self.timer, self._decode,
            self.host_masks,
        )  # fmt: skip
        # Plain steps buffer the draft's catch-up (deferred.py); None: they run it at once.
        self.catch_ups = (
            CatchUpRunner(
                DeferredCatchUp(worker.deferred_positions, rows, device),
                worker, slots, self.starts, planning,
            )
            if worker.deferred_positions
            else None
        )  # fmt: skip
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
        self.timer.on = True
        return self.timer

    @property
    def deferred(self) -> DeferredCatchUp | None:
        """The host's counts of the positions plain steps buffered; None: no deferral."""
        return None if self.catch_ups is None else self.catch_ups.deferred

    def launch(
        self,
        plan: StepPlan,
        grammar: GrammarRows | None = None,
        settle: Callable[[], None] | None = None,
    ) -> Launched:
        """Queue ``plan`` on the device and return a handle for ``collect``. ``grammar``:
        the states of its grammar rows, whose masks the host computes inside the step (a
        plain step's, when the plan does not carry them; a drafting step's draft places and
        verify nodes, once the drafts are on the host); ``settle``: the host's processing of
        the step before, which must come before those masks (called at most once, and only
        then). With ``sync_check`` (CUDA), any host synchronisation inside raises (but those
        waits). Rank 0 of tensor-parallel ranks sends ``plan`` to the others first."""
        assert grammar is None or self.channel is None, "grammar masks come in the plan on ranks"
        if self.channel is not None:
            self.channel.send(plan)
        with sync_checked(self.sync_check):
            return self._launch(plan, grammar, settle)

    def collect(self, launched: Launched) -> StepOutput:
        """Wait for ``launched``'s results and return them on the host."""
        return self.results.collect(launched)

    def _launch(
        self, plan: StepPlan, grammar: GrammarRows | None, settle: Callable[[], None] | None
    ) -> Launched:
        self.host_masks.begin(plan, grammar, settle)
        catch_ups, catch_up = self.catch_ups, None
        if catch_ups is not None:
            catch_up = catch_ups.deferred.due(plan)
            if catch_up is not None:  # before the plan writes anything (deferred.py)
                catch_ups.run(catch_up, self.graphs)
        launched = self._launch_plan(plan)
        if catch_ups is not None:
            catch_ups.deferred.advance(plan, catch_up)
        if self.host_starts is not None:
            self.host_starts.refresh()
        return launched

    def _launch_plan(self, plan: StepPlan) -> Launched:
        max_kv = self._max_kv(plan)
        key = None
        if plan.kind == "decode" and self.graphs is not None:
            key = self.graphs.key(plan, max_kv)
        if key is not None:
            assert self.graphs is not None
            return self.graph_steps.launch(plan, key, self.graphs)
        values = host_values(plan, poison_released=self.slots.relay_check)
        inputs = self.inputs.stage(plan, values)
        self.slots.apply(inputs)
        if plan.kind == "extend":
            return self.results.copy(plan, self._extend(plan, inputs, max_kv))
        return self.results.copy(plan, self._decode(plan, inputs, max_kv))

    def _extend(
        self, plan: StepPlan, inputs: StepInputs[torch.Tensor], max_kv: int
    ) -> StepResults | None:
        """Prompt chunks: the forward, then one sampled token per row whose chunk ends its
        prompt, which seeds the row's relay (next input, KV length, output count). A decoding
        row riding the batch (``plan.relay_rows``) takes its relay's root at the position the
        host planned (exact: it commits one token a step) and advances its relay as a plain
        step would."""
        if plan.relay_rows:
            roots = self.slots.read(inputs.relay_slots).roots
            inputs.input_ids.index_copy_(0, inputs.relay_index, roots)
        fb = self._forward_batch(
            plan, inputs, "extend", inputs.positions, max_kv, self.starts.of_plan(plan),
            riders=self.backends[self.decode_phase],
        )  # fmt: skip
        if self.worker.deferred is not None:  # each row's slot starts afresh (deferred.py)
            self.worker.deferred.clear(inputs.slots)
        hidden = self.model.forward(inputs.input_ids, fb)  # [T, H]
        self.adjuster.wrote_extend(fb.layout.out_loc, inputs.input_ids)
        view = ExtendView(
            fb, inputs.input_ids, inputs.next_tokens, inputs.sample_rows, inputs.sample_slots
        )
        if not plan.sample_rows:
            if not plan.target_only:
                self.worker.after_extend(view)
            return None
        logits = self.model.compute_logits(hidden[inputs.sample_index])  # [n, V]
        batch = self.slots.sampling(inputs.sample_slots, plan)
        last_positions = inputs.positions[inputs.sample_index]
        choose = None
        if plan.adjusts:
            choose = self.adjuster.extend_logits(
                logits, inputs.sample_slots, last_positions + 1, max_kv
            )
        if plan.masked_rows:
            choose = masked_copy(logits, choose)
            self.token_masks.apply(choose, plan.masked_rows, plan.masks)
        out = sample(
            logits, batch, inputs.sample_positions, vocab_limit=self.limits.vocab_limit,
            choose_from=choose,
        )  # fmt: skip
        self.slots.write(
            inputs.sample_slots, out.tokens, last_positions + 1, inputs.sample_positions + 1
        )
        inputs.next_tokens.index_copy_(0, inputs.sample_rows, out.tokens)
        if not plan.target_only:
            if self.deferred is not None and self.deferred.buffers(plan):
                self.worker.defer_extend(view)
            else:
                self.worker.after_extend(view)
        return StepResults.one_a_row(out, None)

    def _decode(self, plan: StepPlan, inputs: StepInputs[torch.Tensor], max_kv: int) -> StepResults:
        """Every row verifies ``width`` tokens (root + drafts) at positions taken from the
        relay, and commits ``commit_len`` of them (verify.py). ``max_kv``: the KV bound of
        every layout of the step."""
        if not plan.drafting:
            return self._plain(plan, inputs, max_kv)
        step = self.shape.cut(plan.q_lens[0])  # a chain may be cut short (drafting.py)
        bs, width, max_commit = plan.bs, step.width, step.max_commit
        relay = self.slots.read(inputs.slots)
        tokens = inputs.input_ids.view(bs, width)
        tokens[:, 0] = relay.roots
        sampling = self.slots.sampling(inputs.slots, plan)
        guide = None
        if plan.masked_rows:
            guide = self.host_masks.guide()
        view = DecodeView(
            inputs.slots, relay.roots, relay.starts, relay.out_lens, sampling, max_kv,
            self.starts.of_plan(plan), guide, width - 1,
        )  # fmt: skip
        self.timer.mark("draft")
        drafts = self.worker.draft(view)
        self.timer.mark("verify")
        tokens[:, 1:] = drafts.tokens  # [bs, W - 1]
        on_host = None
        if plan.masked_rows:  # their nodes' masks come from the host once the drafts are known
            on_host = self.host_masks.drafts_to_host(drafts)
        offsets = self.offsets[:width].expand(bs, width)  # [bs, W]
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
        choose = None
        if plan.adjusts:
            chain = self.chain_visible[:width, :width]
            nodes = visible if visible is not None else chain.expand(bs, -1, -1)
            choose = self.adjuster.decode_logits(
                logits, inputs.slots, relay, max_kv, (tokens, nodes)
            )
        if on_host is not None:
            self.host_masks.wait_nodes(bs * width, on_host)
            choose = masked_copy(logits, choose)
            self.token_masks.apply_staged(choose)
        verified = self.verifier.verify(plan, step, inputs, relay, drafts, depth, logits, choose)
        committed, lens, path = verified.committed(), verified.commit_lens, verified.path
        bonus = committed.gather(1, (lens - 1).unsqueeze(1)).squeeze(1)
        self.adjuster.committed(inputs.slots, relay.starts, relay.roots, committed)
        self.slots.write(inputs.slots, bonus, relay.starts + lens, relay.out_lens + lens)
        self.timer.mark("catch_up")
        self.worker.after_accept(view, fb, Accepted(committed, lens, path))
        self.timer.mark("end")
        return verified.results(committed)

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
            self.starts.of_plan(plan),
        )  # fmt: skip
        self.timer.mark("verify")
        fb = self._forward_batch(
            plan, inputs, self.decode_phase, relay.starts, max_kv, view.host_starts
        )
        hidden = self.model.forward(inputs.input_ids, fb)  # [bs, H]
        logits = self.model.compute_logits(hidden)  # [bs, V]
        choose = None
        if plan.adjusts:
            choose = self.adjuster.decode_logits(logits, inputs.slots, relay, max_kv)
        if plan.masked_rows:
            self.host_masks.wait_rows()
            choose = masked_copy(logits, choose)
            self.token_masks.apply_staged(choose)
        out = sample(
            logits, sampling, relay.out_lens, vocab_limit=self.limits.vocab_limit,
            choose_from=choose,
        )  # fmt: skip
        self.adjuster.committed(inputs.slots, relay.starts, relay.roots, out.tokens.unsqueeze(1))
        self.slots.write(inputs.slots, out.tokens, relay.starts + 1, relay.out_lens + 1)
        tokens, lens, path = out.tokens.unsqueeze(1), self.ones[:bs], self.zeros[:bs]  # [bs, 1]
        self.timer.mark("catch_up")
        accepted = Accepted(tokens, lens.view(bs), path)
        if not plan.target_only:
            if self.deferred is not None:
                self.worker.defer(view, fb, accepted)
            else:
                self.worker.after_accept(view, fb, accepted)
        self.timer.mark("end")
        return StepResults.one_a_row(out, lens.view(bs))

    def _forward_batch(
        self,
        plan: StepPlan,
        inputs: StepInputs[torch.Tensor],
        phase: Phase,
        kv_positions: torch.Tensor,
        max_kv: int,
        starts: tuple[int, ...] | None,
        tree_mask: torch.Tensor | None = None,
        riders: AttentionBackend | None = None,
    ) -> ForwardBatch:
        """The target's forward over ``inputs`` in ``phase`` (``batch_layout``); ``riders``:
        the backend of a prompt batch's riders (``ForwardBatch.bind``)."""
        layout = batch_layout(
            plan, inputs, self.slots.page_table, self.kv.page_size, kv_positions, max_kv, starts,
            tree_mask,
        )  # fmt: skip
        capture = () if plan.target_only else self.worker.capture_layers
        return ForwardBatch.bind(layout, self.backends[phase], self.kv, capture, riders)

    def _max_kv(self, plan: StepPlan) -> int:
        """The host's bound on any row's KV length during ``plan``; decode starts are upper
        bounds on the committed lengths."""
        if plan.kind == "extend":
            return max(s + q for s, q in zip(plan.starts, plan.q_lens, strict=True))
        return max(plan.starts) + self.shape.cut(plan.q_lens[0]).kv_span
