"""Window pages: the K/V of a model's sliding layers kept inside their windows only
(unless ``--whole-sliding-kv``), in a pool of their own beside the page pool (the engine's
``KVCache.window_map``, plugins/device.py).

A request's page ``i`` (positions ``i * page_size ..``) holds a window page while a step of
the request may still read or write its positions in a sliding layer: from the first
position its oldest step not yet processed may read (that step's lowest possible start, less
the window and ``margin_pages`` more: ``window_floor``) to the last position a launched step
writes. So a request's window pages are one run of its page indices (``Request.window_from``,
``Request.window_pages``); those wholly before the floor go back as the request moves on,
before every plan. Each change to a page's window page (its window page, or 0: the scratch
page, where it has none) reaches the device with the next plan (``take_writes``), where the
device runs it after the steps already queued: a page given back is never read again by
them, and a window page handed to another request is written after they ran.

A step's lowest possible start (``Request.step_floors``, one entry a launched step, dropped
when it lands): a prompt chunk's exact start; a decoding row's start where no step of it is
in flight (its counters are exact then), else the lowest end of the one before it (a step
commits one token at least).

The prefix cache: the positions after a hit read, in the sliding layers, the window before
the hit's end, so a hit counts only up to a page whose window is held (``usable_hit``). A
request that publishes pages (a prompt once planned, a text at its end) leaves the cache
holding the window pages of the window before the end it published: the ends of published
texts keep their windows, and ``margin_pages`` more where a speculative engine recomputes a
hit's last pages. A window page goes back once no run and no cache entry holds it
(``holders``), or when a page is needed and none is free: then the least recently used one
the cache alone holds.

A hit cut short that way (``Request.window_backfill``: a shared system prompt before
different questions, where the cache kept the window of the first prompt's end only) has the
request compute that window again; the plan after the steps that wrote it gives the cache's
pages there window pages of their own, copied from the request's (``backfill``,
``take_changes``), so the next prompt on that prefix hits it.

Invariants (``check``): every window page but the scratch is free or bound to exactly one
page id, held by the runs that include it and by the cache where the cache holds it; the
host's map names each.
"""

from __future__ import annotations

from collections.abc import Sequence

from outrider.daemon.scheduler.radix import PrefixCache
from outrider.daemon.scheduler.request import Request, StepFloor, WindowBackfill


def window_floor(req: Request) -> int:
    """The lowest position a step of ``req`` not yet processed, or its next one, may start
    at."""
    if req.step_floors:
        return min(floor.start for floor in req.step_floors)
    return req.scheduled_len


