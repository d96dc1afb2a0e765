"""The scheduler: what the engine loop and the daemon call to add and end requests, plan steps
and apply their results. It composes small parts, one concern each:

| part                | file            | concern                                                  |
|---------------------|-----------------|----------------------------------------------------------|
| ``Admission``       | admission.py    | requests, waiting queue, running set; admit, retract     |
| ``SlotTable``       | slots.py        | free slots, their owners, slots released since last plan |
| ``PageManager``     | pages.py        | requests' pages, prefix hits, page-table deltas          |
| ``WindowPool``      | window_pages.py | sliding layers' pages where only their windows are kept  |
| ``Planner``         | planner.py      | extend and decode plans, page growth with retraction     |
| ``DraftPolicy``     | drafting.py     | whether a decode batch drafts, a request feeds the draft |
| ``OutputProcessor`` | outputs.py      | step results, streaming, finish (the lifetime rules)     |
| ``SchedulerStats``  | counters.py     | finishes and speculative acceptance                      |

A request's counters and the KV index ranges they delimit: request.py. The sizes the parts
are built with: limits.py. Debug drills the planner runs on demand: drill.py.
"""

from __future__ import annotations

import logging
from collections import deque

from outrider.daemon.engine.plan import StepOutput
from outrider.daemon.grammar.state import GrammarState
from outrider.daemon.internal import Counters, RequestUpdate, TokenizedRequest
from outrider.daemon.scheduler.admission import Admission
from outrider.daemon.scheduler.counters import SchedulerStats
from outrider.daemon.scheduler.drafting import DraftPolicy, FixedDrafting
from outrider.daemon.scheduler.drill import RetractDrill
from outrider.daemon.scheduler.finish import Finish, FinishChecker
from outrider.daemon.scheduler.limits import SchedulerLimits
from outrider.daemon.scheduler.outputs import OutputProcessor
from outrider.daemon.scheduler.pages import PageManager
from outrider.daemon.scheduler.planner import Planned, Planner
from outrider.daemon.scheduler.radix import PrefixCache
from outrider.daemon.scheduler.request import Request
from outrider.daemon.scheduler.slots import SlotTable
from outrider.daemon.scheduler.window_pages import WindowPool
from outrider.plugins.api import StepShape

log = logging.getLogger("outrider.scheduler")


class Scheduler:
    def __init__(
        self,
        limits: SchedulerLimits,
        shape: StepShape,
        cache: PrefixCache,
        finish: FinishChecker,
        policy: DraftPolicy | None = None,
        drill: RetractDrill | None = None,
    ) -> None:
        """``shape``: the runner's step shape (``NO_DRAFT`` without speculation);
        ``policy``: whether a decode batch drafts (default: always, when speculative);
        ``drill`` (debug): retractions on a schedule (drill.py)."""
        self.cache = cache
        self.policy = policy if policy is not None else FixedDrafting(shape.width)
        self.slots = SlotTable(limits.max_running)
        window = None
        if limits.window_pages:
            window = WindowPool(
                limits.window_pages, limits.window, cache, limits.prefix_margin_pages
            )
        self.pages = PageManager(
            cache, limits.max_pages_per_request, limits.prefix_margin_pages, window
        )
        self.admission = Admission(self.slots, self.pages, shape)
        self.planner = Planner(
            limits, shape, self.admission, self.pages, self.slots, self.policy, drill
        )
        self.stats = SchedulerStats(shape)
        self.outputs = OutputProcessor(shape, finish, self.admission, self.stats, self.policy)

    @property
    def requests(self) -> dict[int, Request]:
        """Every live request by rid, waiting or running."""
        return self.admission.requests

    @property
    def waiting(self) -> deque[Request]:
        return self.admission.waiting

    @property
    def running(self) -> list[Request]:
        return self.admission.running

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- requests ------------------------------------------------------------------------

    def add(self, msg: TokenizedRequest, grammar: GrammarState | None = None) -> None:
        """Queue ``msg``; ``grammar``: its grammar's start (msg.grammar compiled)."""
        self.admission.add(Request.from_message(msg, grammar))

    def abort(self, rid: int, reason: str) -> None:
        """End a live request at once with ``abort``; unknown or finished rids are ignored."""
        req = self.requests.get(rid)
        if req is None or req.finished:
            return
        log.debug("abort rid=%d (%s)", rid, reason)
        self.outputs.finish_request(req, Finish("abort"))

    def fail_all(self, requests: list[Request], message: str) -> None:
        """A step raised: every request of its batch ends with ``internal``."""
        for req in requests:
            if not req.finished:
                self.outputs.fail(req, message)

    def use_policy(self, policy: DraftPolicy) -> None:
        """Decide from now on with ``policy`` whether decode batches draft."""
        self.policy = self.planner.policy = self.outputs.policy = policy

    def take_updates(self) -> list[RequestUpdate]:
        """Updates for the detokenizer since the last call, in order; one final per request."""
        return self.outputs.take_updates()

    # --- steps ---------------------------------------------------------------------------

    def schedule(self) -> Planned | None:
        """The next step to launch, None when there is nothing to run."""
        planned = self.planner.next_plan()
        if planned is not None:
            opens = planned.max_commit > 1
            for req in planned.requests:
                req.steps_in_flight += 1
                req.open_steps += opens
        return planned

    def process(self, planned: Planned, out: StepOutput) -> None:
        """Apply the results of a launched step (in launch order); the updates wait in
        ``take_updates``."""
        self.landed(planned)
        self.outputs.process(planned, out)

    def landed(self, planned: Planned) -> None:
        """A launched step is no longer in flight for its requests (processed or failed)."""
        opens = planned.max_commit > 1
        window = self.pages.window
        for req in planned.requests:
            req.steps_in_flight -= 1
            req.open_steps -= opens
            if window is not None:
                window.landed(req)

    # --- state ---------------------------------------------------------------------------

    def counters(self) -> Counters:
        return self.stats.snapshot(len(self.running), len(self.waiting), self.cache)

    def check_integrity(self) -> None:
        """Queues, slots and pages consistent; every page in exactly one state (radix.py)."""
        self.admission.check()
        self.slots.check(self.running)
        self.pages.check(self.running)
