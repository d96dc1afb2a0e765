"""The pages each running request holds: prefix hits, reservation at admission, growth, release
and publication to the prefix cache; and the page-table delta a plan carries to the device. A
model whose sliding layers keep only their windows has window pages beside (window_pages.py).

Only ``PageManager`` changes a request's ``pages``, ``num_cached_pages`` and
``allocated_len`` (request.py), so the three always agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from outrider.daemon.scheduler.radix import OutOfPages, PrefixCache
from outrider.daemon.scheduler.request import Request, WindowBackfill
from outrider.daemon.scheduler.window_pages import WindowPool


@dataclass
class PageDelta:
    """Page-table entries one plan writes on the device: entry ``writes[i]`` (flat,
    ``slot * max_pages_per_request + page index``) gets page ``values[i]``."""

    writes: list[int] = field(default_factory=list)
    values: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Reservation:
    """Pages for an admission: ``cached`` from a prefix hit (shared), then ``private``;
    ``backfill``: where window pages cut the hit short (window_pages.py)."""

    cached: list[int]
    private: list[int]
    backfill: WindowBackfill | None = None


class PageManager:
    def __init__(
        self,
        cache: PrefixCache,
        max_pages_per_request: int,
        prefix_margin_pages: int,
        window: WindowPool | None = None,
    ) -> None:
        """``window``: the sliding layers' window pages, where the model keeps only their
        windows (window_pages.py): a prefix hit counts up to a page whose window is held."""
        self.cache = cache
        self.page_size = cache.page_size
        self.max_pages_per_request = max_pages_per_request
        self.prefix_margin_pages = prefix_margin_pages
        self.window = window

    def pages_for(self, positions: int) -> int:
        return (positions + self.page_size - 1) // self.page_size

    def reserve(self, known: list[int], headroom: int, *, fed: bool) -> Reservation | None:
        """Pages for ``known`` plus one sampled token, reusing the longest cached prefix less
        its last ``prefix_margin_pages`` (given back: speculative drafts recompute them); a
        request that feeds its draft (``fed``) reuses pages holding the draft's KV only.
        None, holding nothing, when they would leave fewer than ``headroom`` pages."""
        # NOTE: an admission that backs out is retried next step: count the query only once
        # it succeeds.
        cached = self.cache.match(known, record=False, drafted=fed)
        keep = max(0, len(cached) - self.prefix_margin_pages)
        backfill = None
        if self.window is not None:  # up to a page whose window is held
            usable = self.window.usable_hit(cached[:keep])
            if usable < keep:
                backfill = self.window.backfill_for(cached[:keep])
            keep = usable
        if keep < len(cached):
            self.cache.release(cached[keep:])
            cached = cached[:keep]
        need = self.pages_for(len(known) + 1) - len(cached)
        if need + headroom > self.cache.available():
            self.cache.release(cached)
            return None
        private = self.cache.allocate(need)  # available() counts the evictable pages too
        self.cache.record_query(hit=bool(cached))
        return Reservation(cached, private, backfill)

    def assign(self, req: Request, reservation: Reservation, delta: PageDelta) -> None:
        """Hand ``reservation`` to ``req``, which holds a slot and no pages."""
        req.pages = reservation.cached + reservation.private
        req.num_cached_pages = len(reservation.cached)
        req.allocated_len = len(req.pages) * self.page_size
        self._write(req, 0, delta)
        if self.window is not None:
            req.window_backfill = reservation.backfill
            if reservation.cached:
                self.window.adopt(req)

    def add_page(self, req: Request, delta: PageDelta) -> bool:
        """One more private page for ``req``; False when the pool has none left."""
        try:
            (page,) = self.cache.allocate(1)
        except OutOfPages:
            return False
        req.pages.append(page)
        req.allocated_len += self.page_size
        self._write(req, len(req.pages) - 1, delta)
        return True

    def release(self, req: Request, *, publish: bool) -> None:
        """Drop ``req``'s pages; ``publish`` first puts its whole pages into the prefix cache
        (only positions whose KV a launched step writes, with known tokens), marked as holding
        the draft's KV where ``req`` fed its draft to the end."""
        pages = req.pages
        if publish:
            known = req.known_ids()
            written = known[: min(req.scheduled_len, len(known))]
            pages = self.cache.insert(written, pages, drafted=req.fed is not False)
        if self.window is not None:  # published first: the cache keeps what it caches
            if publish:  # ``insert`` hands back the pages after those it published
                self.window.publish(req, len(req.pages) - len(pages))
            self.window.release(req)
        self.cache.release(pages)
        req.pages, req.num_cached_pages, req.allocated_len = [], 0, 0

    def share_prompt(self, req: Request, *, drafted: bool) -> None:
        """Publish the whole pages of ``req``'s text that launched steps write (its prompt,
        once the chunk that ends it is planned): requests admitted from the next plan on
        reuse them while ``req`` still runs (``n`` choices of one prompt, a shared system
        prompt). ``drafted``: the pages may be marked as holding the draft's KV."""
        known = req.known_ids()
        written = known[: min(req.scheduled_len, len(known))]
        drafted = drafted and req.fed is not False
        shared = self.cache.share(written, req.pages, drafted=drafted)
        req.num_cached_pages = max(req.num_cached_pages, shared)
        if self.window is not None:
            self.window.publish(req, shared)

    def window_changes(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """The window-map entries changed and the window pages to copy since the last plan
        (``WindowPool.take_changes``); none without window pages."""
        return self.window.take_changes() if self.window is not None else ([], [], [], [])

    def _write(self, req: Request, first: int, delta: PageDelta) -> None:
        base = req.slot * self.max_pages_per_request
        for i in range(first, len(req.pages)):
            delta.writes.append(base + i)
            delta.values.append(req.pages[i])

    def check(self, requests: list[Request]) -> None:
        """Every page in exactly one state (radix.py); each request's pages cover what its
        launched steps write."""
        private: dict[int, int] = {}
        cached: dict[int, int] = {}
        for req in requests:
            assert req.allocated_len == len(req.pages) * self.page_size, f"rid {req.rid}"
            assert req.scheduled_len <= req.allocated_len, f"rid {req.rid}: pages too few"
            for page in req.pages[: req.num_cached_pages]:
                cached[page] = cached.get(page, 0) + 1
            for page in req.pages[req.num_cached_pages :]:
                private[page] = private.get(page, 0) + 1
        self.cache.check(private, cached)
        if self.window is not None:
            self.window.check(requests)
