"""Constrained outputs (daemon/grammar/), each kind of grammar through the in-process engine
(grammar_cases.py): every output matches its grammar and ends where the grammar lets it;
greedy tokens are the same under every draft algorithm as without speculation, through the
overlap loop and the serial one, beside unconstrained requests whose tokens the grammar rows
do not change; seeded sampled outputs likewise; drafts are proposed under the grammar (the
guide), and the masks of verify nodes; grammars that cannot compile are refused with the
compiler's reason; the daemon's compile queue; a grammar too costly to serve. The draft
places' masks and the guide's waits: test_grammar_guide.py. The loop's and the graphs'
handling of constrained steps: test_grammar_steps.py."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import xgrammar as xgr
from engine_harness import DRAFT_ALGORITHMS, debug_checks_fixture, engine_for, request, run
from grammar_cases import (
    GRAMMARS,
    PROMPTS,
    VOCAB,
    check_outputs,
    grammar_fixtures,
    grammar_requests,
    regex_mask,
    start_state,
)

from outrider.daemon.engine import host_masks
from outrider.daemon.engine.host_masks import (
    GrammarGuide,
)
from outrider.daemon.engine.token_masks import TokenMasks
from outrider.daemon.grammar import state as state_module
from outrider.daemon.grammar.compiler import GrammarRefused, Grammars
from outrider.daemon.grammar.queue import GrammarQueue
from outrider.daemon.grammar.state import GrammarState, RowGrammars
from outrider.daemon.tokenizer import Tokenizer
from outrider.protocol.messages import Generate, Grammar, request_revision

debug_checks = debug_checks_fixture()
_model_dir, _tokenizer, _grammars, _drafts = grammar_fixtures()


def test_every_output_matches_its_grammar_and_ends_there(
    model_dir: Path, tokenizer: Tokenizer, grammars: Grammars
) -> None:
    outcomes = run(engine_for(str(model_dir)), grammar_requests(), grammars=grammars)
    check_outputs(outcomes, tokenizer)
    # The unconstrained rows beside them decode as they do alone.
    alone = run(engine_for(str(model_dir)), grammar_requests()[-len(PROMPTS) :])
    for rid, outcome in alone.items():
        assert outcomes[rid].token_ids == outcome.token_ids


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("algorithm", list(DRAFT_ALGORITHMS))
def test_speculative_engines_give_the_target_only_tokens_under_grammars(
    model_dir: Path,
    tokenizer: Tokenizer,
    grammars: Grammars,
    drafts: dict[str, str],
    algorithm: str,
    overlap: bool,
) -> None:
    """Greedy and seeded sampled: the same tokens as the plain engine (serial) for every
    request, constrained or not."""
    settings = dict(DRAFT_ALGORITHMS[algorithm])
    if "eagle3" in algorithm or algorithm in ("dflash", "standalone"):
        settings["draft_model"] = drafts[algorithm.split()[0]]
    for temperature in (0.0, 1.0):
        reference = run(
            engine_for(str(model_dir), no_overlap=True),
            grammar_requests(temperature),
            grammars=grammars,
        )
        engine = engine_for(str(model_dir), no_overlap=not overlap, **settings)
        outcomes = run(engine, grammar_requests(temperature), grammars=grammars)
        for rid, outcome in reference.items():
            assert outcomes[rid].token_ids == outcome.token_ids, (temperature, rid)
        check_outputs(outcomes, tokenizer)
        # The constrained requests drafted: their verify nodes were masked, not skipped.
        constrained = [10 * g + p for g in range(len(GRAMMARS)) for p in range(len(PROMPTS))]
        drafted = [outcomes[rid].finish.usage.spec_drafts for rid in constrained]
        assert all(drafted), drafted


def test_grammars_that_cannot_compile_are_refused_with_the_reason(grammars: Grammars) -> None:
    cases = [
        (Grammar("regex", "[0-9"), "grammar (regex): Regex parsing error at position 5: "),
        (Grammar("json_schema", '{"type": "nonsense"}'), "grammar (json_schema): Unsupported"),
        (Grammar("ebnf", "root ::= missing"), "grammar (ebnf): "),
        (Grammar("lark", 'start: "(" item'), "grammar (lark): Lark error at line 1, column 12"),
    ]
    for grammar, start in cases:
        with pytest.raises(GrammarRefused) as info:
            start_state(grammars, grammar)
        assert str(info.value).startswith(start), str(info.value)
        assert "/project/" not in str(info.value)


def test_a_grammar_request_travels_as_protocol_1_2() -> None:
    plain = Generate("a", prompt="x")
    assert request_revision(plain) == 1
    assert request_revision(Generate("b", prompt="x", min_p=0.1)) == 2
    assert request_revision(Generate("c", prompt="x", grammar=GRAMMARS["regex"])) == 3


def test_the_queue_hands_back_compiled_and_refused_grammars_and_forgets_cancelled_ones(
    grammars: Grammars,
) -> None:
    queue = GrammarQueue(grammars)
    good = request(1, PROMPTS[0], grammar=GRAMMARS["choice"], ignore_eos=False)
    bad = request(2, PROMPTS[0], grammar=Grammar("regex", "[0-9"), ignore_eos=False)
    gone = request(3, PROMPTS[0], grammar=GRAMMARS["regex"], ignore_eos=False)
    for msg in (good, bad, gone):
        queue.submit(msg)
    assert len(queue) == 3 and queue.rids() == [1, 2, 3]
    assert queue.cancel(3) is gone and queue.cancel(3) is None
    ready: dict[int, object] = {}
    deadline = time.monotonic() + 30
    while len(ready) < 2 and time.monotonic() < deadline:
        ready.update((msg.rid, compiled) for msg, compiled in queue.ready())
        time.sleep(0.001)
    assert set(ready) == {1, 2} and not queue
    assert isinstance(ready[1], GrammarState)
    assert isinstance(ready[2], GrammarRefused)
    assert str(ready[2]).startswith("grammar (regex): Regex parsing error at position 5")
    queue.close()
    without = GrammarQueue(None)
    without.submit(good)
    [(msg, refused)] = without.ready()
    assert msg is good
    assert str(refused) == "a grammar needs the model's tokenizer and this model has none"


def test_each_verify_node_is_masked_by_the_state_its_own_path_reaches(
    grammars: Grammars, tokenizer: Tokenizer
) -> None:
    """A tree under ``[a-c]{3}-[0-9]{2}``: each node's mask is a fresh matcher's after the
    node's path; a node the grammar refuses (and its child) takes its parent's mask."""

    def ids(text: str) -> list[int]:
        return [tokenizer.hf.convert_tokens_to_ids(c) for c in text]

    a, b, c, x, dash = ids("abcx-")
    # Nodes 1..7: a (root's child), b (a's), x (a's: refused), c (b's), c (x's: after a
    # refused one), - (node 4's), b (root's).
    tokens = [a, b, x, c, c, dash, b]
    parents = [0, 1, 1, 2, 3, 4, 0]
    state = start_state(grammars, GRAMMARS["regex"])
    masks = xgr.allocate_token_bitmask(2 + len(tokens) + 1, VOCAB)
    state.node_masks(masks, 2, tokens, parents)

    paths = [[], [a], [a, b], [a], [a, b, c], [a], [a, b, c, dash], [b]]
    expected = [regex_mask(grammars, path) for path in paths]
    for node, row in enumerate(expected):
        assert torch.equal(masks[2 + node], row), node
    # The state is where it was: its next mask is the root's.
    again = xgr.allocate_token_bitmask(1, VOCAB)
    state.fill(again, 0)
    assert torch.equal(again[0], expected[0])


@pytest.mark.parametrize("algorithm", ["eagle3 chain", "eagle3 tree", "dflash", "standalone"])
def test_drafts_are_proposed_under_the_grammar(
    model_dir: Path,
    grammars: Grammars,
    drafts: dict[str, str],
    algorithm: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The constrained requests' drafts, guided and (the guide switched off) not: guided,
    far more drafts are accepted, and with every place guided (free text's later places
    too: ``FREE_TEXT`` above 1) no draft the grammar refuses reaches a verify where the
    draft's vocabulary is the target's (DFlash, standalone; the EAGLE-3 draft's holds the
    even ids only, so some places have no allowed token in it)."""
    settings = dict(DRAFT_ALGORITHMS[algorithm], draft_model=drafts[algorithm.split()[0]])
    refused = 0
    node_masks = GrammarState.node_masks

    def counted(state: GrammarState, *args: object) -> int:
        nonlocal refused
        count = node_masks(state, *args)  # type: ignore[arg-type]  # passed through
        refused += count
        return count

    monkeypatch.setattr(GrammarState, "node_masks", counted)

    def accepted_and_refused(temperature: float) -> tuple[int, int]:
        nonlocal refused
        refused = 0
        reqs = grammar_requests(temperature)[: -len(PROMPTS)]  # the constrained ones
        outcomes = run(engine_for(str(model_dir), **settings), reqs, grammars=grammars)
        return sum(o.finish.usage.spec_accepted_tokens for o in outcomes.values()), refused

    for temperature in (0.0, 1.0):
        guided = accepted_and_refused(temperature)
        with monkeypatch.context() as off:
            off.setattr(GrammarGuide, "restrict", lambda *args, **kwargs: None)
            unguided = accepted_and_refused(temperature)
        assert unguided[1] > 0, unguided  # the check can see refused drafts
        with monkeypatch.context() as strict:
            strict.setattr(state_module, "FREE_TEXT", 1.1)
            every_place = accepted_and_refused(temperature)
        if algorithm in ("dflash", "standalone"):
            assert every_place[1] == 0, (temperature, every_place)
        assert every_place[1] <= guided[1] < unguided[1], (temperature, guided, unguided)
        assert guided[0] > 10 * max(unguided[0], 1), (temperature, guided, unguided)


