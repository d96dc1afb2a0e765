"""The request table, the waiting queue and the running set, and the moves between them:
admission (a slot and the pages of the whole extend phase, leaving headroom for decoding rows),
retraction (back to the head of the queue) and release.

NOTE: pages and slots are released on the host at once, even while a step of the request is
in flight: every device write of a later step is queued after that step on the same stream,
so reuse is safe.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from outrider.daemon.scheduler.pages import PageDelta, PageManager
from outrider.daemon.scheduler.request import Request
from outrider.daemon.scheduler.slots import SlotTable
from outrider.plugins.api import StepShape

log = logging.getLogger("outrider.scheduler")


class Admission:
    def __init__(self, slots: SlotTable, pages: PageManager, shape: StepShape) -> None:
        self.slots = slots
        self.pages = pages
        self.requests: dict[int, Request] = {}  # every live request: waiting or running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the youngest is last
        # Pages one decode step may add to a row: its bound grows by max_commit, and the pages
        # must cover the bound plus the step's span.
        self._step_pages = pages.pages_for(shape.max_commit + shape.kv_span - 1)

    def add(self, req: Request) -> None:
        self.requests[req.rid] = req
        self.waiting.append(req)

    def admit_next(self, delta: PageDelta, feeds: Callable[[Request], bool]) -> Request | None:
        """Admit the head of the queue (its page-table entries go to ``delta``), or None when
        it must wait: no free slot, a step of it still in flight, or its pages do not fit.
        ``feeds``: whether a request feeds its draft (``Request.fed``), asked once."""
        if not self.waiting or not self.slots.has_free:
            return None
        req = self.waiting[0]
        if req.steps_in_flight:
            return None  # retracted with a step still in flight: its last token is unknown
        if req.fed is None:
            req.fed = feeds(req)
        known = req.known_ids()
        reservation = self.pages.reserve(known, self._headroom(), fed=req.fed)
        if reservation is None:
            return None
        self.waiting.popleft()
        self.slots.take(req)
        self.pages.assign(req, reservation, delta)
        req.scheduled_len = len(reservation.cached) * self.pages.page_size
        req.extend_end = len(known)
        req.scheduled_outputs = len(req.output_ids)
        if not req.admitted_once:
            req.admitted_once = True
            req.cached_len = req.scheduled_len
            req.admit_time = time.time()
        self.running.append(req)
        return req

    def _headroom(self) -> int:
        """Every decoding request may need fresh pages in the next step."""
        return self._step_pages * sum(1 for r in self.running if r.decoding)

    def retract(self, req: Request) -> None:
        """Back to the head of the waiting queue; its KV is recomputed on re-admission, which
        waits until no step of it is in flight (then the host knows all its tokens)."""
        log.info("retract rid=%d (%d tokens)", req.rid, len(req.known_ids()))
        self.release(req, publish=False)
        self.waiting.appendleft(req)

    def release(self, req: Request, *, publish: bool) -> None:
        """Out of the running set: its slot and pages go back (``publish``: see pages.py)."""
        self.pages.release(req, publish=publish)
        self.slots.give_back(req)
        self.running.remove(req)
        req.scheduled_len = req.extend_end = 0

    def remove(self, req: Request) -> None:
        """A finished request leaves the table, publishing its pages if it is running."""
        if req.slot >= 0:
            self.release(req, publish=True)
        elif req in self.waiting:
            self.waiting.remove(req)
        del self.requests[req.rid]

    def check(self) -> None:
        """Every live request is either waiting (holding nothing) or running."""
        for req in self.running:
            assert req.slot >= 0 and not req.finished, f"rid {req.rid} runs without a slot"
        for req in self.waiting:
            assert req.slot < 0 and not req.pages and not req.finished, f"rid {req.rid} waits"
        live = [*self.waiting, *self.running]
        assert len(live) == len(self.requests), "a request is in two places or in none"
        assert all(self.requests.get(r.rid) is r for r in live), "the request table is stale"