class WindowPool:
    """Free list of window pages ``1 .. pages - 1`` (0 is the scratch page), the page ids
    they are bound to and who holds each; told by ``cache`` of the pages it lets go."""

    def __init__(self, pages: int, window: int, cache: PrefixCache, margin_pages: int = 0) -> None:
        assert pages >= 2 and window >= 1
        self.pages = pages
        self.window = window  # the widest sliding layer's
        self.page_size = cache.page_size
        self.margin_pages = margin_pages  # kept behind a window: a hit's recomputed pages
        self.cache = cache
        cache.on_evict = self.evicted
        self.free: list[int] = list(range(pages - 1, 0, -1))
        self.held: dict[int, int] = {}  # page id -> its window page
        self.holders: dict[int, int] = {}  # page id -> the runs including it, the cache's hold
        self.cached: set[int] = set()  # page ids whose window page the cache holds
        self._writes: dict[int, int] = {}  # map entries changed since the last plan
        self._copies: list[tuple[int, int]] = []  # window pages to copy before the next step

    def step(self, req: Request, start: int, end: int, writes_to: int) -> None:
        """A step of ``req`` is planned: its lowest possible ``start`` and ``end``, and the
        positions up to which launched steps write (``writes_to``, exclusive): each page up
        to there joins its run."""
        if not req.step_floors and not req.window_pages:
            req.window_from = self._behind(start)
        req.step_floors.append(StepFloor(start, end))
        covered = -(-writes_to // self.page_size)
        assert covered <= len(req.pages), f"rid {req.rid}: window pages past its pages"
        while req.window_from + len(req.window_pages) < covered:
            page = req.pages[req.window_from + len(req.window_pages)]
            req.window_pages.append(self._hold(page))

    def landed(self, req: Request) -> None:
        """The oldest launched step of ``req`` was processed (or failed)."""
        req.step_floors.popleft()

    def give_back_behind(self, req: Request) -> None:
        """Window pages of ``req``'s pages wholly before the first position its steps may
        read leave its run."""
        behind = self._behind(window_floor(req))
        while req.window_pages and req.window_from < behind:
            req.window_pages.pop(0)
            self._drop(req.pages[req.window_from])
            req.window_from += 1
        if not req.window_pages:
            req.window_from = max(req.window_from, behind)

    def usable_hit(self, pages: Sequence[int]) -> int:
        """How many leading ``pages`` of a prefix hit to keep: up to the last page whose
        window before the hit's end is held (0: none)."""
        for end in range(len(pages), 0, -1):
            first = self._window_start(end * self.page_size)
            if all(page in self.held for page in pages[first:end]):
                return end
        return 0

    def backfill_for(self, pages: Sequence[int]) -> WindowBackfill:
        """What a request admitted with a hit on ``pages`` cut short gives the cache once it
        has computed their window again (``backfill``)."""
        first = self._window_start(len(pages) * self.page_size)
        return WindowBackfill(first, len(pages), tuple(self.cache.nodes[p] for p in pages[first:]))

    def backfill(self, req: Request) -> None:
        """Once the steps launched before this plan have written ``req``'s window before its
        ``window_backfill``'s end, and while its run holds it: the cache's pages there that
        are still cached and hold no window get window pages of their own, copied from the
        run's before the next step (opportunistic: none where the free ones are too few)."""
        fill = req.window_backfill
        if fill is None:
            return
        ahead = req.window_from + len(req.window_pages)
        if req.window_from > fill.first:  # the run has passed it
            req.window_backfill = None
            return
        if req.scheduled_len < fill.end * self.page_size or ahead < fill.end:
            return
        req.window_backfill = None
        if len(self.free) < fill.end - fill.first:
            return
        for index, node in enumerate(fill.nodes, fill.first):
            page = node.page
            if self.cache.nodes.get(page) is not node or page in self.held:
                continue
            window_page = self._hold(page)  # a free one: none of them is evicted
            self.cached.add(page)
            self._copies.append((req.window_pages[index - req.window_from], window_page))

    def adopt(self, req: Request) -> None:
        """``req`` was admitted with ``req.num_cached_pages`` cached pages (``usable_hit``):
        the window before their end joins its run."""
        end = req.num_cached_pages
        req.window_from = self._window_start(end * self.page_size)
        req.window_pages = [self.held[page] for page in req.pages[req.window_from : end]]
        for page in req.pages[req.window_from : end]:
            self.holders[page] += 1

    def publish(self, req: Request, end: int) -> None:
        """``req`` published its first ``end`` pages: the cache holds the window pages of
        those of its run that a hit there reads (the window before ``end``, ``margin_pages``
        more) and that the cache caches now."""
        first = max(req.window_from, self._behind(end * self.page_size))
        last = min(end, req.window_from + len(req.window_pages))
        for page in req.pages[first:last]:
            if page in self.cache.nodes and page not in self.cached:
                self.cached.add(page)
                self.holders[page] += 1

    def evicted(self, page: int) -> None:
        """The cache let page id ``page`` go (its K/V are gone with it)."""
        if page in self.cached:
            self.cached.discard(page)
            self._drop(page)

    def release(self, req: Request) -> None:
        """Every window page of ``req``'s run leaves it (its pages go back too)."""
        for offset in range(len(req.window_pages)):
            self._drop(req.pages[req.window_from + offset])
        req.window_pages, req.window_from = [], 0

    def take_changes(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """What changed since the last call: the map's entries (page ids, their window
        pages) and the window pages to copy (sources, destinations)."""
        writes, self._writes = self._writes, {}
        copies, self._copies = self._copies, []
        return list(writes), list(writes.values()), [s for s, _ in copies], [d for _, d in copies]

    def check(self, requests: list[Request]) -> None:
        """The module's invariants over the running ``requests``."""
        runs: dict[int, int] = {}
        for req in requests:
            for offset, window_page in enumerate(req.window_pages):
                page = req.pages[req.window_from + offset]
                assert self.held.get(page) == window_page, f"rid {req.rid}: page {page}"
                runs[page] = runs.get(page, 0) + 1
        assert self.cached <= set(self.cache.nodes), "held for a page the cache dropped"
        for page in self.held:
            want = runs.get(page, 0) + (page in self.cached)
            assert self.holders[page] == want > 0, f"page {page}: {self.holders[page]} holders"
        assert set(self.holders) == set(self.held), "holders of pages without window pages"
        bound = list(self.held.values())
        assert sorted(self.free + bound) == list(range(1, self.pages)), "window pages lost"

    def _window_start(self, start: int) -> int:
        """Page indices wholly before the first position a query at ``start`` reads."""
        return max(0, start - self.window + 1) // self.page_size

    def _behind(self, start: int) -> int:
        """``_window_start``, less ``margin_pages``: a run keeps those too."""
        return max(0, self._window_start(start) - self.margin_pages)

    def _hold(self, page: int) -> int:
        """One more holder of ``page``'s window page, bound now where it has none."""
        if page in self.held:
            self.holders[page] += 1
            return self.held[page]
        if not self.free:
            self._evict_one()
        window_page = self.free.pop()
        self.held[page], self.holders[page] = window_page, 1
        self._writes[page] = window_page
        return window_page

    def _drop(self, page: int) -> None:
        """One holder less of ``page``'s window page; the last one gives it back."""
        self.holders[page] -= 1
        if self.holders[page] == 0:
            del self.holders[page]
            self.free.append(self.held.pop(page))
            self._writes[page] = 0

    def _evict_one(self) -> None:
        """The window page that only the cache holds, least recently used, goes back."""
        idle = [page for page in self.cached if self.holders[page] == 1]
        if not idle:
            raise RuntimeError("the window page pool is exhausted (its size is derived wrong)")
        page = min(idle, key=lambda p: self.cache.nodes[p].last_use)
        self.cached.discard(page)
        self._drop(page)
