"""The scheduler alone, driven with fake step outputs and no model: exact plans, exact updates,
and the integrity check (no leaked page or slot) after every step."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgspec
import pytest

from outrider.daemon.engine.plan import SlotParams, StepOutput
from outrider.daemon.internal import FinishInfo, RequestUpdate, TokenizedRequest
from outrider.daemon.scheduler.drill import RetractDrill
from outrider.daemon.scheduler.finish import FinishChecker
from outrider.daemon.scheduler.limits import SchedulerLimits
from outrider.daemon.scheduler.planner import Planned
from outrider.daemon.scheduler.radix import PrefixCache
from outrider.daemon.scheduler.scheduler import Scheduler
from outrider.plugins.api import NO_DRAFT, StepShape
from outrider.plugins.sampling_spec import SamplingSpec
from outrider.protocol.messages import FinishReason, Usage

PAGE = 4
MAX_PAGES = 8  # page-table entries per slot: entry = slot * MAX_PAGES + page index
EOS = 99
SPEC = StepShape(width=3, depth=2, topk=1)  # a chain: verifies 3 tokens, commits 1 to 3
WINDOW = 4  # the sliding layers' window, where window pages are kept


def make(
    *,
    pages: int = 16,
    running: int = 4,
    chunk: int = 64,
    shape: StepShape = NO_DRAFT,
    margin: int = 0,
    retract_every: int = 0,
    mixed: bool = False,
    drafting_rows: tuple[tuple[int, int], ...] = (),
    prompt_run: int = 0,
    window_pages: int = 0,
) -> Scheduler:
    """A scheduler over ``pages`` usable pages of ``PAGE`` tokens (``mixed``: decoding rows
    ride prompt batches; ``drafting_rows``, ``prompt_run``: ``SchedulerLimits``'
    ``drafting_rows`` and ``max_prompt_run``; ``window_pages``: a pool of window pages for
    sliding layers of ``WINDOW`` positions)."""
    limits = SchedulerLimits(
        running, MAX_PAGES, chunk, 32, prefix_margin_pages=margin, mixed_batches=mixed,
        drafting_rows=drafting_rows, max_prompt_run=prompt_run, window_pages=window_pages,
        window=WINDOW if window_pages else 0,
    )  # fmt: skip
    finish = FinishChecker(frozenset({EOS}), 32, None)
    drill = RetractDrill(retract_every) if retract_every else None
    return Scheduler(limits, shape, PrefixCache(pages + 1, PAGE), finish, drill=drill)


def request(rid: int, prompt: list[int], max_new: int = 8) -> TokenizedRequest:
    return TokenizedRequest(
        rid=rid,
        request_id=f"r{rid}",
        input_ids=prompt,
        sampling=SamplingSpec(),
        max_new_tokens=max_new,
        stop=[],
        stop_token_ids=[],
        ignore_eos=False,
        stream=False,
        want_logprobs=False,
        arrival=time.time(),
    )


def ids(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


def out(*rows: list[int]) -> StepOutput:
    """The tokens each sampled row committed (no logprobs asked for)."""
    return StepOutput([*rows], [[0.0] * len(r) for r in rows], [], [])


def planned(s: Scheduler) -> Planned:
    p = s.schedule()
    assert p is not None
    return p


def step(s: Scheduler, *rows: list[int]) -> Planned:
    """Serial order: plan, process ``rows`` as its results, check integrity."""
    p = planned(s)
    s.process(p, out(*rows))
    s.check_integrity()
    return p


def final(
    rid: int,
    tokens: list[int],
    reason: FinishReason,
    *,
    prompt: int,
    cached: int = 0,
    drafts: int = 0,
    accepted: int = 0,
) -> RequestUpdate:
    """The final update of a request that streams nothing: all its tokens, finish, usage."""
    usage = Usage(prompt, len(tokens), cached, drafts, accepted)
    info = FinishInfo(reason, EOS if reason == "stop" else None, usage)
    return RequestUpdate(rid, tokens, finish=info)


def updates(s: Scheduler) -> list[RequestUpdate]:
    """``s``'s updates, each final one's first-token time checked (set exactly when a token
    was committed) and then zeroed, so that updates compare by value."""
    taken = s.take_updates()
    for update in taken:
        if update.finish is not None:
            committed = update.finish.usage.completion_tokens > 0
            assert (update.finish.first_token_at > 0.0) == committed
            update.finish = msgspec.structs.replace(update.finish, first_token_at=0.0)
    return taken


def rows(p: Planned) -> tuple[str, list[int], list[int], list[int]]:
    return p.plan.kind, p.plan.slots, p.plan.starts, p.plan.q_lens


def waiting(s: Scheduler) -> list[int]:
    return [r.rid for r in s.waiting]


# --- extend and decode ---------------------------------------------------------------------


def test_a_prompt_runs_in_one_extend_then_decodes_and_grows_a_page() -> None:
    s = make()
    s.add(request(1, ids(10, 6), max_new=4))
    p = step(s, [20])
    assert rows(p) == ("extend", [0], [0], [6]) and p.plan.input_ids == ids(10, 6)
    assert (p.plan.sample_rows, p.plan.sample_positions, p.plan.next_ids) == ([0], [0], [0])
    assert (p.plan.page_writes, p.plan.page_values) == ([0, 1], [1, 2])
    assert p.plan.slot_params == [SlotParams(0, SamplingSpec(0.0, 1.0, 0, 0))]
    assert [rows(step(s, [t])) for t in (21, 22)] == [
        ("decode", [0], [6], [1]),
        ("decode", [0], [7], [1]),
    ]
    p = step(s, [23])
    assert rows(p) == ("decode", [0], [8], [1]) and p.plan.page_writes == [2]
    assert updates(s) == [final(1, [20, 21, 22, 23], "length", prompt=6)]
    assert s.schedule() is None and not s.has_work and s.counters().kv_used_tokens == 0


def test_chunked_prefill_shares_the_token_budget() -> None:
    s = make(chunk=8)
    s.add(request(1, ids(10, 10)))
    s.add(request(2, ids(30, 9)))
    p = step(s)
    assert rows(p) == ("extend", [0], [0], [8]) and p.plan.sample_rows == []
    assert p.plan.next_ids == [18] and waiting(s) == [2]
    p = step(s, [20])
    assert rows(p) == ("extend", [0, 1], [8, 0], [2, 6])
    assert p.plan.input_ids == [18, 19, *ids(30, 6)] and p.plan.next_ids == [0, 36]
    assert (p.plan.sample_rows, p.plan.sample_positions) == ([0], [0])
    assert (p.plan.page_writes, p.plan.page_values) == ([8, 9, 10], [4, 5, 6])
    p = step(s, [40])
    assert rows(p) == ("extend", [1], [6], [3]) and p.plan.next_ids == [0]
    assert rows(step(s, [21], [41])) == ("decode", [0, 1], [10, 9], [1, 1])


@pytest.mark.parametrize(
    ("prompt_run", "decoded", "kinds"),
    [(0, 1, "eeeeedd"), (2, 1, "eedeede"), (1, 1, "ededede"), (1, 0, "eeeeedd")],
)
def test_a_decode_batch_goes_first_after_the_longest_prompt_run(
    prompt_run: int, decoded: int, kinds: str
) -> None:
    """A 20-token prompt in chunks of 4 arrives while a request is part-way through decoding
    (``decoded`` decode steps taken): its five prompt batches run back to back, or
    ``max_prompt_run`` at a time with a decode batch between. Arriving right after the first
    request's prompt (no decode step yet: as a wave of requests admitted together), they run
    back to back whatever the limit."""
    s = make(chunk=4, prompt_run=prompt_run)
    s.add(request(1, ids(10, 3), max_new=16))
    step(s, [20])
    for token in range(decoded):
        step(s, [21 + token])
    s.add(request(2, ids(30, 20)))
    launched = ""
    for _ in range(7):
        p = planned(s)
        s.process(p, out(*([50 + i] for i in range(len(p.plan.sample_rows)))))
        s.check_integrity()
        launched += p.plan.kind[0]
    assert launched == kinds


@pytest.mark.parametrize(
    ("sampling", "cuts"),
    [
        (SamplingSpec(), False),
        (SamplingSpec(0.0, top_p=0.5, top_k=3), False),  # greedy: never sorts
        (SamplingSpec(0.8), False),
        (SamplingSpec(0.8, top_p=0.9), True),
        (SamplingSpec(0.8, top_k=40), True),
    ],
)
def test_a_plan_cuts_where_a_sampled_row_cuts(sampling: SamplingSpec, cuts: bool) -> None:
    """``StepPlan.cuts``: a sampled row of the batch cuts by top-k or top-p (the step sorts
    its rows' vocabularies only then), in the prompt batch and the decode batch alike."""
    s = make()
    s.add(msgspec.structs.replace(request(1, ids(10, 5)), sampling=sampling))
    s.add(request(2, ids(30, 5)))  # greedy beside it
    assert step(s, [20], [40]).plan.cuts == cuts
    assert step(s, [21], [41]).plan.cuts == cuts


def test_decoding_rows_ride_prompt_chunks_within_the_token_budget() -> None:
    """With mixed batches, a decoding row rides each prompt batch: one token (a placeholder
    for the relay's root) at its exact position, sampled at its next output index, taking a
    token of the budget; once no prompt is left, decode batches as before."""
    s = make(chunk=8, mixed=True)
    s.add(request(1, ids(10, 6), max_new=4))
    s.add(request(2, ids(30, 13), max_new=2))
    p = step(s, [20])
    assert rows(p) == ("extend", [0, 1], [0, 0], [6, 2]) and p.plan.relay_rows == []
    p = step(s, [21])
    assert rows(p) == ("extend", [1, 0], [2, 6], [7, 1])
    assert p.plan.input_ids == [*ids(32, 7), 0] and p.plan.relay_rows == [1]
    assert (p.plan.sample_rows, p.plan.sample_positions, p.plan.next_ids) == ([1], [1], [39, 0])
    p = step(s, [40], [22])
    assert rows(p) == ("extend", [1, 0], [9, 7], [4, 1]) and p.plan.relay_rows == [1]
    assert (p.plan.sample_rows, p.plan.sample_positions) == ([0, 1], [0, 2])
    assert rows(step(s, [23], [41])) == ("decode", [0, 1], [8, 13], [1, 1])
    assert updates(s) == [
        final(1, [20, 21, 22, 23], "length", prompt=6),
        final(2, [40, 41], "length", prompt=13),
    ]


def test_decoding_rows_do_not_ride_without_mixed_batches_or_past_the_budget() -> None:
    """Without mixed batches a prompt batch runs alone; with them, rows that would fill the
    whole budget do not ride (the prompt keeps its batch)."""
    for mixed in (False, True):
        s = make(chunk=2, mixed=mixed, running=4)
        s.add(request(1, ids(10, 1), max_new=4))
        s.add(request(2, ids(30, 1), max_new=4))
        assert rows(step(s, [20], [21])) == ("extend", [0, 1], [0, 0], [1, 1])
        s.add(request(3, ids(50, 2)))
        p = step(s, [40])
        assert rows(p) == ("extend", [2], [0], [2]) and p.plan.relay_rows == []
        assert rows(step(s, [22], [23], [41])) == ("decode", [0, 1, 2], [1, 1, 2], [1, 1, 1])


# --- admission -----------------------------------------------------------------------------


def test_a_request_that_does_not_fit_waits() -> None:
    s = make(pages=5)
    s.add(request(1, ids(10, 6), max_new=1))  # 2 pages
    s.add(request(2, ids(30, 13)))  # 4 pages: only 3 left
    assert rows(step(s, [20])) == ("extend", [0], [0], [6]) and waiting(s) == [2]
    p = step(s, [40])  # request 1 finished: its pages are back (one of them cached)
    assert rows(p) == ("extend", [0], [0], [13]) and p.plan.released_slots == [0]
    assert p.plan.page_values == [2, 3, 4, 5]


def test_admission_leaves_headroom_for_decoding_rows() -> None:
    s = make(pages=5)
    s.add(request(1, ids(10, 6), max_new=2))
    step(s, [20])
    s.add(request(2, ids(30, 10)))  # 3 pages fit, but request 1 may need one next step
    assert s.counters().kv_used_tokens == 2 * PAGE
    assert rows(step(s, [21])) == ("decode", [0], [6], [1]) and waiting(s) == [2]
    assert rows(step(s, [40])) == ("extend", [0], [0], [10])


# --- prefix cache --------------------------------------------------------------------------


def test_a_prefix_hit_reuses_the_cached_pages() -> None:
    s = make()
    s.add(request(1, ids(10, 9), max_new=1))
    step(s, [20])  # publishes 2 whole pages: tokens 10 .. 17
    updates(s)
    s.add(request(2, [*ids(10, 8), 50, 51], max_new=1))
    p = step(s, [21])
    assert rows(p) == ("extend", [0], [8], [2]) and p.plan.input_ids == [50, 51]
    assert p.plan.page_values == [1, 2, 3]
    assert updates(s) == [final(2, [21], "length", prompt=10, cached=8)]
    assert (s.counters().prefix_cache_queries, s.counters().prefix_cache_hits) == (2, 1)


def test_a_running_requests_prompt_is_shared_with_later_admissions() -> None:
    """A prompt's whole pages are published once the chunk that ends it is planned: a request
    admitted after reads them while the first still decodes; one admitted in the same plan
    does not (they are written by that plan)."""
    s = make()
    s.add(request(1, ids(10, 9), max_new=4))
    s.add(request(3, ids(10, 9), max_new=4))
    p = step(s, [20], [30])  # both in one plan: each computes the prompt
    assert rows(p) == ("extend", [0, 1], [0, 0], [9, 9])
    s.add(request(2, [*ids(10, 8), 50], max_new=2))
    p = step(s, [21])
    assert rows(p) == ("extend", [2], [8], [1]) and p.plan.page_values[:2] == [1, 2]
    assert [r.rid for r in s.admission.running] == [1, 3, 2]
    for _ in range(3):
        step(s, [22], [32], [52])
    finals = {u.rid: u for u in updates(s) if u.is_final}
    assert finals[2].finish is not None and finals[2].finish.usage.cached_tokens == 8
    s.check_integrity()


def test_prefix_margin_pages_are_given_back() -> None:
    s = make(margin=1)
    s.add(request(1, ids(10, 9), max_new=1))
    step(s, [20])
    updates(s)
    s.add(request(2, [*ids(10, 8), 50, 51], max_new=1))
    p = step(s, [21])  # the second cached page stays cached, unused
    assert rows(p) == ("extend", [0], [4], [6]) and p.plan.page_values == [1, 3, 4]
    assert updates(s) == [final(2, [21], "length", prompt=10, cached=4)]


# --- retraction ----------------------------------------------------------------------------


def test_retraction_takes_the_youngest_and_keeps_its_tokens() -> None:
    s = make(pages=4)
    s.add(request(1, ids(10, 7), max_new=4))
    s.add(request(2, ids(30, 7), max_new=3))
    step(s, [20], [40])
    step(s, [21], [41])
    p = step(s, [22])  # request 1 needs a page: request 2 goes back to the queue
    assert rows(p) == ("decode", [0], [8], [1]) and p.plan.page_values == [4]
    assert waiting(s) == [2] and s.requests[2].output_ids == [40, 41]
    assert rows(step(s, [23])) == ("decode", [0], [9], [1]) and waiting(s) == [2]
    # Request 1 finished: request 2 recomputes its tokens past its prompt's whole page, which
    # its first prefill published and the pool kept.
    p = step(s, [42])
    assert rows(p) == ("extend", [0], [4], [5]) and p.plan.input_ids == [*ids(30, 7)[4:], 40, 41]
    assert p.plan.sample_positions == [2]
    assert updates(s) == [
        final(1, [20, 21, 22, 23], "length", prompt=7),
        final(2, [40, 41, 42], "length", prompt=7),
    ]


def test_a_retracted_request_waits_for_its_step_in_flight() -> None:
    s = make(retract_every=3)
    s.add(request(1, ids(10, 6)))
    s.add(request(2, ids(30, 6)))
    p1 = planned(s)
    p2 = planned(s)  # overlap: both decode before the extend is processed
    assert rows(p2) == ("decode", [0, 1], [6, 6], [1, 1])
    s.process(p1, out([20], [40]))
    p3 = planned(s)  # retracts request 2, whose decode step is still in flight
    assert rows(p3) == ("decode", [0], [7], [1]) and waiting(s) == [2]
    s.process(p2, out([21], [41]))  # the retracted row's token is still appended
    p4 = planned(s)  # its prompt's whole page is cached (published at its prefill)
    assert rows(p4) == ("extend", [1], [4], [4]) and p4.plan.input_ids == [*ids(30, 6)[4:], 40, 41]
    assert p3.plan.released_slots == [1] and p4.plan.sample_positions == [2]
    s.check_integrity()


# --- window pages --------------------------------------------------------------------------


def test_window_pages_follow_the_window_and_their_map_writes_ride_the_plans() -> None:
    """A prompt of 12 in chunks of 8: each chunk's pages get window pages; those wholly
    behind the window of 4 go back as the request goes on (their map entries 0), and the
    last one back is the next one out; at the finish every one goes back but those the
    prefix cache keeps: the windows before the two ends it published (the prompt's at 12,
    the text's at 16), which a hit there reads."""
    s = make(chunk=8, window_pages=6)
    s.add(request(1, ids(10, 12), max_new=8))
    first = step(s)  # positions 0..7: pages 0, 1
    pages = s.running[0].pages
    assert (first.plan.window_writes, first.plan.window_values) == (pages[:2], [1, 2])
    second = step(s, [20])  # 8..11, reading from 5: page 0 back, page 2 takes its own
    assert (second.plan.window_writes, second.plan.window_values) == ([pages[0], pages[2]], [0, 1])
    third = step(s, [21])  # the root at 12 reads from 9: page 1 back, page 3 takes its own
    assert (third.plan.window_writes, third.plan.window_values) == ([pages[1], pages[3]], [0, 2])
    for token in range(22, 28):
        step(s, [token])  # the last one finishes the request (8 tokens)
    assert s.running == [] and updates(s)[-1].finish is not None
    window = s.pages.window
    assert window is not None and window.cached == {pages[2], pages[3]}
    assert (len(window.free), window.holders) == (3, {pages[2]: 1, pages[3]: 1})


def test_window_pages_cover_what_a_step_in_flight_may_read() -> None:
    """Two drafting steps in flight (overlap): the second starts where the first's commit
    leaves it, between one and three positions on; until it is processed the window pages
    from three positions before its lowest start stay."""
    s = make(shape=SPEC, window_pages=12)
    s.add(request(1, ids(10, 12), max_new=8))
    step(s, [20])  # the prompt: positions 0..11; the root at 12
    req = s.running[0]
    a = planned(s)  # from 12, commits 1 to 3
    b = planned(s)  # from 13 at least (15 at most)
    s.process(a, out([21]))  # a committed one token: b starts at 13, reading from 10
    c = planned(s)
    assert rows(b)[2] == [15] and req.window_from == 2  # page 2 (8..11) keeps its own
    s.process(b, out([22, 23, 24]))
    s.process(c, out([25]))
    s.check_integrity()


def test_a_prefix_hit_counts_up_to_a_page_whose_window_is_held() -> None:
    """A text of 16 published: the cache keeps the window before its end (page 3). A prompt
    that extends it hits its 4 pages; one that leaves it after 12 positions finds 3 pages
    cached but no window before 12 (page 2's went back with the first request), and computes
    from 0."""
    s = make(window_pages=8)
    s.add(request(1, ids(10, 16), max_new=1))
    step(s, [20])  # the prompt and its one token: published
    assert s.running == []
    s.add(request(2, [*ids(10, 16), 1, 2, 3, 4, 5], max_new=1))
    assert rows(step(s, [21])) == ("extend", [0], [16], [5])
    s.add(request(3, [*ids(10, 12), 7, 7, 7, 7, 7], max_new=1))
    assert rows(step(s, [22])) == ("extend", [0], [0], [17])


def test_a_window_computed_again_goes_to_the_cache_for_the_next_hit() -> None:
    """A shared prefix of 12 (a system prompt) then different questions. The first request
    leaves the cache the window before its prompt's end (16) only, so the second's hit on
    the prefix (3 pages) is cut to nothing: it computes the prefix again. Before the next
    step, the cache's page 2 (the window before 12) gets a window page of its own, copied
    from the second's; the third request hits the prefix."""
    system = ids(10, 12)
    s = make(window_pages=12)
    s.add(request(1, [*system, 1, 2, 3, 4], max_new=4))
    step(s, [20])
    cached_page = s.running[0].pages[2]  # the first request's, cached with its prompt
    s.add(request(2, [*system, 5, 6, 7, 8], max_new=4))
    assert rows(step(s, [30])) == ("extend", [1], [0], [16])  # no hit: from 0
    second = s.running[1]
    fill = second.window_backfill
    assert fill is not None and (fill.first, fill.end) == (2, 3)
    assert [node.page for node in fill.nodes] == [cached_page]
    source = second.window_pages[2 - second.window_from]
    window = s.pages.window
    assert window is not None and cached_page not in window.held
    after = step(s, [21], [31])  # both decode; the copy runs before them
    copied_to = window.held[cached_page]
    assert (after.plan.window_copies_from, after.plan.window_copies_to) == ([source], [copied_to])
    assert (after.plan.window_writes[0], after.plan.window_values[0]) == (cached_page, copied_to)
    assert cached_page in window.cached and second.window_backfill is None
    s.add(request(3, [*system, 9, 9, 9, 9], max_new=4))
    assert rows(step(s, [40])) == ("extend", [2], [12], [4])  # the prefix hit


def test_the_cache_gives_its_windows_up_to_a_run_that_needs_a_page() -> None:
    """Three window pages: the cache keeps the window of a published prompt (its page 1),
    then a prompt of 12 needs all three: the cache's goes back, and a hit on the first
    prompt no longer counts."""
    s = make(window_pages=4)
    s.add(request(1, ids(10, 8), max_new=1))
    first = planned(s)
    kept = s.running[0].pages[1]
    s.process(first, out([20]))
    window = s.pages.window
    assert window is not None and window.cached == {kept}
    s.add(request(2, ids(50, 12), max_new=1))
    second = planned(s)
    # The first prompt's window went back; the cache keeps the second's (its page 2).
    assert len(s.running[0].window_pages) == 3 and window.cached == {s.running[0].pages[2]}
    s.process(second, out([21]))
    s.check_integrity()
    s.add(request(3, [*ids(10, 8), 1], max_new=1))
    assert rows(step(s, [22])) == ("extend", [0], [0], [9])


# --- finish --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_new", "commit", "expected"),
    [(8, [21, EOS, 23], [20, 21, EOS]), (3, [21, 22, 23], [20, 21, 22])],
    ids=["eos", "max_new_tokens"],
)
def test_a_finish_inside_a_speculative_commit(
    max_new: int, commit: list[int], expected: list[int]
) -> None:
    s = make(shape=SPEC)
    s.add(request(1, ids(10, 5), max_new=max_new))
    step(s, [20])
    assert rows(step(s, commit)) == ("decode", [0], [5], [3])
    reason: FinishReason = "stop" if EOS in commit else "length"
    assert updates(s) == [final(1, expected, reason, prompt=5, drafts=1, accepted=2)]
    counters = s.counters()
    assert (counters.spec_drafts, counters.spec_draft_tokens) == (1, 2)
    assert counters.spec_accepted_per_position == [1, 1] and counters.kv_used_tokens == 0


