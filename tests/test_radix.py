"""Page states of the prefix cache: allocation, publication, matching, eviction."""

from __future__ import annotations

import pytest

from outrider.daemon.scheduler.radix import OutOfPages, PrefixCache


def _check(cache: PrefixCache, private: dict[int, int], cached: dict[int, int]) -> None:
    cache.check(private, cached)


def test_publish_match_and_release() -> None:
    cache = PrefixCache(num_pages=9, page_size=2)
    pages = cache.allocate(3)
    assert sorted(pages) == [1, 2, 3] and cache.available() == 5
    tokens = [10, 11, 12, 13, 14]  # two whole pages and a partial one
    rest = cache.insert(tokens, pages)
    assert rest == pages[2:]
    cache.release(rest)
    _check(cache, {}, {})
    assert cache.available() == 8 and cache.used_pages() == 0

    hit = cache.match([10, 11, 12, 13, 99])
    assert hit == pages[:2]
    assert cache.used_pages() == 2 and cache.hits == 1 and cache.queries == 1
    _check(cache, {}, {pages[0]: 1, pages[1]: 1})
    # The hit never covers the last prompt token: 4 tokens match one page, not two.
    assert cache.match([10, 11, 12, 13]) == pages[:1]
    cache.release(hit)
    cache.release(pages[:1])
    _check(cache, {}, {})


def test_duplicate_publication_frees_the_copy() -> None:
    cache = PrefixCache(num_pages=6, page_size=2)
    first, second = cache.allocate(1), cache.allocate(1)
    cache.insert([1, 2], first)
    cache.insert([1, 2], second)
    assert second[0] in cache.free and first[0] in cache.nodes
    _check(cache, {}, {})


def test_eviction_takes_least_recently_used_leaves_and_spares_held_pages() -> None:
    cache = PrefixCache(num_pages=5, page_size=1)
    a = cache.allocate(2)
    cache.insert([1, 2], a)  # chain 1 -> 2
    b = cache.allocate(1)
    cache.insert([7], b)
    held = cache.match([1, 2, 3])  # holds pages of [1, 2]
    assert held == a
    assert cache.available() == 2  # one free page + the evictable [7]
    got = cache.allocate(2)
    assert b[0] in got and b[0] not in cache.nodes
    with pytest.raises(OutOfPages):
        cache.allocate(1)
    _check(cache, dict.fromkeys(got, 1), dict.fromkeys(a, 1))
    cache.release(held)
    cache.release(got)
    # Everything is evictable now: the chain goes leaf first, and all four pages come back.
    everything = cache.allocate(4)
    assert sorted(everything) == [1, 2, 3, 4] and not cache.nodes
    _check(cache, dict.fromkeys(everything, 1), {})


def test_check_catches_a_leak() -> None:
    cache = PrefixCache(num_pages=4, page_size=1)
    cache.allocate(1)
    with pytest.raises(AssertionError, match="in 0 states"):
        cache.check({}, {})


def test_a_parent_left_as_a_leaf_keeps_its_own_recency() -> None:
    cache = PrefixCache(num_pages=4, page_size=1)
    chain = cache.allocate(2)
    cache.insert([1, 2], chain)  # parent [1] -> child [1, 2]
    (other,) = cache.allocate(1)
    cache.insert([7], [other])
    cache.release(cache.match([1, 5]))  # touches the parent alone, after [7]
    assert cache.available() == 3 and not cache.free
    got = cache.allocate(2)
    # The child and [7] go; the parent, used last, stays cached.
    assert sorted(got) == sorted([chain[1], other])
    assert list(cache.nodes) == [chain[0]]
    _check(cache, dict.fromkeys(got, 1), {})


def test_requests_feeding_the_draft_match_only_pages_holding_its_kv() -> None:
    """Pages published without the draft's KV serve requests that do not feed it; a request
    that does stops before them, and its own pages take the place of the idle ones."""
    cache = PrefixCache(num_pages=9, page_size=2)
    unfed = cache.allocate(2)
    cache.release(cache.insert([1, 2, 3, 4], unfed, drafted=False))
    assert cache.match([1, 2, 3, 4, 5], drafted=True) == []
    held = cache.match([1, 2, 9])  # a request not feeding the draft holds the first page
    assert held == unfed[:1]
    fed = cache.allocate(2)
    assert cache.insert([1, 2, 3, 4], fed) == []
    # The first node is in use: it stays, and the copy is freed; the second is replaced.
    assert unfed[1] in cache.free and fed[0] in cache.free
    assert cache.match([1, 2, 3, 4, 5], drafted=True) == []
    _check(cache, {}, {unfed[0]: 1})
    cache.release(held)
    again = cache.allocate(1)
    cache.insert([1, 2], again)
    hit = cache.match([1, 2, 3, 4, 5], drafted=True)
    assert hit == [again[0], fed[1]] and unfed[0] in cache.free
    assert cache.match([1, 2, 3, 4, 5]) == hit  # any request may use drafted pages
    _check(cache, {}, {again[0]: 2, fed[1]: 2})


def test_shared_pages_stay_their_holders_and_take_the_drafts_kv_when_it_ends() -> None:
    """``share`` publishes a running request's whole pages without dropping its references:
    others match them at once; a chunk cached under another page ends the sharing; the
    holder's final ``insert`` marks its pages as holding the draft's KV."""
    cache = PrefixCache(num_pages=9, page_size=2)
    holder = cache.allocate(3)
    assert cache.share([10, 11, 12, 13, 14], holder, drafted=False) == 2
    _check(cache, {holder[2]: 1}, {holder[0]: 1, holder[1]: 1})
    assert cache.match([10, 11, 12, 13, 99], drafted=True) == []  # not holding the draft's KV
    other = cache.match([10, 11, 12, 13, 99])
    assert other == holder[:2]
    _check(cache, {holder[2]: 1}, {holder[0]: 2, holder[1]: 2})
    copy = cache.allocate(2)
    assert cache.share([10, 11, 50, 51], copy, drafted=True) == 0  # chunk [10, 11] is cached
    cache.release(copy)
    rest = cache.insert([10, 11, 12, 13, 14], holder, drafted=True)
    assert rest == holder[2:]
    cache.release(rest)
    assert cache.match([10, 11, 12, 13, 99], drafted=True) == holder[:2]
    cache.release(holder[:2])
    cache.release(other)
    _check(cache, {}, {})
