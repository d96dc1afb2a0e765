"""Plain steps inside a speculative engine (scheduler/drafting.py, the runner's plain path):
the policy's decisions from given commit counts, and outputs that do not depend on which
steps draft."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import replace
from fractions import Fraction

import pytest
from engine_harness import (
    DRAFT_ALGORITHMS,
    debug_checks_fixture,
    engine_for,
    request,
    run,
    tokens_of,
)
from model_fixtures import VOCAB

from outrider.daemon.engine.graphs import DecodeGraphs, GraphKey
from outrider.daemon.engine.verify import position_rate
from outrider.daemon.internal import TokenizedRequest
from outrider.daemon.scheduler.acceptance import BreakEven, kind_of
from outrider.daemon.scheduler.drafting import (
    AdaptiveDrafting,
    AdaptiveSettings,
    AlternateDrafting,
    FixedDrafting,
    probe_cap,
)
from outrider.daemon.scheduler.request import Request
from outrider.plugins.sampling_spec import SamplingSpec

debug_checks = debug_checks_fixture()

WIDTH = 4  # the policy's engine verifies a root and 3 drafts a row
# The engine may cut their steps short: every algorithm's (a tree to its best nodes).
CUT = {"ngram", "eagle3 chain", "eagle3 tree", "standalone", "dflash"}

# --- the policy ---------------------------------------------------------------------------


def _req(rid: int, temperature: float = 0.0) -> Request:
    return Request.from_message(
        TokenizedRequest(
            rid=rid,
            request_id=f"r{rid}",
            input_ids=[1],
            sampling=SamplingSpec(temperature, 1.0, 0, 0, 0),
            max_new_tokens=8,
            stop=[],
            stop_token_ids=[],
            ignore_eos=True,
            stream=False,
            want_logprobs=False,
            arrival=0.0,
        )
    )


def _policy(break_even: BreakEven, **settings: int | float) -> AdaptiveDrafting:
    return AdaptiveDrafting(AdaptiveSettings(break_even, **settings), WIDTH)


def _mean(policy: AdaptiveDrafting, kind: int) -> tuple[float, int]:
    mean = policy.kind_tau[kind]
    return mean.value, mean.count


def test_break_even_is_read_between_the_measured_sizes_and_by_the_batch_kind() -> None:
    break_even = BreakEven((1, 4, 16), (2.0, 2.5, 3.5), (3.0, 3.5, 4.5))
    sizes = (1, 3, 4, 15, 16, 64)
    # Past the last size the line through the last two goes on: 1 / 12 a row more.
    greedy = [2.0, 2.0 + 0.5 * 2 / 3, 2.5, 2.5 + 11 / 12, 3.5, 3.5 + 48 / 12]
    assert [break_even.at(bs, True) for bs in sizes] == pytest.approx(greedy)
    assert [break_even.at(bs, False) for bs in sizes] == pytest.approx([g + 1 for g in greedy])
    assert BreakEven.fixed(1.7).at(9, True) == BreakEven.fixed(1.7).at(9, False) == 1.7
    # A line that falls at its end is not followed down: the last value.
    assert BreakEven((1, 4), (2.0, 1.8), (2.0, 1.8)).at(64, True) == 1.8


def test_kinds_are_greedy_and_temperature_bands() -> None:
    temperatures = (0.0, 0.1, 0.5, 0.6, 0.7, 0.9, 1.0, 1.5)
    assert [kind_of(_req(0, t)) for t in temperatures] == [0, 1, 1, 2, 2, 2, 3, 3]


def test_a_kind_never_observed_drafts_to_learn_and_counts_at_the_break_even() -> None:
    policy = _policy(BreakEven((1, 2), (2.0, 2.0), (3.0, 3.0)))
    greedy, sampled = _req(1), _req(2, temperature=1.0)
    assert policy.estimate(greedy) is None and policy.estimate(sampled) is None
    assert policy.drafting([greedy]) and policy.drafting([sampled, greedy])
    other = _req(3, temperature=1.0)
    other.tau_estimate = 2.8
    # Sampled break-even 3 at batch 2: (2.8 + 3) / 2 < 3, the unknown row does not lift it.
    assert not policy.drafting([other, sampled])
    other.tau_estimate = 3.2
    assert policy.drafting([other, sampled])


def test_drafting_resumes_after_plain_steps_where_it_gains_the_catch_up_back() -> None:
    """Break-even 2, a resume costing 4 plain steps more, over 8 cycles: drafting goes on at
    2, stops below it, and resumes from 2 + 4 / 8 = 2.5, after a probe too; rows of a kind
    never observed still draft to learn."""
    break_even = BreakEven((1,), (2.0,), (2.0,), resume=4.0)
    policy = _policy(break_even, resume_horizon=8, probe_every=4)
    row = _req(1, temperature=0.7)
    decisions = []
    for estimate in (2.0, 1.9, 2.0, 2.4, 2.5, 2.0):
        row.tau_estimate = estimate
        decisions.append(policy.drafting([row]))
    assert decisions == [True, False, False, False, True, True]
    row.tau_estimate = 1.0
    assert [policy.drafting([row]) for _ in range(5)] == [False] * 4 + [True]  # a probe
    row.tau_estimate = 2.4
    assert not policy.drafting([row])  # a probe's result resumes only from 2.5 too
    row.tau_estimate = 2.5
    assert policy.drafting([row])
    row.tau_estimate = 2.0
    assert policy.drafting([row])  # the run goes on at the break-even
    row.tau_estimate = 1.0
    assert not policy.drafting([row])
    assert policy.drafting([_req(2, temperature=1.5)])  # never observed: drafts to learn
    assert not policy.drafting([row])
    assert not policy.drafting([row, _req(3, temperature=1.5)])  # (1 + 2.5) / 2 < 2.5


def test_the_probe_cap_keeps_probes_near_one_percent_of_plain_time() -> None:
    """A probe costs the dearest sampled cycle's excess over one token and the catch-up."""
    assert probe_cap(BreakEven((1, 4), (1.5, 2.0), (2.5, 3.0), resume=0.5)) == 250
    assert probe_cap(BreakEven.fixed(1.2)) == 64  # 20, the least cap
    assert probe_cap(BreakEven.fixed(20.0)) == 1024  # 1,900, the most
    assert AdaptiveDrafting(AdaptiveSettings(BreakEven.fixed(3.0)), WIDTH).max_probe_every == 200
    assert _policy(BreakEven.fixed(3.0), max_probe_every=8).max_probe_every == 8