def test_a_short_commit_takes_back_the_bound() -> None:
    s = make(shape=SPEC)
    s.add(request(1, ids(10, 5)))
    step(s, [20])
    step(s, [21])  # planned for 3 tokens, committed 1
    p = step(s, [22, 23])
    assert rows(p) == ("decode", [0], [6], [3]) and p.plan.page_writes == [2]
    assert s.counters().spec_accepted_per_position == [1, 0]


def test_abort_while_a_step_is_in_flight() -> None:
    s = make()
    s.add(request(1, ids(10, 6)))
    p = planned(s)
    s.abort(1, "client vanished")
    assert updates(s) == [final(1, [], "abort", prompt=6)]
    s.check_integrity()
    s.process(p, out([20]))  # the in-flight row is ignored
    assert updates(s) == [] and not s.has_work
    s.check_integrity()


def test_abort_of_a_waiting_request() -> None:
    s = make(running=1)
    s.add(request(1, ids(10, 6)))
    s.add(request(2, ids(30, 6)))
    step(s, [20])
    s.abort(2, "client vanished")
    assert updates(s) == [final(2, [], "abort", prompt=6)] and waiting(s) == []
    s.check_integrity()


def test_a_finished_row_is_ignored_in_the_next_step() -> None:
    s = make()
    s.add(request(1, ids(10, 6)))
    p1, p2 = planned(s), planned(s)  # overlap order
    s.process(p1, out([EOS]))
    assert updates(s) == [final(1, [EOS], "stop", prompt=6)]
    assert s.schedule() is None
    s.process(p2, out([21]))
    assert updates(s) == [] and not s.has_work
    s.check_integrity()