def test_a_state_past_its_stop_token_takes_nothing_more(
    grammars: Grammars, tokenizer: Tokenizer
) -> None:
    """Once the committed tokens end the grammar (its stop token taken, whether the commit
    starts from a walked path or not) a later token is refused."""
    a, b, dash, one = (tokenizer.hf.convert_tokens_to_ids(c) for c in "ab-1")
    eos = tokenizer.eos_token_id
    assert eos is not None
    answer = [a, b, a, dash, one, one, eos]
    walked, fresh = (start_state(grammars, GRAMMARS["regex"]) for _ in range(2))
    masks = xgr.allocate_token_bitmask(1, VOCAB)
    RowGrammars([walked]).path_masks(masks, [0], torch.tensor([[answer]]))
    assert walked.advance(answer)  # from the walk: nothing left to take
    assert fresh.advance(answer)
    for state in (walked, fresh):
        assert not state.advance([one])


# The schema's answer inside its free-text string (``note``): most of the vocabulary allowed.


def test_dflash_places_chosen_on_the_host_keep_its_tokens_with_fewer_waits(
    model_dir: Path, grammars: Grammars, drafts: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DFlash's greedy blocks under every grammar, one request at a time: with each place's
    best ids handed over (the default) the tokens are the plain engine's, as without, and
    the step waits for the device less often than with none handed over (when every guided
    place past the first waits)."""
    waits: Counter[str] = Counter()
    monkeypatch.setattr(TokenMasks, "wait_for_device", lambda masks: waits.update(["device"]))
    settings = {**DRAFT_ALGORITHMS["dflash"], "draft_model": drafts["dflash"]}
    plain = engine_for(str(model_dir), no_overlap=True)
    constrained = [r for r in grammar_requests() if r.grammar is not None]
    expected = {r.rid: run(plain, [r], grammars=grammars)[r.rid].token_ids for r in constrained}
    counted = {}
    for walk in (True, False):
        with monkeypatch.context() as patch:
            if not walk:
                patch.setattr(GrammarGuide, "candidate_count", lambda guide, bs: 0)
            engine = engine_for(str(model_dir), no_overlap=True, **settings)
            waits.clear()
            for req in constrained:
                tokens = run(engine, [req], grammars=grammars)[req.rid].token_ids
                assert tokens == expected[req.rid], (walk, req.rid)
            counted[walk] = waits["device"]
    assert counted[False] > counted[True] > 0, counted


def test_a_dflash_block_past_its_guided_places_keeps_its_tokens(
    model_dir: Path, grammars: Grammars, drafts: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DFlash's blocks under every grammar with two places guided, greedy and seeded
    sampled, all requests at once: the tokens are the plain engine's, and no place past the
    second takes the host's masks (the worker drafts those freely; the verify nodes mask
    them), where later places take them by default."""
    placed: list[int] = []
    stage_apart = TokenMasks.stage_apart

    def recorded(masks: TokenMasks, place: int, n: int, fill: Callable[..., object]) -> None:
        placed.append(place)
        stage_apart(masks, place, n, fill)  # type: ignore[arg-type]  # passed through

    monkeypatch.setattr(TokenMasks, "stage_apart", recorded)
    settings = {**DRAFT_ALGORITHMS["dflash"], "draft_model": drafts["dflash"]}
    plain = engine_for(str(model_dir), no_overlap=True)
    furthest = {}
    for temperature in (0.0, 1.0):
        reqs = grammar_requests(temperature)
        expected = run(plain, reqs, grammars=grammars)
        for guided in (None, (2, 2)):
            with monkeypatch.context() as patch:
                if guided is not None:
                    patch.setattr(host_masks, "BLOCK_GUIDED_PLACES", guided)
                engine = engine_for(str(model_dir), no_overlap=True, **settings)
                placed.clear()
                outcomes = run(engine, reqs, grammars=grammars)
                for rid, outcome in expected.items():
                    assert outcomes[rid].token_ids == outcome.token_ids, (temperature, rid)
                if temperature == 0.0:  # greedy blocks hand their places' best ids over
                    furthest[guided] = max(placed)
    assert furthest[(2, 2)] == 1 < furthest[None], furthest


@pytest.mark.parametrize("algorithm", ["eagle3 chain", "eagle3 tree", "ngram"])
def test_a_simulated_acceptance_commits_only_what_the_grammar_allows(
    model_dir: Path,
    tokenizer: Tokenizer,
    grammars: Grammars,
    drafts: dict[str, str],
    algorithm: str,
) -> None:
    """Benchmarks with dummy weights: a simulated acceptance commits the accepted drafts,
    never past one the grammar refuses (n-gram drafts are not guided), so every constrained
    output still matches its grammar, and drafts are still accepted."""
    settings = dict(DRAFT_ALGORITHMS[algorithm], speculative_simulate_acceptance=3.0)
    if algorithm != "ngram":
        settings["draft_model"] = drafts["eagle3"]
    outcomes = run(engine_for(str(model_dir), **settings), grammar_requests(), grammars=grammars)
    check_outputs(outcomes, tokenizer)
    accepted = [o.finish.usage.spec_accepted_tokens for o in outcomes.values()]
    assert sum(accepted) > len(accepted), accepted


class _Clock:
    """A ``perf_counter`` whose every reading is ``tick`` seconds after the one before: each
    mask fill measures ``tick``."""

    def __init__(self, tick: float) -> None:
        self.tick, self.now = tick, 0.0

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def test_a_state_whose_masks_take_longer_than_its_limit_three_steps_in_a_row_is_too_costly(
    grammars: Grammars, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a clock on which each fill takes 5 ms: with a 4 ms limit a state is too costly
    after ``COSTLY_STEPS`` committed steps with fills, not before; a step without fills
    neither counts nor forgives; a step under the limit (a 6 ms one) starts the count again;
    without a limit never."""
    assert state_module.COSTLY_STEPS == 3
    monkeypatch.setattr(state_module, "perf_counter", _Clock(0.005))
    a, b = (tokenizer.hf.convert_tokens_to_ids(t) for t in "ab")
    compiled = grammars.compile(Grammar("regex", "[ab]*"))
    stops = [tokenizer.eos_token_id]
    limited = GrammarState(compiled, stops, mask_limit_ms=4.0)
    unlimited = GrammarState(compiled, stops)
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    seen: list[float | None] = []
    for step, token in enumerate([a, b, a, b]):
        for state in (limited, unlimited):
            if step != 1:  # step 1 fills no mask
                state.fill(mask, 0)
            assert state.advance([token])
        seen.append(limited.too_costly())
        assert unlimited.too_costly() is None
    assert seen[:3] == [None, None, None] and seen[3] == pytest.approx(5.0)
    limited.mask_limit_ms = 6.0
    limited.fill(mask, 0)
    assert limited.advance([a]) and limited.too_costly() is None
    limited.mask_limit_ms = 4.0
    for _ in range(2):
        limited.fill(mask, 0)
        assert limited.advance([b]) and limited.too_costly() is None


def test_a_request_whose_grammar_is_too_costly_ends_with_invalid_request_and_others_go_on(
    model_dir: Path,
    tokenizer: Tokenizer,
    drafts: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each fill measuring 20 ms against a 10 ms limit, under speculation and the overlap:
    the constrained request ends with ``invalid_request`` naming the flag, after three
    committed steps, its pages released; the unconstrained one beside it gets the tokens it
    gets alone."""
    assert tokenizer.eos_token_id is not None
    limited = Grammars(str(model_dir), VOCAB, [tokenizer.eos_token_id], mask_limit_ms=10.0)
    monkeypatch.setattr(state_module, "perf_counter", _Clock(0.02))
    constrained = request(1, PROMPTS[0], max_new_tokens=40, grammar=GRAMMARS["regex"],
                          ignore_eos=False)  # fmt: skip
    plain = request(2, PROMPTS[1], max_new_tokens=40)
    settings = dict(DRAFT_ALGORITHMS["eagle3 chain"], draft_model=drafts["eagle3"])
    alone = run(engine_for(str(model_dir)), [plain])
    outcomes = run(engine_for(str(model_dir), **settings), [constrained, plain], grammars=limited)
    error = outcomes[1].final.error
    assert error is not None and error.code == "invalid_request", outcomes[1].final
    assert "--grammar-mask-limit-ms 10" in error.message and "20.0 ms each" in error.message
    assert outcomes[2].finish.reason == "length"
    assert outcomes[2].final.token_ids == alone[2].final.token_ids