def test_kind_means_start_as_plain_means_then_move_slowly() -> None:
    policy = _policy(BreakEven.fixed(2.0), engine_smoothing=0.25, evidence=1)
    first, second = _req(1, temperature=1.0), _req(2, temperature=1.0)
    for commit_len in (1, 2, 3):
        policy.observe(first, commit_len)
    assert _mean(policy, 3) == (pytest.approx(2.0), 3)  # the mean of 1, 2, 3
    policy.observe(first, 1)  # from 4 observations on: weight 1 / 4, the smoothing
    assert _mean(policy, 3) == (pytest.approx(1.75), 4)
    policy.observe(first, 3)
    assert _mean(policy, 3) == (pytest.approx(2.0625), 5)
    # A new request of the kind starts at its mean; other kinds are untouched.
    assert policy.estimate(second) == pytest.approx(2.0625)
    assert policy.estimate(_req(3, temperature=0.7)) is None and set(policy.kind_tau) == {3}


def test_a_step_moves_its_kinds_mean_about_as_much_at_any_batch_size() -> None:
    """A step of 4 rows moves each row by a quarter of the smoothing: its kind's mean keeps all
    four rather than the last few, and past the plain mean a step of 4 rows moves it about as
    far as a step of one row does."""
    policy = _policy(BreakEven.fixed(2.0), engine_smoothing=0.25, evidence=1)
    rows = [_req(rid) for rid in range(4)]
    for commit_lens in ((1, 2, 3, 2), (2, 2, 2, 2), (2, 2, 2, 2), (2, 2, 2, 2)):
        for req, commit_len in zip(rows, commit_lens, strict=True):
            policy.observe(req, commit_len, rows=4)
    assert _mean(policy, 0) == (pytest.approx(2.0), 16)  # 16 rows: 4 / 0.25, a plain mean
    for req in rows:
        policy.observe(req, 4, rows=4)  # weight 0.25 / 4 a row
    assert _mean(policy, 0) == (pytest.approx(4 - 2 * 0.9375**4), 20)  # 2.455
    one = _policy(BreakEven.fixed(2.0), engine_smoothing=0.25, evidence=1)
    for commit_len in (1, 2, 3, 2, 4):  # a plain mean of four, then a step of one row
        one.observe(rows[0], commit_len)
    assert _mean(one, 0) == (pytest.approx(2.5), 5)


def test_a_request_moves_from_its_kinds_mean() -> None:
    policy = _policy(BreakEven.fixed(2.0), smoothing=0.5, evidence=1)
    first, second = _req(1), _req(2)
    policy.observe(first, 4)  # the kind's first observation, while it learns: the kind's only
    assert first.tau_estimate == 0.0 and _mean(policy, 0) == (4.0, 1)
    assert policy.estimate(first) == 4.0
    policy.observe(first, 2)
    assert first.tau_estimate == 3.0 and _mean(policy, 0) == (3.0, 2)
    policy.observe(second, 1)  # starts at the kind's mean 3
    assert second.tau_estimate == 2.0 and _mean(policy, 0) == (pytest.approx(7 / 3), 3)


def test_a_weak_draft_at_t1_runs_plain_once_its_kind_is_measured() -> None:
    """A sampled break-even of 2, a kind measured over 3 observations: the first request
    drafts three times to learn, commits 1 each time, and runs plain until a probe; the next
    request of its kind starts plain."""
    policy = _policy(BreakEven.fixed(2.0), probe_every=4, evidence=3)
    first = _req(1, temperature=1.0)
    decisions = []
    for _ in range(9):
        decisions.append(policy.drafting([first]))
        if decisions[-1]:
            policy.observe(first, 1)
    assert decisions == [True] * 3 + [False] * 4 + [True, False]
    second = _req(2, temperature=1.0)
    assert policy.estimate(second) == 1.0 and not policy.drafting([second])


