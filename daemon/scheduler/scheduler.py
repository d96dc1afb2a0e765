"""The scheduler: admission, prefix matching, KV reservation, batch planning, result processing.

Batches are EXTEND (prompt chunks, prefix-hit remainders, re-admissions; rows of any length)
or STEP (every decoding row advances one token, its input taken from the relay buffer); they
are never mixed, and EXTEND goes first when there is EXTEND work.

Lifetime rules under overlap (a step of a request may be in flight when the host learns
something about it):

| event                        | when the host acts            | the in-flight step's row     |
|------------------------------|-------------------------------|------------------------------|
| finished (EOS, stop, length) | processing the step that ends | ignored in the next step     |
| aborted / client vanished    | when the abort arrives        | ignored when processed       |
| retracted (KV ran out)       | planning the next step        | its tokens are still appended|

Pages and slots are released on the host at once: every device write of a later step is
queued after the in-flight step on the same stream, so reuse is safe. A retracted request is
re-admitted only once no step of it is in flight, so all its tokens are known on the host.

Speculative STEPs commit between 1 and ``max_commit`` tokens per row, and the host learns how
many one step late. So for a decoding row ``committed_len`` and ``planned_outputs`` are upper
bounds: planning a STEP adds ``max_commit`` to both, processing it takes back what was not
committed. Pages cover the bound plus the step's ``width``; the device reads the exact
lengths from its relay.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from outrider.daemon.engine.plan import SlotParams, StepOutput, StepPlan
from outrider.daemon.internal import (
    Counters,
    ErrorInfo,
    FinishInfo,
    RequestUpdate,
    TokenizedRequest,
)
from outrider.daemon.scheduler.finish import Finish, FinishChecker
from outrider.daemon.scheduler.radix import OutOfPages, PrefixCache
from outrider.daemon.scheduler.request import Request
from outrider.protocol.messages import TokenLogprob, Usage

log = logging.getLogger("outrider.scheduler")


@dataclass(frozen=True)
class SchedulerLimits:
    max_running: int
    max_pages_per_request: int
    chunked_prefill_tokens: int
    context_length: int
    retract_every: int = 0  # debug: retract the youngest running request every N plans
    step_width: int = 1  # tokens a STEP row verifies
    step_span: int = 1  # KV positions a STEP row writes from its committed length
    max_commit: int = 1  # tokens a STEP row commits at most
    prefix_margin_pages: int = 0  # last pages of a prefix hit recomputed (speculative drafts)


@dataclass
class SpecCounters:
    """Speculative counters over requests' applied verify steps (prefill counts nothing)."""

    max_drafts: int
    drafts: int = 0  # verify results applied (one per request per step)
    draft_tokens: int = 0
    accepted_tokens: int = 0  # before finish truncation
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.max_drafts

    def record(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1


@dataclass
class Planned:
    plan: StepPlan
    requests: list[Request]  # one per plan row


class Scheduler:
    def __init__(self, limits: SchedulerLimits, cache: PrefixCache, finish: FinishChecker) -> None:
        self.limits = limits
        self.cache = cache
        self.finish = finish
        self.page_size = cache.page_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the youngest is last
        self.requests: dict[int, Request] = {}
        self.free_slots = list(range(limits.max_running - 1, -1, -1))
        self.finished_by_reason: dict[str, int] = {}
        self.spec = SpecCounters(limits.max_commit - 1) if limits.step_width > 1 else None
        self._plans = 0
        # Pages one STEP may add to a row: its bound grows by max_commit, and the pages must
        # cover the bound plus the step's span.
        span, commit = limits.step_span, limits.max_commit
        self._step_pages = (commit + span - 1 + self.page_size - 1) // self.page_size
        self._pending: list[RequestUpdate] = []
        self._released_slots: list[int] = []

    # --- intake --------------------------------------------------------------------------

    def add(self, msg: TokenizedRequest) -> None:
        req = Request.from_message(msg)
        self.requests[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: int, reason: str) -> None:
        """End a live request at once with ``abort``; unknown or finished rids are ignored."""
        req = self.requests.get(rid)
        if req is None or req.finished:
            return
        log.debug("abort rid=%d (%s)", rid, reason)
        self._finish(req, Finish("abort"))

    def fail_all(self, requests: list[Request], message: str) -> None:
        """A step raised: every request of its batch ends with ``internal``."""
        for req in requests:
            if not req.finished:
                self._end(req, RequestUpdate(req.rid, [], error=ErrorInfo("internal", message)))

    def take_updates(self) -> list[RequestUpdate]:
        updates, self._pending = self._pending, []
        return updates

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- planning ------------------------------------------------------------------------

    def schedule(self) -> Planned | None:
        self._plans += 1
        every = self.limits.retract_every
        if every and self._plans % every == 0 and len(self.running) > 1:
            self._retract(self.running[-1])
        planned = self._schedule_extend() or self._schedule_step()
        if planned is not None:
            for req in planned.requests:
                req.inflight += 1
        return planned

    def _schedule_extend(self) -> Planned | None:
        budget = self.limits.chunked_prefill_tokens
        rows: list[tuple[Request, int]] = []
        for req in self.running:
            if budget == 0:
                break
            if not req.decoding:
                chunk = min(budget, req.extend_end - req.committed_len)
                rows.append((req, chunk))
                budget -= chunk
        page_writes: list[int] = []
        page_values: list[int] = []
        admitted: list[SlotParams] = []
        while budget > 0 and self.waiting and self.free_slots:
            req = self.waiting[0]
            if req.inflight:
                break  # retracted with a step still in flight: its last token is unknown
            if not self._admit(req, page_writes, page_values):
                break
            self.waiting.popleft()
            s = req.sampling
            admitted.append(SlotParams(req.slot, s.temperature, s.top_p, s.top_k, s.seed))
            chunk = min(budget, req.extend_end - req.committed_len)
            rows.append((req, chunk))
            budget -= chunk
        if not rows:
            return None
        input_ids: list[int] = []
        sample_rows: list[int] = []
        sample_positions: list[int] = []
        # Per row, the token after the chunk (0 where the chunk ends the prompt: sampled).
        next_ids: list[int] = []
        for i, (req, chunk) in enumerate(rows):
            start, known = req.committed_len, req.known_ids()
            input_ids.extend(known[start : start + chunk])
            req.committed_len += chunk
            if req.committed_len == req.extend_end:
                sample_rows.append(i)
                sample_positions.append(req.planned_outputs)
                req.planned_outputs += 1
                next_ids.append(0)
            else:
                next_ids.append(known[req.committed_len])
        requests = [req for req, _ in rows]
        sampled = [requests[i] for i in sample_rows]
        plan = StepPlan(
            kind="extend",
            slots=[r.slot for r in requests],
            starts=[r.committed_len - chunk for r, chunk in rows],
            q_lens=[chunk for _, chunk in rows],
            input_ids=input_ids,
            sample_rows=sample_rows,
            sample_positions=sample_positions,
            page_writes=page_writes,
            page_values=page_values,
            slot_params=admitted,
            max_logprobs=self._max_logprobs(sampled),
            all_greedy=self._all_greedy(sampled),
            released_slots=self._take_released_slots(),
            next_ids=next_ids,
        )
        return Planned(plan, requests)

    def _admit(self, req: Request, page_writes: list[int], page_values: list[int]) -> bool:
        """Give ``req`` a slot and the pages of its whole EXTEND phase plus one token."""
        known = req.known_ids()
        # NOTE: an admission that backs out is retried next step: count the query only once
        # it succeeds.
        cached = self.cache.match(known, record=False)
        if self.limits.prefix_margin_pages and cached:
            give_back = cached[max(0, len(cached) - self.limits.prefix_margin_pages) :]
            self.cache.release(give_back)
            cached = cached[: len(cached) - len(give_back)]
        need = (len(known) + 1 + self.page_size - 1) // self.page_size - len(cached)
        # Headroom: every decoding request may need fresh pages in the next step.
        headroom = self._step_pages * sum(1 for r in self.running if r.decoding)
        if need + headroom > self.cache.available() and self.running:
            self.cache.release(cached)
            return False
        try:
            private = self.cache.allocate(need)
        except OutOfPages:
            self.cache.release(cached)
            return False
        self.cache.record_query(hit=bool(cached))
        req.slot = self.free_slots.pop()
        req.pages = cached + private
        req.num_cached_pages = len(cached)
        req.committed_len = len(cached) * self.page_size
        req.extend_end = len(known)
        req.planned_outputs = len(req.output_ids)
        if not req.admitted_once:
            req.admitted_once = True
            req.cached_len = req.committed_len
            req.admit_time = time.time()
        self.running.append(req)
        self._write_pages(req, 0, page_writes, page_values)
        return True

    def _schedule_step(self) -> Planned | None:
        page_writes: list[int] = []
        page_values: list[int] = []
        rows: list[Request] = []
        width, commit = self.limits.step_width, self.limits.max_commit
        for req in list(self.running):
            if req.slot < 0 or not req.decoding or self._planned_to_end(req):
                continue
            if not self._grow(
                req, req.committed_len + self.limits.step_span, page_writes, page_values
            ):
                continue
            rows.append(req)
        if not rows:
            return None
        starts = [r.committed_len for r in rows]  # upper bounds: the device has the lengths
        for req in rows:
            req.committed_len += commit
            req.planned_outputs += commit
        plan = StepPlan(
            kind="decode",
            slots=[r.slot for r in rows],
            starts=starts,
            q_lens=[width] * len(rows),
            input_ids=[],
            sample_rows=list(range(len(rows))),
            sample_positions=[],
            page_writes=page_writes,
            page_values=page_values,
            slot_params=[],
            max_logprobs=self._max_logprobs(rows),
            all_greedy=self._all_greedy(rows),
            released_slots=self._take_released_slots(),
        )
        return Planned(plan, rows)

    def _take_released_slots(self) -> list[int]:
        released, self._released_slots = self._released_slots, []
        return released

    def _planned_to_end(self, req: Request) -> bool:
        """Launched steps already produce this request's last possible token."""
        if req.max_new_tokens is not None and req.planned_outputs >= req.max_new_tokens:
            return True
        return len(req.prompt_ids) + req.planned_outputs >= self.limits.context_length

    def _grow(
        self, req: Request, positions: int, page_writes: list[int], page_values: list[int]
    ) -> bool:
        """Pages for ``req`` to cover ``positions`` KV positions, retracting the youngest
        other requests if needed. Returns False when ``req`` itself was retracted."""
        while len(req.pages) * self.page_size < positions:
            try:
                (page,) = self.cache.allocate(1)
            except OutOfPages:
                victim = self.running[-1]
                assert len(self.running) > 1, "the pool cannot hold one request (fit check)"
                self._retract(victim)
                if victim is req:
                    return False
                continue
            req.pages.append(page)
            self._write_pages(req, len(req.pages) - 1, page_writes, page_values)
        return True

    def _write_pages(
        self, req: Request, first: int, page_writes: list[int], page_values: list[int]
    ) -> None:
        base = req.slot * self.limits.max_pages_per_request
        for i in range(first, len(req.pages)):
            page_writes.append(base + i)
            page_values.append(req.pages[i])

    def _retract(self, req: Request) -> None:
        """Back to the head of the waiting queue; its KV is recomputed on re-admission."""
        log.info("retract rid=%d (%d tokens)", req.rid, len(req.known_ids()))
        self._release(req, publish=False)
        self.waiting.appendleft(req)

    @staticmethod
    def _max_logprobs(requests: list[Request]) -> int:
        return max((r.sampling.logprobs for r in requests), default=0)

    @staticmethod
    def _all_greedy(requests: list[Request]) -> bool:
        return all(r.sampling.temperature == 0.0 for r in requests)

    # --- results -------------------------------------------------------------------------

    def process(self, planned: Planned, out: StepOutput) -> None:
        """Apply one step's sampled tokens: finish checks, streaming, freeing. The updates
        wait in ``take_updates``."""
        for req in planned.requests:
            req.inflight -= 1
        step = planned.plan.kind == "decode"
        for i, row in enumerate(planned.plan.sample_rows):
            req = planned.requests[row]
            if req.finished:
                continue
            tokens = out.tokens[i]
            if step and req.slot >= 0:
                # Take back the part of the bound that was not committed.
                unused = self.limits.max_commit - len(tokens)
                req.committed_len -= unused
                req.planned_outputs -= unused
            if step and self.spec is not None:
                self.spec.record(self.limits.step_width - 1, len(tokens) - 1)
                req.spec_drafts += 1
                req.spec_accepted_tokens += len(tokens) - 1
            if not req.output_ids:
                req.first_token_time = time.time()
            kept, finish = self.finish.append(req, tokens)
            if req.want_logprobs:
                # NOTE: the batch computes the largest top-n any row asked for; trim to ours.
                n = req.sampling.logprobs
                req.logprobs.extend(
                    TokenLogprob(
                        tokens[j],
                        out.logprobs[i][j],
                        list(zip(out.top_ids[i][j][:n], out.top_logprobs[i][j][:n], strict=True)),
                    )
                    for j in range(kept)
                )
            if finish is not None:
                self._finish(req, finish)
            elif req.stream:
                self._stream(req)

    def _stream(self, req: Request) -> None:
        upto = self.finish.streamable(req)
        if upto > req.streamed:
            self._pending.append(
                RequestUpdate(
                    req.rid,
                    req.output_ids[req.streamed : upto],
                    logprobs=req.logprobs[req.streamed : upto] if req.want_logprobs else None,
                )
            )
            req.streamed = upto

    def _finish(self, req: Request, finish: Finish) -> None:
        usage = Usage(
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_len,
            spec_drafts=req.spec_drafts,
            spec_accepted_tokens=req.spec_accepted_tokens,
        )
        info = FinishInfo(finish.reason, finish.matched_stop, usage, finish.text_cut)
        update = RequestUpdate(
            req.rid,
            req.output_ids[req.streamed :],
            logprobs=req.logprobs[req.streamed :] if req.want_logprobs else None,
            finish=info,
        )
        self.finished_by_reason[finish.reason] = self.finished_by_reason.get(finish.reason, 0) + 1
        self._log_finished(req, finish)
        self._end(req, update)

    def _end(self, req: Request, update: RequestUpdate) -> None:
        req.finished = True
        self._pending.append(update)
        self.finish.forget(req)
        if req.slot >= 0:
            self._release(req, publish=True)
        elif req in self.waiting:
            self.waiting.remove(req)
        del self.requests[req.rid]

    def _release(self, req: Request, *, publish: bool) -> None:
        """Give back ``req``'s slot and pages; ``publish`` puts its whole pages into the
        prefix cache (only positions whose KV a launched step writes, with known tokens)."""
        pages = req.pages
        if publish:
            known = req.known_ids()
            pages = self.cache.insert(known[: min(req.committed_len, len(known))], pages)
        self.cache.release(pages)
        self.free_slots.append(req.slot)
        self._released_slots.append(req.slot)
        self.running.remove(req)
        req.slot, req.pages, req.num_cached_pages = -1, [], 0
        req.committed_len = req.extend_end = 0

    def _log_finished(self, req: Request, finish: Finish) -> None:
        now = time.time()
        ttft = req.first_token_time - req.arrival if req.first_token_time else -1.0
        log.info(
            "finished id=%s rid=%d prompt=%d output=%d cached=%d queue=%.4f ttft=%.4f "
            "e2e=%.4f reason=%s",
            req.request_id,
            req.rid,
            len(req.prompt_ids),
            len(req.output_ids),
            req.cached_len,
            (req.admit_time - req.arrival) if req.admit_time else -1.0,
            ttft,
            now - req.arrival,
            finish.reason,
        )

    # --- state ---------------------------------------------------------------------------

    def counters(self) -> Counters:
        spec = self.spec or SpecCounters(0)
        return Counters(
            running=len(self.running),
            waiting=len(self.waiting),
            kv_used_tokens=self.cache.used_pages() * self.page_size,
            kv_total_tokens=self.cache.usable_pages * self.page_size,
            prefix_cache_queries=self.cache.queries,
            prefix_cache_hits=self.cache.hits,
            requests_finished=dict(self.finished_by_reason),
            spec_drafts=spec.drafts,
            spec_draft_tokens=spec.draft_tokens,
            spec_accepted_tokens=spec.accepted_tokens,
            spec_accepted_per_position=list(spec.accepted_per_position),
        )

    def check_integrity(self) -> None:
        """Every page in exactly one state (see radix.py); slots and requests consistent."""
        private: dict[int, int] = {}
        cached: dict[int, int] = {}
        for req in self.running:
            assert req.slot >= 0 and not req.finished
            for page in req.pages[: req.num_cached_pages]:
                cached[page] = cached.get(page, 0) + 1
            for page in req.pages[req.num_cached_pages :]:
                private[page] = private.get(page, 0) + 1
        self.cache.check(private, cached)
        used = {r.slot for r in self.running}
        assert len(used) == len(self.running), "two requests share a slot"
        assert not used & set(self.free_slots), "a running request's slot is free"
        assert len(used) + len(self.free_slots) == self.limits.max_running, "a slot leaked"
