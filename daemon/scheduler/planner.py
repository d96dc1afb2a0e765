"""Plans: extend batches (prompt chunks, prefix-hit remainders, re-admissions; rows of any
length) and decode batches (every decoding row verifies the step's ``width`` tokens, its input
read from the relay buffer). An extend batch goes first when there is extend work, but after
``SchedulerLimits.max_prompt_run`` extend batches in a row while requests are part-way through
decoding (0: no limit) a decode batch goes first, so that such a row waits behind that many
at most. Part-way: a decode step (or a ride) of the row has launched. A row whose prompt has
just ended does not count, so a wave of new requests (without speculation a batch's requests
finish together and the next ones arrive together) fills the batch before any of them
decodes, as with no limit: counting the wave's own rows would interleave its prompts with its
first decode steps and stretch every one of those. Where
``SchedulerLimits.mixed_batches`` says, the decoding rows ride it, a token each within its
token budget, so that decoding never stalls behind a prompt: their input is the relay's root,
their positions the host's, and their token is sampled as a prompt's last. A rider is a plain
step for its row, and to the draft a prompt chunk of one token (its buffered positions catch
up first: engine/deferred.py). Only rows whose positions the host knows exactly ride: none of
their drafting steps in flight (``Request.open_steps``), so under speculation a row that
drafted in the step before sits out the next extend batch. Rows that draw under a grammar or
adjust their logits do not ride (their masks and adjustments are a decode step's).

A speculative decode step commits between 1 and ``max_commit`` tokens per row, and the host
learns how many one step late. So for a decoding row ``scheduled_len`` and
``scheduled_outputs`` are upper bounds: planning a decode batch adds ``max_commit`` to both,
processing it takes back what was not committed (outputs.py). Pages cover the bound plus the
step's ``kv_span``; the device reads the exact lengths from its relay. A plain step (the
drafting policy's choice on a speculative engine, drafting.py; every step without
speculation) has width 1 and commits exactly one token a row: it adds 1 and pages cover 1.
A drafting batch of a chain whose rows all cap their drafts (``Request.max_drafts``) below the
engine's depth runs the chain cut to the largest cap (``SchedulerLimits.shorter_chains``):
drafts no row may commit are neither drafted nor verified. A batch takes a drafting width only
up to the rows the memory plan gives it (``SchedulerLimits.drafting_rows``): a larger one
drafts at the widest width whose rows it fits, or takes a plain step, whatever the policy chose.

A row that draws under a grammar (daemon/grammar/) needs the state its committed tokens
reach. Where ``SchedulerLimits.late_masks`` says (one rank) a decode batch takes it even with
a step of its request in flight: the runner computes its masks from the states
(``Planned.grammar``) once the loop has processed that step, while the batch's first device
work runs (scheduler/loop.py): a plain step's masks before its sampling, a drafting step's
before each draft place and before its verify. Elsewhere such a row waits for its step (the
other rows go on overlapping), and a plain step carries its masks in the plan. A batch
holding grammar rows drafts only where ``SchedulerLimits.grammar_drafts`` says (one rank);
elsewhere its grammar rows wait while the other rows draft, and ride the next plain batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from outrider.daemon.engine.plan import SlotParams, StepPlan
from outrider.daemon.engine.step_memory import rows_at
from outrider.daemon.grammar.state import RowGrammars, pack_masks
from outrider.daemon.scheduler.admission import Admission
from outrider.daemon.scheduler.drafting import DraftPolicy
from outrider.daemon.scheduler.drill import RetractDrill
from outrider.daemon.scheduler.limits import SchedulerLimits
from outrider.daemon.scheduler.pages import PageDelta, PageManager
from outrider.daemon.scheduler.request import Request
from outrider.daemon.scheduler.slots import SlotTable
from outrider.plugins.api import NO_DRAFT, StepShape


@dataclass
class Planned:
    plan: StepPlan
    requests: list[Request]  # one per plan row
    max_commit: int = 1  # tokens a row may commit: what planning added to its bounds
    # A decode plan's grammar rows, whose masks the runner computes from their states: a
    # drafting plan's, or a plain one's whose masks are not in the plan (late masks).
    grammar: RowGrammars | None = None


@dataclass(frozen=True)
class ExtendRow:
    req: Request
    chunk: int  # tokens this step computes, from the request's scheduled_len
    rides: bool = False  # a decoding row: its one token is the relay's root, sampled


class Planner:
    def __init__(
        self,
        limits: SchedulerLimits,
        shape: StepShape,
        admission: Admission,
        pages: PageManager,
        slots: SlotTable,
        policy: DraftPolicy,
        drill: RetractDrill | None = None,
    ) -> None:
        """``policy``: whether a speculative engine's decode batch drafts; ``drill`` (debug):
        retractions on a schedule (drill.py)."""
        self.limits = limits
        self.shape = shape
        self.policy = policy
        self.drill = drill
        self.admission = admission
        self.pages = pages
        self.slots = slots
        self._plans = 0
        self._prompt_run = 0  # extend plans in a row while requests are part-way decoding

    def next_plan(self) -> Planned | None:
        """The next batch: extend work first, else a decode batch, but a decode batch first
        after ``max_prompt_run`` extend batches in a row while requests are part-way through
        decoding; None when idle."""
        self._plans += 1
        running = self.admission.running
        if self.drill is not None and self.drill.due(self._plans) and len(running) > 1:
            self.admission.retract(running[-1])
        if self.pages.window is not None:
            for req in running:  # a window computed again goes to the cache before it leaves
                self.pages.window.backfill(req)
                self.pages.window.give_back_behind(req)
        delta = PageDelta()  # pages a rider grew go with the decode batch if no extend runs
        limit = self.limits.max_prompt_run
        # Counted where limited: a row part-way through decoding (module docstring).
        decoding = bool(limit) and any(r.decoding and r.scheduled_outputs > 1 for r in running)
        if limit and self._prompt_run >= limit:
            planned = self._decode(delta) or self._extend(delta)
        else:
            planned = self._extend(delta) or self._decode(delta)
        waited = decoding and planned is not None and planned.plan.kind == "extend"
        self._prompt_run = self._prompt_run + 1 if waited else 0
        return planned

    # --- extend ------------------------------------------------------------------------

    def _extend(self, delta: PageDelta) -> Planned | None:
        """The decoding rows that ride (``_riders``), then running requests' next prompt
        chunks, then admissions, within the token budget."""
        budget = self.limits.chunked_prefill_tokens
        riders = self._riders(delta, budget)
        budget -= len(riders)
        rows: list[ExtendRow] = []
        for req in self.admission.running:
            if budget == 0:
                break
            if not req.decoding:
                rows.append(ExtendRow(req, min(budget, req.extend_end - req.scheduled_len)))
                budget -= rows[-1].chunk
        admitted: list[SlotParams] = []
        while budget > 0 and (new := self.admission.admit_next(delta, self._feeds)) is not None:
            admitted.append(SlotParams(new.slot, new.sampling, new.max_drafts))
            rows.append(ExtendRow(new, min(budget, new.extend_end - new.scheduled_len)))
            budget -= rows[-1].chunk
        if not rows:
            return None
        rows.extend(ExtendRow(req, 1, rides=True) for req in riders if req.decoding)
        return self._extend_plan(rows, delta, admitted)

    def _riders(self, delta: PageDelta, budget: int) -> list[Request]:
        """The decoding rows that ride an extend batch, with pages for their token (a rider
        retracted meanwhile is no longer decoding): none unless mixed batches are on, extend
        work may be waiting, and the rows leave room for a prompt in ``budget``; a row rides
        where its positions are exact (module docstring)."""
        running = self.admission.running
        if not self.limits.mixed_batches or not (
            self.admission.waiting or any(not r.decoding for r in running)
        ):
            return []
        riders = [
            r
            for r in running
            if r.decoding
            and not r.open_steps
            and not self._scheduled_to_end(r)
            and r.grammar is None
            and not _adjusting(r)
        ]
        if len(riders) >= budget:
            return []
        return [r for r in riders if r.decoding and self._grow(r, r.scheduled_len + 1, delta)]

    def _extend_plan(
        self, rows: list[ExtendRow], delta: PageDelta, admitted: list[SlotParams]
    ) -> Planned:
        starts: list[int] = []
        input_ids: list[int] = []
        sample_rows: list[int] = []
        sample_positions: list[int] = []
        # Per row, the token after the chunk (0 where the chunk ends the prompt: sampled).
        next_ids: list[int] = []
        relay_rows: list[int] = []
        prompts_done: list[Request] = []  # rows whose chunk ends the prompt
        for i, row in enumerate(rows):
            req, start = row.req, row.req.scheduled_len
            starts.append(start)
            req.scheduled_len += row.chunk
            self._window_step(req, start, start + row.chunk, req.scheduled_len)
            if row.rides:
                relay_rows.append(i)
                input_ids.append(0)  # the relay's root, on the device
            else:
                known = req.known_ids()
                input_ids.extend(known[start : req.scheduled_len])
                if req.scheduled_len < req.extend_end:
                    next_ids.append(known[req.scheduled_len])
                    continue
                prompts_done.append(req)
            sample_rows.append(i)
            sample_positions.append(req.scheduled_outputs)
            req.scheduled_outputs += 1
            next_ids.append(0)
        requests = [row.req for row in rows]
        sampled = [requests[i] for i in sample_rows]
        window_writes, window_values, copies_from, copies_to = self.pages.window_changes()
        masked_rows, masks = _masks(sampled)
        # NOTE: after this plan's admissions, which must not read pages this plan writes. A
        # draft that keeps KV may write the prompt's later (a deferred catch-up): the pages
        # are then published as holding the target's KV alone.
        for req in prompts_done:
            self.pages.share_prompt(req, drafted=not self.limits.draft_state)
        plan = StepPlan(
            kind="extend",
            slots=[r.slot for r in requests],
            starts=starts,
            q_lens=[row.chunk for row in rows],
            input_ids=input_ids,
            sample_rows=sample_rows,
            sample_positions=sample_positions,
            page_writes=delta.writes,
            page_values=delta.values,
            window_writes=window_writes,
            window_values=window_values,
            window_copies_from=copies_from,
            window_copies_to=copies_to,
            slot_params=admitted,
            max_logprobs=_max_logprobs(sampled),
            all_greedy=_all_greedy(sampled),
            cuts=_cuts(sampled),
            released_slots=self.slots.take_released(),
            next_ids=next_ids,
            relay_rows=relay_rows,
            unfed=_unfed(requests),
            adjusts=_adjusts(sampled),
            masked_rows=masked_rows,
            masks=masks,
        )
        return Planned(plan, requests)

    def _feeds(self, req: Request) -> bool:
        """Whether ``req`` (the head of the queue) feeds the draft (``Request.fed``): the
        policy's choice where the draft keeps state over the context, else always; never
        where it turned speculation off. It joins the running requests and those queued
        behind it (a burst admitted one by one decodes together), a full batch at most."""
        if not self.limits.draft_state:
            return True
        queued = len(self.admission.running) + len(self.admission.waiting) - 1
        others = min(queued, self.limits.max_running - 1)
        return req.max_drafts != 0 and self.policy.feeds(req, others)

    # --- decode ------------------------------------------------------------------------

    def _decode(self, delta: PageDelta) -> Planned | None:
        """Every decoding request not yet scheduled to its end, with pages for one more step."""
        ready = [r for r in self.admission.running if r.decoding and not self._scheduled_to_end(r)]
        settled = [r for r in ready if not _mask_pending(r)]
        late, grammar_drafts = self.limits.late_masks, self.limits.grammar_drafts
        # The rows a drafting batch would take: a grammar row with its step in flight only
        # where it may draft (else it rides the next plain batch, when its masks come late).
        pool = ready if late and grammar_drafts else settled
        shape = self.shape
        constrained = any(r.grammar is not None for r in pool)
        may_draft = (
            shape.speculative
            and any(r.max_drafts != 0 for r in pool)  # not all turned speculation off
            and (grammar_drafts or not constrained)
        )
        policy_width = self._fitting(self.policy.width(pool), len(pool)) if may_draft else 1
        drafting = policy_width > 1
        candidates = pool if drafting or not late else ready
        if not candidates:
            return None
        step = self._drafting_shape(candidates, policy_width) if drafting else NO_DRAFT
        width, span, max_commit = step.width, step.kv_span, step.max_commit
        rows: list[Request] = []
        for req in candidates:
            # NOTE: growing a row may retract requests later in this list: they have no slot
            # then, so they are not decoding.
            if req.decoding and self._grow(req, req.scheduled_len + span, delta):
                rows.append(req)
        if not rows:
            return None
        starts = [r.scheduled_len for r in rows]  # upper bounds: the device has the lengths
        for req, start in zip(rows, starts, strict=True):
            # The lowest start: the host's where no step is in flight, else one past the
            # lowest start of the step before (a step commits one token at least).
            lowest = req.step_floors[-1].end if req.step_floors else start
            self._window_step(req, lowest, lowest + 1, start + span)
            req.scheduled_len += max_commit
            req.scheduled_outputs += max_commit
        grammar = None
        if late or drafting:  # the runner computes the masks
            masked_rows, masks = [i for i, r in enumerate(rows) if r.grammar is not None], b""
            owners = [rows[i] for i in masked_rows]
            states = [g for r in owners if (g := r.grammar) is not None]
            grammar = RowGrammars(states, owners) if states else None
        else:
            masked_rows, masks = _masks(rows)
        window_writes, window_values, copies_from, copies_to = self.pages.window_changes()
        plan = StepPlan(
            kind="decode",
            slots=[r.slot for r in rows],
            starts=starts,
            q_lens=[width] * len(rows),
            input_ids=[],
            sample_rows=list(range(len(rows))),
            sample_positions=[],
            page_writes=delta.writes,
            page_values=delta.values,
            window_writes=window_writes,
            window_values=window_values,
            window_copies_from=copies_from,
            window_copies_to=copies_to,
            slot_params=[],
            max_logprobs=_max_logprobs(rows),
            all_greedy=_all_greedy(rows),
            cuts=_cuts(rows),
            released_slots=self.slots.take_released(),
            unfed=_unfed(rows),
            adjusts=_adjusts(rows),
            masked_rows=masked_rows,
            masks=masks,
        )
        return Planned(plan, rows, max_commit, grammar)

    def _fitting(self, width: int, rows: int) -> int:
        """``width`` where a step of it takes ``rows`` rows, else the widest drafting width
        below it that does, else 1 (the memory plan's bound on a step's working set)."""
        limits = self.limits
        if width == 1 or rows <= rows_at(limits.drafting_rows, width, limits.max_running):
            return width
        return next((w for w, most in limits.drafting_rows if w < width and rows <= most), 1)

    def _drafting_shape(self, rows: list[Request], width: int) -> StepShape:
        """The shape of ``width`` the policy chose, cut to the largest draft cap of ``rows``
        where every row caps its drafts lower and the engine cuts its chain."""
        shape = self.shape
        if not self.limits.shorter_chains:
            return shape.cut(width)
        caps = [shape.depth if r.max_drafts is None else r.max_drafts for r in rows]
        return shape.cut(min(max(caps) + 1, width))

    def _window_step(self, req: Request, start: int, end: int, writes_to: int) -> None:
        """A step of ``req`` planned, its lowest possible ``start`` and ``end``, launched
        steps writing up to position ``writes_to``: its window pages (window_pages.py)."""
        if self.pages.window is not None:
            self.pages.window.step(req, start, end, writes_to)

    def _scheduled_to_end(self, req: Request) -> bool:
        """Launched steps already produce this request's last possible token."""
        if req.max_new_tokens is not None and req.scheduled_outputs >= req.max_new_tokens:
            return True
        return len(req.prompt_ids) + req.scheduled_outputs >= self.limits.context_length

    def _grow(self, req: Request, positions: int, delta: PageDelta) -> bool:
        """Pages for ``req`` to cover ``positions`` KV positions, retracting the youngest
        running requests while the pool is short. False when ``req`` itself was retracted."""
        running = self.admission.running
        while req.allocated_len < positions:
            if self.pages.add_page(req, delta):
                continue
            victim = running[-1]
            assert len(running) > 1, "the pool cannot hold one request (fit check)"
            self.admission.retract(victim)
            if victim is req:
                return False
        return True