def test_a_kind_learning_drafts_and_feeds_whatever_its_first_commits() -> None:
    """Before its ``evidence``-th observation a kind's mean decides nothing: its rows draft
    and its requests feed the draft (a probe is not needed) even after commits below the
    break-even, and a request keeps no estimate of its own; from then on its mean decides,
    and a request starts from it."""
    policy = _policy(BreakEven.fixed(2.0), evidence=4, smoothing=0.5)
    first = _req(1)
    for _ in range(3):
        assert policy.drafting([first])
        policy.observe(first, 1)
    assert policy.estimate(first) is None and first.tau_estimate == 0.0
    joining = _req(2)
    assert policy.feeds(joining, 1) and not joining.probe
    policy.observe(first, 3)  # the fourth: the kind's mean (1 + 1 + 1 + 3) / 4 decides
    assert _mean(policy, 0) == (1.5, 4) and policy.estimate(first) == 1.5
    assert not policy.drafting([first]) and not policy.feeds(_req(3), 0)
    policy.observe(joining, 3)
    assert joining.tau_estimate == pytest.approx(0.5 * 1.5 + 0.5 * 3)


def _one_row_gain(seed: int, acceptance: float) -> float:
    """A DFlash-like engine at one row (16 tokens a step, cut to 9, 5, 3, 2; cycles costing
    1.41, 1.37, 1.32, 1.29, 1.27 plain steps, the H200's for Qwen3-8B): 16 requests of 128
    tokens, one at a time, each draft position accepted with one probability until the first
    refused (``acceptance`` at the whole depth). Returns tokens over plain steps' time."""
    rng = random.Random(seed)
    costs = (1.41, 1.37, 1.32, 1.29, 1.27)
    cut = tuple((cost,) for cost in costs[1:])
    break_even = BreakEven(
        (1,), costs[:1], costs[:1], cut_drafts=(8, 4, 2, 1), cut_greedy=cut, cut_sampled=cut
    )
    policy = AdaptiveDrafting(AdaptiveSettings(break_even), 16)
    rate, cost, tokens = position_rate(acceptance, 15), 0.0, 0
    for rid in range(16):
        req = _req(rid)
        req.fed = policy.feeds(req, 0)
        made = 0
        while made < 128:
            width = policy.width([req])
            if width == 1:
                cost, made = cost + 1.0, made + 1
                continue
            accepted = 0
            while accepted < width - 1 and rng.random() < rate:
                accepted += 1
            cost += costs[policy.widths.index(width)]
            made += accepted + 1
            req.spec_drafts += 1
            policy.observe(req, accepted + 1, width - 1)
        tokens += made
    return tokens / cost


def test_an_unlucky_start_does_not_stop_a_draft_that_pays() -> None:
    """At an acceptance of 2 against a break-even of 1.41 (drafting the whole block: 1.42x),
    first cycles that happen to accept nothing must not hold a request, nor the requests after
    it, to plain steps; at 1.2, where no width pays, the policy loses at most 1 %."""
    good = sorted(_one_row_gain(seed, 2.0) for seed in range(20))
    assert good[0] > 1.3 and good[10] > 1.4
    assert min(_one_row_gain(seed, 1.2) for seed in range(20)) > 0.99


def test_a_good_greedy_draft_drafts_from_the_first_step() -> None:
    """A greedy break-even of 1.5: a rejection now and then does not stop a request whose
    acceptance is 2.5 on average, and the next request drafts at once."""
    policy = _policy(BreakEven.fixed(1.5))
    first = _req(1)
    decisions = []
    for commit_len in (3, 1, 4, 1, 2, 3, 1, 4):
        decisions.append(policy.drafting([first]))
        policy.observe(first, commit_len)
    assert all(decisions)
    assert _mean(policy, 0) == (pytest.approx(19 / 8), 8)  # the mean of the 8
    assert policy.drafting([_req(2)]) and policy.drafting([_req(3), _req(4)])


def test_plain_batches_probe_with_a_growing_wait() -> None:
    policy = _policy(BreakEven.fixed(3.0), probe_every=2, max_probe_every=8)
    low = _req(1, temperature=1.0)
    low.tau_estimate = 1.2
    decisions = [policy.drafting([low]) for _ in range(3 + 5 + 9 + 9)]
    probes = [i for i, d in enumerate(decisions) if d]
    assert probes == [2, 7, 16, 25]  # after 2, then 4, then 8 (the cap) plain steps
    low.tau_estimate = 3.0  # acceptance recovered: drafting resumes, the wait starts over
    assert policy.drafting([low]) and policy.probe_every == 2
    low.tau_estimate = 1.0
    assert [policy.drafting([low]) for _ in range(3)] == [False, False, True]