# --- serial and overlap orders -------------------------------------------------------------


def token(rid: int, position: int) -> int:
    """The fake model's output ``position`` of request ``rid``: EOS for two of them."""
    return EOS if (rid, position) in {(2, 4), (4, 1)} else 100 + rid * 10 + position


class FakeDevice:
    """Commits runs of ``token(rid, position)`` of a length set by (rid, position); like the
    relay buffer, it knows each request's output count before the host does."""

    def __init__(self, shape: StepShape) -> None:
        self.max_commit = shape.max_commit
        self.produced: dict[int, int] = {}

    def run(self, p: Planned) -> StepOutput:
        committed: list[list[int]] = []
        for k, row in enumerate(p.plan.sample_rows):
            rid = p.requests[row].rid
            if p.plan.kind == "extend":
                first, count = p.plan.sample_positions[k], 1
            else:
                first = self.produced[rid]
                count = 1 + (rid + first) % self.max_commit
            committed.append([token(rid, first + j) for j in range(count)])
            self.produced[rid] = first + count
        return out(*committed)


@dataclass
class Served:
    tokens: dict[int, list[int]]  # every update's tokens, by rid
    spec_drafts: int
    accepted_per_position: list[int]


def serve(shape: StepShape, *, overlap: bool, pages: int) -> Served:
    """Five requests to the end, processing step n before (serial) or after (overlap)
    planning step n + 1; the integrity check after every step, one final per request."""
    s, device = make(shape=shape, pages=pages, running=3, chunk=32), FakeDevice(shape)
    for rid in range(1, 6):
        s.add(request(rid, ids(10 * rid, 3 + 2 * rid), max_new=4 + rid))
    tokens: dict[int, list[int]] = {rid: [] for rid in range(1, 6)}
    finished: set[int] = set()
    in_flight: tuple[Planned, StepOutput] | None = None
    while s.has_work or in_flight is not None:
        p = s.schedule()
        launched = (p, device.run(p)) if p is not None else None
        done, in_flight = (in_flight, launched) if overlap else (launched, None)
        if done is not None:
            s.process(*done)
        s.check_integrity()
        for update in updates(s):
            assert update.rid not in finished, "an update after the final"
            tokens[update.rid] += update.token_ids
            if update.is_final:
                finished.add(update.rid)
    counters = s.counters()
    assert finished == set(tokens) and counters.kv_used_tokens == 0
    return Served(tokens, counters.spec_drafts, counters.spec_accepted_per_position)


def expected_tokens(rid: int) -> list[int]:
    produced = [token(rid, i) for i in range(4 + rid)]
    return produced[: produced.index(EOS) + 1] if EOS in produced else produced


@pytest.mark.parametrize("shape", [NO_DRAFT, SPEC], ids=["plain", "speculative"])
def test_serial_and_overlap_orders_agree(shape: StepShape) -> None:
    serial = serve(shape, overlap=False, pages=64)
    assert serial == serve(shape, overlap=True, pages=64)
    assert serial.tokens == {rid: expected_tokens(rid) for rid in range(1, 6)}


@pytest.mark.parametrize("shape", [NO_DRAFT, SPEC], ids=["plain", "speculative"])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_retraction_keeps_the_tokens(
    shape: StepShape, overlap: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "outrider.scheduler")
    served = serve(shape, overlap=overlap, pages=8)
    assert served.tokens == {rid: expected_tokens(rid) for rid in range(1, 6)}
    assert "retract rid=" in caplog.text
