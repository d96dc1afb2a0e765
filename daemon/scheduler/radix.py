"""Page allocator and radix prefix cache of whole pages (host side).

Every page except the scratch page 0 is in exactly one state:

| state             | where it is                | refcount                    |
|-------------------|----------------------------|-----------------------------|
| free              | ``PrefixCache.free``       | 0                           |
| private           | one request's page list    | 1                           |
| cached, in use    | a tree node                | number of requests using it |
| cached, evictable | a tree node                | 0                           |

A tree node holds one page and the ``page_size`` token ids stored in it; a path from the root
spells a prefix. Pages are published when their request ends (``insert``), and a prompt's
whole pages as soon as the step that writes them is planned (``share``): its request keeps
them as cached pages it references. ``check`` verifies the table; the scheduler runs it
when idle and in tests.

A speculative engine whose draft keeps its own KV in the same pages marks each node
``drafted`` when its page holds the draft's KV too: a request that does not feed its draft
(scheduler/drafting.py) publishes pages holding the target's KV alone. A request that feeds its
draft matches drafted nodes only, and its own page takes the place of an undrafted node of the
same tokens that no request uses.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field


class OutOfPages(Exception):
    """The pool cannot supply the pages asked for, even after evicting the cache."""


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]
    page: int
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    last_use: int = 0
    drafted: bool = True  # the page holds the draft's KV as well as the target's


class PrefixCache:
    """Free list + radix tree over one paged pool (pages ``1 .. num_pages - 1``)."""

    def __init__(self, num_pages: int, page_size: int, enabled: bool = True) -> None:
        assert num_pages >= 2
        self.num_pages = num_pages
        self.page_size = page_size
        self.enabled = enabled
        self.free: list[int] = list(range(num_pages - 1, 0, -1))
        self.refcount = [0] * num_pages
        self.root = Node(key=(), page=-1, parent=None)
        self.nodes: dict[int, Node] = {}  # page -> node, for cached pages
        self.evictable = 0  # cached pages with refcount 0
        # Told of each cached page the cache lets go (window pages held for it go too).
        self.on_evict: Callable[[int], None] | None = None
        self._clock = 0
        self.queries = 0
        self.hits = 0

    # --- allocation ----------------------------------------------------------------------

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    def available(self) -> int:
        """Pages obtainable now: free plus evictable cached ones."""
        return len(self.free) + self.evictable

    def used_pages(self) -> int:
        """Pages some request holds (evictable cached pages count as available)."""
        return self.usable_pages - self.available()

    def allocate(self, count: int) -> list[int]:
        """``count`` private pages (refcount 1), evicting least recently used leaves."""
        if count > len(self.free):
            self._evict(count - len(self.free))
        if count > len(self.free):
            raise OutOfPages(f"need {count} pages, {len(self.free)} free")
        pages = [self.free.pop() for _ in range(count)]
        for page in pages:
            self.refcount[page] = 1
        return pages

    def release(self, pages: list[int]) -> None:
        """Drop one reference on each page; private pages return to the free list."""
        for page in pages:
            assert self.refcount[page] > 0, f"page {page} released twice"
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                if page in self.nodes:
                    self.evictable += 1
                else:
                    self.free.append(page)

    def _evict(self, want: int) -> None:
        """Free up to ``want`` cached pages, least recently used leaves first. A parent whose
        last child goes becomes a leaf and joins the heap at its own last use."""
        heap = [
            (n.last_use, n.page, n)
            for n in self.nodes.values()
            if not n.children and self.refcount[n.page] == 0
        ]
        heapq.heapify(heap)
        evicted = 0
        while heap and evicted < want:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            del self.nodes[node.page]
            self.free.append(node.page)
            self.evictable -= 1
            if self.on_evict is not None:
                self.on_evict(node.page)
            evicted += 1
            if parent is not self.root and not parent.children and self.refcount[parent.page] == 0:
                heapq.heappush(heap, (parent.last_use, parent.page, parent))

    # --- prefix matching -----------------------------------------------------------------

    def match(
        self, token_ids: list[int], *, record: bool = True, drafted: bool = False
    ) -> list[int]:
        """Cached pages spelling a prefix of ``token_ids``; each gets one more reference.

        The hit is capped at ``len(token_ids) - 1`` tokens (the last prompt token must run
        to produce logits) and is whole pages only; ``drafted``: it ends before the first
        undrafted node. ``record=False`` leaves the query/hit counters to the caller
        (``record_query``), e.g. for an admission that may back out.
        """
        pages = self._walk(token_ids, drafted) if self.enabled else []
        if record:
            self.record_query(hit=bool(pages))
        return pages

    def _walk(self, token_ids: list[int], drafted: bool) -> list[int]:
        ps = self.page_size
        limit = (len(token_ids) - 1) // ps
        node, pages = self.root, []
        self._clock += 1
        for i in range(limit):
            child = node.children.get(tuple(token_ids[i * ps : (i + 1) * ps]))
            if child is None or (drafted and not child.drafted):
                break
            child.last_use = self._clock
            pages.append(child.page)
            node = child
        for page in pages:
            if self.refcount[page] == 0:
                self.evictable -= 1
            self.refcount[page] += 1
        return pages

    def record_query(self, *, hit: bool) -> None:
        self.queries += 1
        self.hits += hit

    def insert(self, token_ids: list[int], pages: list[int], *, drafted: bool = True) -> list[int]:
        """Publish the whole pages of a finished prefix and drop the caller's references.

        ``pages[i]`` holds the KV of ``token_ids[i * page_size : (i + 1) * page_size]``;
        only ``len(token_ids) // page_size`` pages are published; ``drafted``: they hold the
        draft's KV too. Returns the pages the caller must still release (the partial tail and
        pages beyond ``token_ids``).
        """
        full = self._whole_pages(token_ids, pages)
        node = self.root
        self._clock += 1
        for i, page in enumerate(pages[:full]):
            child = self._child(node, token_ids, i, page, drafted)
            if child.page == page:  # new, or the caller's own shared while it ran (``share``)
                child.drafted = child.drafted or drafted
            elif drafted and not child.drafted and self.refcount[child.page] == 0:
                self._replace_page(child, page)
            node = child
        # Every published page loses the caller's reference; a page whose chunk was already
        # cached under another page is a duplicate and goes back to the free list.
        self.release(pages[:full])
        return pages[full:]

    def share(self, token_ids: list[int], pages: list[int], *, drafted: bool) -> int:
        """Publish the whole pages of a prefix whose holder keeps using them (a prompt whose
        KV a launched step writes): each becomes a cached page the holder references. Stops
        at a chunk already cached under another page (the holder's copy stays private).
        Returns how many leading ``pages`` are cached now."""
        full = self._whole_pages(token_ids, pages)
        node = self.root
        self._clock += 1
        for i, page in enumerate(pages[:full]):
            node = self._child(node, token_ids, i, page, drafted)
            if node.page != page:
                return i
        return full

    def _whole_pages(self, token_ids: list[int], pages: list[int]) -> int:
        """How many leading ``pages`` hold a whole page of ``token_ids`` (0: caching is off)."""
        return min(len(token_ids) // self.page_size, len(pages)) if self.enabled else 0

    def _child(self, node: Node, token_ids: list[int], i: int, page: int, drafted: bool) -> Node:
        """``node``'s child for page ``i`` of ``token_ids``, made to hold ``page`` if there
        is none; marked used now."""
        ps = self.page_size
        key = tuple(token_ids[i * ps : (i + 1) * ps])
        child = node.children.get(key)
        if child is None:
            child = Node(key=key, page=page, parent=node, drafted=drafted)
            node.children[key] = child
            self.nodes[page] = child
        child.last_use = self._clock
        return child

    def _replace_page(self, node: Node, page: int) -> None:
        """``page`` (the caller's, drafted) takes the place of idle undrafted ``node``'s."""
        old = node.page
        del self.nodes[old]
        self.evictable -= 1
        self.free.append(old)
        if self.on_evict is not None:
            self.on_evict(old)
        node.page, node.drafted = page, True
        self.nodes[page] = node

    # --- integrity -----------------------------------------------------------------------

    def check(self, private: dict[int, int], cached_refs: dict[int, int]) -> None:
        """Assert the state table. ``private``: page -> holders among requests' own pages;
        ``cached_refs``: page -> number of live requests referencing a cached page."""
        free = set(self.free)
        assert len(free) == len(self.free), "a page is on the free list twice"
        assert 0 not in free and 0 not in self.nodes and 0 not in private, "scratch page in use"
        for page in range(1, self.num_pages):
            states = (page in free) + (page in self.nodes) + (page in private)
            assert states == 1, f"page {page} is in {states} states"
            if page in free:
                assert self.refcount[page] == 0, f"free page {page} has references"
            elif page in private:
                assert private[page] == 1 == self.refcount[page], f"private page {page} shared"
            else:
                want = cached_refs.get(page, 0)
                assert self.refcount[page] == want, (
                    f"cached page {page}: refcount {self.refcount[page]}, {want} holders"
                )
        idle = sum(1 for page in self.nodes if self.refcount[page] == 0)
        assert idle == self.evictable, f"{idle} evictable pages, counted {self.evictable}"
        for page, node in self.nodes.items():
            assert node.page == page and node.parent is not None
            assert node.parent.children.get(node.key) is node, f"page {page} detached"
