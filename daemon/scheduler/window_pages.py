"""Window pages: the K/V of a model's sliding layers kept inside their windows only
(``--windowed-kv``), in a pool of their own beside the page pool (the engine's
``KVCache.window_map``, plugins/device.py).

A request's page ``i`` (positions ``i * page_size ..``) holds a window page while a step of
the request may still read or write its positions in a sliding layer: from the first
position its oldest step not yet processed may read (that step's lowest possible start, less
the window: ``window_floor``) to the last position a launched step writes. So a request's
window pages are one run of its page indices (``Request.window_from``,
``Request.window_pages``); those wholly before the floor go back as the request moves on,
before every plan. Each change to a page's window page (its window page, or 0: the scratch
page, where it has none) reaches the device with the next plan (``take_writes``), where the
device runs it after the steps already queued: a page given back is never read again by
them, and a window page handed to another request is written after they ran.

A step's lowest possible start (``Request.step_floors``, one entry a launched step, dropped
when it lands): a prompt chunk's exact start; a decoding row's start where no step of it is
in flight (its counters are exact then), else the lowest end of the one before it (a step
commits one token at least). The prefix cache is off with window pages: a hit would need
the window pages before its end, which a finished request has given back.

Invariants (``check``): every window page but the scratch is free or held by exactly one
request, and the host's map names each held page's.
"""

from __future__ import annotations

from outrider.daemon.scheduler.request import Request, StepFloor


def window_floor(req: Request) -> int:
    """The lowest position a step of ``req`` not yet processed, or its next one, may start
    at."""
    if req.step_floors:
        return min(floor.start for floor in req.step_floors)
    return req.scheduled_len


class WindowPool:
    """Free list of window pages ``1 .. pages - 1`` (0 is the scratch page) and each running
    request's run of them."""

    def __init__(self, pages: int, window: int, page_size: int) -> None:
        assert pages >= 2 and window >= 1
        self.pages = pages
        self.window = window  # the widest sliding layer's
        self.page_size = page_size
        self.free: list[int] = list(range(pages - 1, 0, -1))
        self.held: dict[int, int] = {}  # page id -> its window page
        self._writes: dict[int, int] = {}  # map entries changed since the last plan

    def step(self, req: Request, start: int, end: int, writes_to: int) -> None:
        """A step of ``req`` is planned: its lowest possible ``start`` and ``end``, and the
        positions up to which launched steps write (``writes_to``, exclusive): each page up
        to there gets a window page."""
        if not req.step_floors and not req.window_pages:
            req.window_from = self._behind(start)
        req.step_floors.append(StepFloor(start, end))
        covered = -(-writes_to // self.page_size)
        assert covered <= len(req.pages), f"rid {req.rid}: window pages past its pages"
        while req.window_from + len(req.window_pages) < covered:
            page = req.pages[req.window_from + len(req.window_pages)]
            if not self.free:
                raise RuntimeError("the window page pool is exhausted (its size is derived wrong)")
            window_page = self.free.pop()
            req.window_pages.append(window_page)
            self._set(page, window_page)

    def landed(self, req: Request) -> None:
        """The oldest launched step of ``req`` was processed (or failed)."""
        req.step_floors.popleft()

    def give_back_behind(self, req: Request) -> None:
        """Window pages of ``req``'s pages wholly before the first position its steps may
        read go back to the pool."""
        behind = self._behind(window_floor(req))
        while req.window_pages and req.window_from < behind:
            self._give_back(req.pages[req.window_from], req.window_pages.pop(0))
            req.window_from += 1
        if not req.window_pages:
            req.window_from = max(req.window_from, behind)

    def release(self, req: Request) -> None:
        """Every window page of ``req`` back (its pages go back too)."""
        for offset, window_page in enumerate(req.window_pages):
            self._give_back(req.pages[req.window_from + offset], window_page)
        req.window_pages, req.window_from = [], 0

    def take_writes(self) -> tuple[list[int], list[int]]:
        """The map entries changed since the last call: (page ids, their window pages)."""
        writes, self._writes = self._writes, {}
        return list(writes), list(writes.values())

    def check(self, requests: list[Request]) -> None:
        """The module's invariants over the running ``requests``."""
        held: dict[int, int] = {}
        for req in requests:
            for offset, window_page in enumerate(req.window_pages):
                page = req.pages[req.window_from + offset]
                assert self.held.get(page) == window_page, f"rid {req.rid}: page {page}"
                assert window_page not in held, f"window page {window_page} held twice"
                held[window_page] = page
        assert len(held) == len(self.held), "a window page held by no running request"
        assert sorted(self.free + list(held)) == list(range(1, self.pages)), "pages lost"

    def _behind(self, start: int) -> int:
        """Page indices wholly before the first position a query at ``start`` reads."""
        return max(0, start - self.window + 1) // self.page_size

    def _give_back(self, page: int, window_page: int) -> None:
        self.free.append(window_page)
        del self.held[page]
        self._writes[page] = 0

    def _set(self, page: int, window_page: int) -> None:
        self.held[page] = window_page
        self._writes[page] = window_page