def test_a_kind_that_does_not_pay_stops_feeding_the_draft_and_probes_by_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A break-even of 2 against a plain step costing 1.25 of the target's own: a kind pays
    from 2.5. Never observed, it feeds the draft (to learn); at a mean of 2 its requests do not,
    save one fed probe after 2, then 4 (the cap) unfed admissions; a probe drafts at once, and
    a mean raised to 3 feeds every request again; each change is logged once."""
    caplog.set_level(logging.INFO, logger="outrider.scheduler")
    policy = _policy(
        BreakEven((1,), (2.0,), (2.0,), unfed=1.25),
        probe_requests=2, max_probe_requests=4, evidence=1,
    )  # fmt: skip
    first = _req(1)
    assert policy.feeds(first, 0) and not first.probe
    policy.observe(first, 2)
    requests = [_req(i) for i in range(2, 15)]
    fed = [policy.feeds(req, 0) for req in requests]
    assert [i for i, f in enumerate(fed) if f] == [2, 7, 12]
    assert all(req.probe == f for req, f in zip(requests, fed, strict=True))
    probe = requests[2]
    assert policy.estimate(probe) is None and policy.drafting([probe])
    policy.observe(probe, 4)  # the kind's mean: 3
    after = _req(20)
    assert policy.feeds(after, 0) and not after.probe
    assert policy.feeds(_req(21, temperature=1.0), 0)  # another kind, never observed
    assert [r.getMessage() for r in caplog.records] == [
        "greedy requests stop feeding the draft: their mean acceptance length 2.00, feeding "
        "pays from 2.50",
        "greedy requests feed the draft: their mean acceptance length 3.00, feeding pays from 2.50",
    ]


def test_a_request_whose_own_mean_does_not_pay_stops_feeding_the_draft() -> None:
    """A break-even of 2: where its batch runs plain, a request whose 8 drafting steps
    averaged 1.5 stops feeding the draft for good; one at 2.5 keeps feeding it, and so does
    one with 7 steps only."""
    policy = _policy(BreakEven.fixed(2.0), probe_every=100)
    weak, good, young = _req(1), _req(2), _req(3)
    for req, drafts, accepted in ((weak, 8, 4), (good, 8, 12), (young, 7, 0)):
        req.fed, req.spec_drafts, req.accepted_at_depth = True, drafts, accepted
        req.tau_estimate = 1.2  # its batch runs plain
        assert not policy.drafting([req])
    assert (weak.fed, good.fed, young.fed) == (False, True, True)
    assert policy.estimate(weak) == 1.0


def test_a_first_wave_stops_feeding_where_its_measured_kind_does_not_pay_at_its_size() -> None:
    """Drafting pays from 1.3 at one row and from 2.3 at 256: a first wave of 256 greedy
    requests of a kind never seen drafts once (to learn), measures 2, and stops feeding the
    draft at the next (plain) batch, its requests then plain for good; the same kind at one
    row keeps feeding and drafting; a probe keeps feeding until it drafted."""
    policy = _policy(BreakEven((1, 256), (1.3, 2.3), (1.5, 2.8)), probe_every=2)
    wave = [_req(i) for i in range(256)]
    for req in wave:
        req.fed = policy.feeds(req, 255)  # as the planner admits it
    assert all(req.fed for req in wave) and policy.drafting(wave)
    for req in wave:
        req.spec_drafts, req.spec_accepted_tokens = 1, 1
        policy.observe(req, 2)
    assert not policy.drafting(wave)
    assert all(req.fed is False for req in wave)
    assert not any(policy.drafting(wave) for _ in range(10))  # no probes of unfed rows
    alone = _req(300)
    alone.fed = policy.feeds(alone, 0)
    assert alone.fed and policy.drafting([alone])
    probe = _req(301)
    probe.fed, probe.probe = True, True
    assert policy.estimate(probe) is None
    assert policy.drafting([*wave, probe]) is False and probe.fed


def test_rows_not_feeding_the_draft_count_one_and_alone_never_draft() -> None:
    policy = _policy(BreakEven((1, 2), (1.5, 2.0), (1.5, 2.0)), probe_every=2)
    unfed = _req(1)
    unfed.fed = False
    assert policy.estimate(unfed) == 1.0
    assert not any(policy.drafting([unfed]) for _ in range(10))  # no probes either
    good = _req(2)
    good.tau_estimate = 3.0
    assert policy.drafting([good, unfed])  # (3 + 1) / 2 reaches 2
    good.tau_estimate = 2.6
    assert not policy.drafting([good, unfed])


def test_the_break_even_depends_on_the_batch_size_and_kind() -> None:
    policy = _policy(BreakEven((1, 4), (1.5, 3.0), (2.5, 3.5)))
    rows = [_req(i) for i in range(4)]
    for req in rows:
        req.tau_estimate = 2.0
    assert policy.drafting(rows[:1]) and policy.drafting(rows[:2])  # 1.5, then 2.0
    assert not policy.drafting(rows[:3])  # 2.5 at 3 rows
    sampled = _req(9, temperature=0.7)
    sampled.tau_estimate = 2.0
    assert not policy.drafting([sampled]) and not policy.drafting([rows[0], sampled])


def _cut_policy() -> tuple[AdaptiveDrafting, Request]:
    """A chain of 3 drafts measured cut at 1 and 2; greedy steps of the whole chain accepted
    position by position at 8 / 10, 4 / 8 and 2 / 4 (accepted drafts 1.4 a step on average:
    0.8 at one draft, 1.2 at two). Returns it, and a fresh greedy request."""
    break_even = BreakEven(
        (1, 256), (1.5, 2.6), (1.5, 2.6), cut_drafts=(2, 1),
        cut_greedy=((1.35, 2.0), (1.2, 1.5)), cut_sampled=((1.35, 2.0), (1.2, 1.5)),
    )  # fmt: skip
    policy = _policy(break_even, smoothing=0.3, evidence=10)
    first = _req(0)
    for commit_len in (1, 1, 2, 2, 2, 2, 3, 3, 4, 4):
        policy.observe(first, commit_len, 3)
    assert _mean(policy, 0) == (pytest.approx(2.4), 10)
    return policy, _req(1)


def test_a_batch_drafts_at_the_depth_that_gains_most_over_its_break_even() -> None:
    """At one row, 2.4 at 3 drafts over 1.5 (1.6) loses to 2.2 at 2 over 1.35 (1.63); at 256
    rows the whole chain does not pay (2.4 < 2.6), one draft pays most (1.8 / 1.5); a row
    capped at one draft counts what one draft commits at every depth."""
    policy, row = _cut_policy()
    assert policy.widths == (4, 3, 2)
    row.tau_estimate = 2.4
    assert policy.commits(row, 2.4, 2) == pytest.approx(2.2)
    assert policy.width([row]) == 3
    assert policy.width([row] * 256) == 2
    capped = _req(2)
    capped.tau_estimate, capped.max_drafts = 2.4, 1
    assert [policy.commits(capped, 2.4, d) for d in (3, 2, 1)] == [pytest.approx(1.8)] * 3
    assert policy.width([capped]) == 2  # 1.8 / 1.2 beats 1.8 / 1.35 and 1.8 / 1.5
    row.tau_estimate = 1.3  # 1.17 at one draft: no depth pays
    assert policy.width([row] * 256) == 1
    # Feeding pays from the depth that needs the least: 1 + 0.5 / (0.8 / 1.4) at one draft.
    assert policy.feeding_pays_from(row, 256) == pytest.approx(1.875)
    assert policy.feeding_pays_from(row, 1) == pytest.approx(1 + 0.2 / (0.8 / 1.4))


def test_a_shorter_chain_counts_its_commits_at_the_whole_depth() -> None:
    """A step of one draft that accepted it counts as 1 + 1 / (0.8 / 1.4) = 2.75 at three
    drafts (the share one draft keeps of the kind's accepted drafts); a row whose cap turned
    speculation off counts nothing."""
    policy, row = _cut_policy()
    policy.observe(row, 2, 1)
    assert policy.positions[0].tried == [11, 8, 4] and policy.positions[0].kept == [9, 4, 2]
    assert row.tau_estimate == pytest.approx(0.7 * 2.4 + 0.3 * 2.75)
    assert _mean(policy, 0) == (pytest.approx(2.4 + 0.35 / 11), 11)
    off = _req(3)
    off.max_drafts = 0
    policy.observe(off, 1, 0)
    assert off.tau_estimate == 0.0 and _mean(policy, 0)[1] == 11


def test_a_request_drafting_cut_short_stops_feeding_by_its_mean_at_the_whole_depth() -> None:
    """At 256 rows feeding pays from 1.875 (one draft: 1.5 / (0.8 / 1.4) share). A request
    whose 8 one-draft steps accepted 6 commits 1.75 a step, but counts 1 + 6 x 1.75 / 8 =
    2.31 at three drafts and keeps feeding; one that accepted 2 (1.44) stops."""
    policy, _ = _cut_policy()
    good, weak = _req(1), _req(2)
    for req, accepted in ((good, 6), (weak, 2)):
        req.fed = True
        for step in range(8):
            policy.observe(req, 2 if step < accepted else 1, 1)
            req.spec_drafts += 1
        req.tau_estimate = 1.3  # no depth pays: its batch runs plain
        assert policy.width([req] * 256) == 1
    assert good.accepted_at_depth == pytest.approx(6 * 1.75)
    assert (good.fed, weak.fed) == (True, False)


def test_a_tree_counts_each_smaller_size_from_its_whole_steps() -> None:
    """A tree of 5 nodes measured cut to 3, 2 and 1: four whole steps whose accepted paths
    reached worst ranks [0, 1], [0, 3], [2] and none accepted 5, 4, 3 and 2 drafts at the
    sizes 5, 3, 2, 1 would have (a path's drafts count while its worst rank stays below the
    size): shares 0.8, 0.6, 0.4; a step cut to 2 nodes that accepted one counts 1 + 1 / 0.6
    at the whole tree and adds no size's count."""
    cut = ((2.0,), (2.0,), (2.0,))
    break_even = BreakEven(
        (1,), (2.0,), (2.0,), cut_drafts=(3, 2, 1), cut_greedy=cut, cut_sampled=cut
    )
    policy = AdaptiveDrafting(AdaptiveSettings(break_even, smoothing=0.3, evidence=4), 6, tree=True)
    assert policy.widths == (6, 4, 3, 2)
    first = _req(0)
    for ranks in ([0, 1], [0, 3], [2], []):
        policy.observe(first, len(ranks) + 1, 5, ranks)
    sizes = policy.sizes[0]
    assert (sizes.steps, sizes.accepted) == (4, [5, 4, 3, 2])
    row = _req(1)
    assert [policy.share(row, n) for n in (5, 3, 2, 1)] == pytest.approx([1.0, 0.8, 0.6, 0.4])
    policy.observe(row, 2, 2, [1])  # from its kind's mean, (3 + 3 + 2 + 1) / 4
    assert row.tau_estimate == pytest.approx(0.7 * 2.25 + 0.3 * (1 + 1 / 0.6))
    assert sizes.steps == 4  # a cut step measures no size
    policy.observe(row, 3, 5, [0])  # ranks that do not match the commit: not counted
    assert sizes.steps == 4


def test_start_keys_hold_plain_graphs_beside_the_cycles() -> None:
    graphs = DecodeGraphs(2, 64, 20, 2, widths=(1, 4))
    keys = graphs.start_keys()
    assert [(k.bs, k.width, k.all_greedy) for k in keys] == [  # by tokens a step
        (bs, width, greedy)
        for bs, width in ((2, 4), (1, 4), (2, 1), (1, 1))
        for greedy in (False, True)
    ]
    assert {k.max_kv for k in keys} == {64}
    plan = graphs.scratch_plan(GraphKey(2, 64, True, 0, width=1))
    assert plan.q_lens == [1, 1] and not plan.drafting
    assert graphs.scratch_plan(GraphKey(2, 64, True, 0, width=4)).drafting


# --- the engine -------------------------------------------------------------------------


def _workload(first_rid: int = 0) -> list[TokenizedRequest]:
    """Greedy and seeded sampled requests, some repetitive (n-gram drafts get accepted)."""
    prompts = [[3 + (7 * i + 3 * j) % (VOCAB - 3) for j in range(5 + 2 * i)] for i in range(6)]
    prompts[1] = [5, 6, 7, 8] * 4
    return [
        request(
            first_rid + i, p, max_new_tokens=14, temperature=0.0 if i % 2 else 0.9, top_k=20,
            seed=i,
        )
        for i, p in enumerate(prompts)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def expected(speculative_dirs: dict[str, str]) -> dict[int, list[int]]:
    return tokens_of(run(engine_for(speculative_dirs["target"]), _workload()))


def _settings(speculative_dirs: dict[str, str], algorithm: str) -> dict[str, object]:
    settings = dict(DRAFT_ALGORITHMS[algorithm])
    name = str(settings["speculative_algorithm"])
    if name in ("eagle3", "dflash", "standalone"):
        settings["draft_model"] = speculative_dirs[name]
    return settings


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("algorithm", DRAFT_ALGORITHMS)
def test_alternating_plain_and_drafting_steps_keep_every_token(
    speculative_dirs: dict[str, str], expected: dict[int, list[int]], algorithm: str, overlap: bool
) -> None:
    engine = engine_for(
        speculative_dirs["target"], no_overlap=not overlap, **_settings(speculative_dirs, algorithm)
    )
    # A chain the engine cuts drafts at each of its depths in turn: each step's own verify and
    # catch-up, and the same tokens.
    shape = engine.loop.runner.shape
    widths = tuple(chain.width for chain in shape.cuts()) if algorithm in CUT else (shape.width,)
    policy = AlternateDrafting(widths)
    engine.scheduler.use_policy(policy)
    outcomes = run(engine, _workload(), stagger=2)
    assert tokens_of(outcomes) == expected
    assert set(policy.decisions) == {1, *widths}
    assert widths == {"ngram": (8, 5, 3, 2), "eagle3 tree": (6, 4, 3, 2)}.get(algorithm, (4, 3, 2))
    # Only drafting steps count as verifies.
    drafting_rows = engine.scheduler.counters().spec_drafts
    usage = [o.finish.usage for o in outcomes.values()]
    assert drafting_rows == sum(u.spec_drafts for u in usage) > 0
    assert all(u.spec_drafts < u.completion_tokens - 1 for u in usage)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_a_policy_that_cuts_the_chain_keeps_every_token(
    speculative_dirs: dict[str, str], expected: dict[int, list[int]], overlap: bool
) -> None:
    """Where only one draft pays (the whole chain and two drafts break even at 10), batches
    of observed rows draft one token a row: the first cycles (nothing observed: every depth
    ties, the deepest wins) draft three, the rest one; the tokens stay the target's."""
    engine = engine_for(
        speculative_dirs["target"], no_overlap=not overlap,
        **_settings(speculative_dirs, "eagle3 chain"),
    )  # fmt: skip
    never = (10.0,)
    break_even = BreakEven(
        (1,),
        never,
        never,
        cut_drafts=(2, 1),
        cut_greedy=(never, (1.0,)),
        cut_sampled=(never, (1.0,)),
    )
    policy = _policy(break_even, evidence=1)
    engine.scheduler.use_policy(policy)
    outcomes = run(engine, _workload(), stagger=2)
    assert tokens_of(outcomes) == expected
    counters = engine.scheduler.counters()
    extra = counters.spec_draft_tokens - counters.spec_drafts  # past one draft a row
    assert extra % 2 == 0  # every row drafted 1 or 3 (two never pays)
    whole = extra // 2  # rows of 3 drafts
    assert 0 < whole < counters.spec_drafts - whole  # some rows drafted 3, more drafted 1


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_a_tree_cut_to_one_node_where_only_that_pays_keeps_every_token(
    speculative_dirs: dict[str, str], expected: dict[int, list[int]], overlap: bool
) -> None:
    """An EAGLE-3 tree of 5 nodes where only its best node pays: the first cycles (nothing
    observed) verify the whole tree and each reports its path's ranks, which count every
    size (one count a whole row, over both kinds); the rest verify one node a row; the
    tokens stay the target's."""
    engine = engine_for(
        speculative_dirs["target"], no_overlap=not overlap,
        **_settings(speculative_dirs, "eagle3 tree"),
    )  # fmt: skip
    never = (10.0,)
    cut = (never, never, (1.0,))
    break_even = BreakEven(
        (1,), never, never, cut_drafts=(3, 2, 1), cut_greedy=cut, cut_sampled=cut
    )
    policy = AdaptiveDrafting(AdaptiveSettings(break_even, evidence=1), 6, tree=True)
    engine.scheduler.use_policy(policy)
    outcomes = run(engine, _workload(), stagger=2)
    assert tokens_of(outcomes) == expected
    counters = engine.scheduler.counters()
    extra = counters.spec_draft_tokens - counters.spec_drafts  # past one node a row
    assert extra % 4 == 0  # every row verified 5 nodes or 1
    whole = extra // 4
    assert 0 < whole < counters.spec_drafts - whole
    assert sum(sizes.steps for sizes in policy.sizes.values()) == whole
    for sizes in policy.sizes.values():
        assert sizes.accepted == sorted(sizes.accepted, reverse=True)


class FeedingNothing:
    """No request feeds the draft, and no batch drafts."""

    def width(self, rows: list[Request]) -> int:
        return 1

    def feeds(self, req: Request, others: int) -> bool:
        return False

    def observe(
        self, req: Request, commit_len: int, drafts: int, ranks: list[int], rows: int
    ) -> None:
        pass


class RecordingFeeds(FixedDrafting):
    """Every batch drafts and every request feeds the draft; the batch each request was
    admitted into is recorded (``others``)."""

    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.others: list[int] = []

    def feeds(self, req: Request, others: int) -> bool:
        self.others.append(others)
        return True


class RecordingObservations(AlternateDrafting):
    """Every other batch drafts and every other request feeds the draft; each observation's
    request and its step's observed rows are recorded."""

    def __init__(self, widths: tuple[int, ...]) -> None:
        super().__init__(widths)
        self.seen: list[tuple[Request, int]] = []

    def observe(
        self, req: Request, commit_len: int, drafts: int, ranks: list[int], rows: int
    ) -> None:
        self.seen.append((req, rows))


def test_the_policy_observes_only_the_rows_that_feed_the_draft(
    speculative_dirs: dict[str, str], expected: dict[int, list[int]]
) -> None:
    """Unfed rows ride the drafting batches, but their drafts had no context: only the fed
    rows are observed, each step's as one step (their weights, 1 / rows each, add up to 1)."""
    settings = _settings(speculative_dirs, "eagle3 chain")
    engine = engine_for(speculative_dirs["target"], **settings)
    policy = RecordingObservations((engine.loop.runner.shape.width,))
    engine.scheduler.use_policy(policy)
    assert tokens_of(run(engine, _workload())) == expected
    assert policy.fed.count(False) == 3 and policy.seen
    assert all(req.fed for req, _ in policy.seen)
    assert sum(Fraction(1, rows) for _, rows in policy.seen).denominator == 1


@pytest.mark.parametrize(("max_running", "others"), [(8, [5] * 6), (3, [2] * 6)])
def test_a_request_feeds_the_draft_by_the_batch_it_joins(
    speculative_dirs: dict[str, str], max_running: int, others: list[int]
) -> None:
    """Six requests queued at once are admitted one by one but decode together: each asks
    whether to feed the draft for the batch of the running ones and those queued behind it
    (five others, not 0, 1, .. 5), at most a full batch beside it."""
    settings = _settings(speculative_dirs, "eagle3 chain")
    engine = engine_for(speculative_dirs["target"], max_running=max_running, **settings)
    policy = RecordingFeeds(engine.loop.runner.shape.width)
    engine.scheduler.use_policy(policy)
    run(engine, _workload())
    assert policy.others == others


WORKER_HOOKS = ("after_extend", "defer_extend", "draft", "after_accept", "defer")


@pytest.mark.parametrize("algorithm", ["dflash", "eagle3 chain", "standalone", "ngram"])
def test_requests_not_feeding_the_draft_run_the_targets_steps_alone(
    speculative_dirs: dict[str, str], expected: dict[int, list[int]], algorithm: str
) -> None:
    """No worker hook runs for them and nothing is buffered; their pages are published as
    lacking the draft's KV, so the same prompts fed later hit none of them, keep every token,
    and publish their own in their place."""
    engine = engine_for(speculative_dirs["target"], **_settings(speculative_dirs, algorithm))
    runner, cache = engine.loop.runner, engine.scheduler.cache
    calls: dict[str, int] = dict.fromkeys(WORKER_HOOKS, 0)
    for name in WORKER_HOOKS:
        setattr(runner.worker, name, _counted(calls, name, getattr(runner.worker, name)))
    engine.scheduler.use_policy(FeedingNothing())
    assert tokens_of(run(engine, _workload(), stagger=2)) == expected
    assert calls == dict.fromkeys(WORKER_HOOKS, 0)
    assert runner.deferred is None or not any(runner.deferred.pending)
    assert cache.nodes and not any(node.drafted for node in cache.nodes.values())
    hits = cache.hits
    engine.scheduler.use_policy(FixedDrafting(runner.shape.width))
    fed = run(engine, _workload(first_rid=100), stagger=2)
    assert {rid - 100: tokens for rid, tokens in tokens_of(fed).items()} == expected
    assert cache.hits == hits and calls["draft"] > 0
    assert all(node.drafted for node in cache.nodes.values())


def _counted(calls: dict[str, int], name: str, hook: Callable[..., None]) -> Callable[..., None]:
    def counted(*args: object) -> None:
        calls[name] += 1
        return hook(*args)

    return counted


def test_the_policy_stops_drafting_where_acceptance_does_not_pay(
    speculative_dirs: dict[str, str], expected: dict[int, list[int]]
) -> None:
    """Random drafts are almost never accepted: with a break-even of 2.5 the batches run plain
    after the first few cycles, probing now and then; the tokens stay the target's."""
    engine = engine_for(
        speculative_dirs["target"],
        speculative_min_acceptance=2.5,
        **_settings(speculative_dirs, "eagle3 chain"),
    )
    assert engine.loop.runner.graphs is None  # CPU: eager
    policy = engine.scheduler.policy
    assert isinstance(policy, AdaptiveDrafting)
    assert policy.settings.break_even.at(8, True) == policy.settings.break_even.at(8, False) == 2.5
    # This workload's 84 tokens would not outlast a kind's learning at the default evidence.
    policy = AdaptiveDrafting(replace(policy.settings, evidence=4), policy.depth + 1)
    engine.scheduler.use_policy(policy)
    outcomes = run(engine, _workload())
    assert tokens_of(outcomes) == expected
    drafts = sum(o.finish.usage.spec_drafts for o in outcomes.values())
    tokens = sum(len(t) for t in tokens_of(outcomes).values())
    assert 0 < drafts < tokens / 3
    assert set(policy.kind_tau) == {0, 2}  # greedy, and T = 0.9
    assert all(mean.value < 2.5 for mean in policy.kind_tau.values())


def test_the_break_even_is_measured_at_start_by_default(
    speculative_dirs: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Greedy and sampled, at a prompt of 170 tokens: the tiny target's context of 256 less
    the timing's own tokens (DFlash block 4, cut to 2 and 1 drafts too: 4 + 2 turns a mode
    committing 4, 3, 2 and 1 tokens at most, then 3 resumes of 2 plain turns and one of 4)
    and two steps' span; the resume's cost where plain steps defer the catch-up (not n-gram's,
    which has no draft to catch up), and the unfed plain step's."""
    with caplog.at_level(logging.INFO, "outrider.engine"):
        engine = engine_for(
            speculative_dirs["target"],
            speculative_min_acceptance=-1.0,
            **_settings(speculative_dirs, "dflash"),
        )
    policy = engine.scheduler.policy
    assert isinstance(policy, AdaptiveDrafting)
    break_even = policy.settings.break_even
    assert break_even.sizes == (1, 4)
    for taus in (break_even.greedy, break_even.sampled):
        assert len(taus) == 2 and all(tau >= 1.0 for tau in taus)
    assert "batch 1, 4, 170-token prompts" in caplog.text
    assert break_even.resume >= 0.0 and "resuming it after plain steps costs" in caplog.text
    assert break_even.unfed >= 1.0 and "a plain step costs" in caplog.text
    assert break_even.cut_drafts == (2, 1) and len(break_even.cut_greedy) == 2
    assert policy.widths == (4, 3, 2)
    with caplog.at_level(logging.INFO, "outrider.engine"):
        ngram = engine_for(
            speculative_dirs["target"],
            speculative_min_acceptance=-1.0,
            **_settings(speculative_dirs, "ngram"),
        )
    assert isinstance(ngram.scheduler.policy, AdaptiveDrafting)
    assert ngram.scheduler.policy.settings.break_even.resume == 0.0
    assert ngram.scheduler.policy.settings.break_even.unfed >= 1.0
    # n-gram's chain is cut: its halved depths are timed too.
    depth, cut = ngram.loop.runner.shape.depth, ngram.scheduler.policy.settings.break_even
    assert (depth, cut.cut_drafts) == (7, (4, 2, 1))  # halved, rounded up
    assert len(cut.cut_greedy) == len(cut.cut_sampled) == 3
    assert all(len(taus) == 2 and min(taus) >= 1.0 for taus in cut.cut_greedy + cut.cut_sampled)
    assert ngram.scheduler.policy.widths == (8, 5, 3, 2)
    for drafts in (7, 4, 2, 1):
        assert f"drafting {drafts} tokens a row pays from" in caplog.text
    # A tree is cut to its best nodes: 5 nodes, then 3, 2 and 1.
    tree = engine_for(
        speculative_dirs["target"],
        speculative_min_acceptance=-1.0,
        **_settings(speculative_dirs, "eagle3 tree"),
    ).scheduler.policy
    assert isinstance(tree, AdaptiveDrafting) and tree.tree
    assert tree.settings.break_even.cut_drafts == (3, 2, 1) and tree.widths == (6, 4, 3, 2)
    counters = engine.scheduler.counters()  # the timing left nothing behind
    assert (counters.running, counters.waiting, counters.spec_drafts) == (0, 0, 0)
    plain = engine_for(speculative_dirs["target"], speculative_min_acceptance=-1.0)
    assert isinstance(plain.scheduler.policy, FixedDrafting)