def _max_logprobs(requests: list[Request]) -> int:
    return max((r.sampling.logprobs for r in requests), default=0)


def _unfed(requests: list[Request]) -> list[int]:
    return [r.slot for r in requests if r.fed is False]


def _all_greedy(requests: list[Request]) -> bool:
    return all(r.sampling.temperature == 0.0 for r in requests)


def _cuts(requests: list[Request]) -> bool:
    """Whether a sampled row cuts its vocabulary by top-k or top-p (``StepPlan.cuts``)."""
    return any(r.sampling.cuts for r in requests)


def _adjusts(requests: list[Request]) -> bool:
    """Whether a sampled row changes its logits (``_adjusting``)."""
    return any(_adjusting(r) for r in requests)


def _adjusting(req: Request) -> bool:
    """Whether ``req`` changes its logits: a bias, a penalty, or a min_p cut."""
    return req.sampling.adjusts or req.sampling.min_p > 0


def _mask_pending(req: Request) -> bool:
    """A constrained request with a step in flight: its next mask needs that step's token
    (daemon/grammar/), so it waits a turn while the other rows go on."""
    return req.grammar is not None and req.steps_in_flight > 0


def _masks(sampled: list[Request]) -> tuple[list[int], bytes]:
    """The sampled rows that draw under a grammar (indices into ``sampled``) and their
    masks, as ``StepPlan`` carries them."""
    rows = [i for i, req in enumerate(sampled) if req.grammar is not None]
    if not rows:
        return [], b""
    return rows, pack_masks([g for i in rows if (g := sampled[i].grammar) is not None])
