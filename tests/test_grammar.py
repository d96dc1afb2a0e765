"""Constrained outputs (daemon/grammar/), each kind of grammar through the in-process engine
(grammar_cases.py): every output matches its grammar and ends where the grammar lets it;
greedy tokens are the same under every draft algorithm as without speculation, through the
overlap loop and the serial one, beside unconstrained requests whose tokens the grammar rows
do not change; seeded sampled outputs likewise; drafts are proposed under the grammar (the
guide), and the masks of verify nodes and draft places; grammars that cannot compile are
refused with the compiler's reason; the daemon's compile queue. The loop's and the graphs'
handling of constrained steps: test_grammar_steps.py."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
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
)

from outrider.daemon.engine import host_masks
from outrider.daemon.engine.host_masks import (
    DeviceMark,
    GrammarGuide,
    HostMasks,
    _alone,
    _told_argmax,
    block_guided,
)
from outrider.daemon.engine.plan import StepPlan
from outrider.daemon.engine.token_masks import WALK_CANDIDATES, WALK_ROWS, TokenMasks
from outrider.daemon.grammar import state as state_module
from outrider.daemon.grammar.compiler import GrammarRefused, Grammars
from outrider.daemon.grammar.queue import GrammarQueue
from outrider.daemon.grammar.state import GrammarState, RowGrammars, depth_guided
from outrider.daemon.tokenizer import Tokenizer
from outrider.protocol.messages import Generate, Grammar, request_revision

debug_checks = debug_checks_fixture()
_model_dir, _tokenizer, _grammars, _drafts = grammar_fixtures()


def _start(grammars: Grammars, grammar: Grammar) -> GrammarState:
    """``grammar``'s state at the start of an output, as the daemon starts it."""
    return grammars.start(request(0, [1], grammar=grammar, ignore_eos=False))


def _regex_mask(grammars: Grammars, path: list[int]) -> torch.Tensor:
    """The regex grammar's next mask after ``path``, from a fresh state."""
    return _mask(grammars, GRAMMARS["regex"], path)


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
            _start(grammars, grammar)
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
    state = _start(grammars, GRAMMARS["regex"])
    masks = xgr.allocate_token_bitmask(2 + len(tokens) + 1, VOCAB)
    state.node_masks(masks, 2, tokens, parents)

    paths = [[], [a], [a, b], [a], [a, b, c], [a], [a, b, c, dash], [b]]
    expected = [_regex_mask(grammars, path) for path in paths]
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


def test_each_draft_place_is_masked_by_the_state_its_path_reaches(
    grammars: Grammars, tokenizer: Tokenizer
) -> None:
    """``RowGrammars.path_masks`` under ``[a-c]{3}-[0-9]{2}``: a place's mask is a fresh
    matcher's after its path; a path the grammar refuses or ends allows every token; the
    states are where they were after."""
    a, b, x, dash, one = (tokenizer.hf.convert_tokens_to_ids(c) for c in "abx-1")
    eos = tokenizer.eos_token_id
    assert eos is not None
    states = [_start(grammars, GRAMMARS["regex"]) for _ in range(3)]
    assert states[1].advance([a, b, a, dash, one])  # one digit to go
    assert states[2].advance([a, b, a, dash])
    paths = torch.tensor([[[a, b], [a, x]], [[one, eos], [a, a]], [[one, one], [b, b]]])
    masks = xgr.allocate_token_bitmask(7, VOCAB)
    masks[:] = 0
    RowGrammars(states).path_masks(masks, [0, 2, 4], paths)
    assert not masks[6].any()  # nothing written past the places

    everything = torch.full_like(masks[0], -1)
    # Row 1 ends on its first place's path and its second refuses ``a``.
    expected = [
        _regex_mask(grammars, [a, b]), everything, everything, everything,
        _regex_mask(grammars, [a, b, a, dash, one, one]), everything,
    ]  # fmt: skip
    for place, row in enumerate(expected):
        assert torch.equal(masks[place], row), place
    again = xgr.allocate_token_bitmask(1, VOCAB)
    states[1].fill(again, 0)
    assert torch.equal(again[0], _regex_mask(grammars, [a, b, a, dash, one]))


def test_a_state_past_its_stop_token_takes_nothing_more(
    grammars: Grammars, tokenizer: Tokenizer
) -> None:
    """Once the committed tokens end the grammar (its stop token taken, whether the commit
    starts from a walked path or not) a later token is refused."""
    a, b, dash, one = (tokenizer.hf.convert_tokens_to_ids(c) for c in "ab-1")
    eos = tokenizer.eos_token_id
    assert eos is not None
    answer = [a, b, a, dash, one, one, eos]
    walked, fresh = (_start(grammars, GRAMMARS["regex"]) for _ in range(2))
    masks = xgr.allocate_token_bitmask(1, VOCAB)
    RowGrammars([walked]).path_masks(masks, [0], torch.tensor([[answer]]))
    assert walked.advance(answer)  # from the walk: nothing left to take
    assert fresh.advance(answer)
    for state in (walked, fresh):
        assert not state.advance([one])


# The schema's answer inside its free-text string (``note``): most of the vocabulary allowed.
INSIDE_NOTE = '{"answer": "yes", "digit": 3, "flag": true, "note": "a'


def _mask(grammars: Grammars, grammar: Grammar, path: list[int]) -> torch.Tensor:
    """``grammar``'s next mask after ``path``, from a fresh state."""
    state = _start(grammars, grammar)
    assert state.advance(path)
    row = xgr.allocate_token_bitmask(1, VOCAB)
    state.fill(row, 0)
    return row[0]


def test_past_free_text_a_steps_later_places_allow_every_token_and_the_nodes_mask_them(
    grammars: Grammars, tokenizer: Tokenizer
) -> None:
    """Inside a JSON string (the schema's free ``note``: most of the vocabulary allowed) a
    step's draft places past the first allow every token, while the first place and every
    verify node take the mask their path reaches; at a structural place (a fresh object)
    every place is masked."""
    schema = GRAMMARS["json_schema"]
    inside = tokenizer.hf.encode(INSIDE_NOTE, add_special_tokens=False)
    c, d, brace, quote = (tokenizer.hf.convert_tokens_to_ids(t) for t in 'cd{"')
    free, structural = _start(grammars, schema), _start(grammars, schema)
    assert free.advance(inside)
    cases = [(free, inside, [c, d], False), (structural, [], [brace, quote], True)]
    for state, before, path, guided in cases:
        rows = RowGrammars([state])
        places = xgr.allocate_token_bitmask(3, VOCAB)
        places[:] = 0
        for place in range(3):
            rows.path_masks(places[place:], [0], torch.tensor([[path[:place]]]))
        assert rows.guides_paths() is guided
        assert torch.equal(places[0], _mask(grammars, schema, before))
        for place in (1, 2):
            expected = _mask(grammars, schema, before + path[:place])
            assert not torch.equal(expected, torch.full_like(expected, -1))
            if guided:
                assert torch.equal(places[place], expected), place
            else:
                assert torch.equal(places[place], torch.full_like(expected, -1)), place
        nodes = xgr.allocate_token_bitmask(3, VOCAB)
        state.node_masks(nodes, 0, path, None)
        for node in range(3):
            assert torch.equal(nodes[node], _mask(grammars, schema, before + path[:node])), node
    assert RowGrammars([free, structural]).guides_paths()


def test_a_place_below_one_in_free_text_allows_every_token_and_its_siblings_stay_guided(
    grammars: Grammars, tokenizer: Tokenizer
) -> None:
    """From a structural state (the ``note`` key written, its string not opened) a tree's
    paths: one opens the string (its place's mask is free text), one does not. The places
    below the open string allow every token, deeper ones too; the other path's place takes
    its mask; once every place of a depth is in free text (or refused), the next depth is
    not guided (``guides_paths``) and waits for nothing. The verify nodes mask every path."""
    schema = GRAMMARS["json_schema"]
    before = tokenizer.hf.encode(INSIDE_NOTE[:-2], add_special_tokens=False)
    quote, a, b, space = (tokenizer.hf.convert_tokens_to_ids(t) for t in ['"', "a", "b", "Ġ"])
    state = _start(grammars, schema)
    assert state.advance(before)
    rows = RowGrammars([state])
    depths = [[[]], [[quote], [space]], [[quote, a], [space, quote]], [[quote, a, b]]]
    every = torch.full((xgr.allocate_token_bitmask(1, VOCAB).shape[1],), -1, dtype=torch.int32)
    guided_before = []
    masks = []
    for paths in depths:
        guided_before.append(rows.guides_paths())
        out = xgr.allocate_token_bitmask(len(paths), VOCAB)
        out[:] = 0
        rows.path_masks(out, [0], torch.tensor([paths]))
        masks.append(out)
    assert guided_before == [True, True, False, False]
    assert torch.equal(masks[0][0], _mask(grammars, schema, before))
    assert torch.equal(masks[1][0], _mask(grammars, schema, [*before, quote]))  # free text
    assert torch.equal(masks[1][1], every)  # the grammar refuses a space after the key
    assert torch.equal(masks[2][0], every)  # below free text: unguided
    assert torch.equal(masks[2][1], every)  # below a refused place
    assert torch.equal(masks[3][0], every)
    inside = _mask(grammars, schema, [*before, quote, a])
    assert not torch.equal(inside, every)
    nodes = xgr.allocate_token_bitmask(4, VOCAB)
    state.node_masks(nodes, 0, [quote, a, b], None)
    for node, path in enumerate([[], [quote], [quote, a], [quote, a, b]]):
        assert torch.equal(nodes[node], _mask(grammars, schema, [*before, *path])), node


def test_a_trees_best_places_of_a_depth_take_masks_and_the_rest_with_their_children_none(
    grammars: Grammars, tokenizer: Tokenizer
) -> None:
    """Under ``[a-c]{3}-[0-9]{2}``, a tree's depth of four places (best first): the
    ``GUIDED_PLACES`` best take their masks, the others allow every token, and so does a
    place of the next depth below one of those, even as that depth's best; the verify
    nodes mask every path."""
    assert state_module.GUIDED_PLACES == 2
    a, b, c, dash = (tokenizer.hf.convert_tokens_to_ids(t) for t in "abc-")
    state = _start(grammars, GRAMMARS["regex"])
    rows = RowGrammars([state])
    depths = [[[]], [[a], [b], [c], [dash]], [[c, a], [a, b], [b, c]]]
    every = torch.full((xgr.allocate_token_bitmask(1, VOCAB).shape[1],), -1, dtype=torch.int32)
    masks = []
    for paths in depths:
        out = xgr.allocate_token_bitmask(len(paths), VOCAB)
        out[:] = 0
        rows.path_masks(out, [0], torch.tensor([paths]))
        masks.append(out)
    assert torch.equal(masks[0][0], _regex_mask(grammars, []))
    assert torch.equal(masks[1][0], _regex_mask(grammars, [a]))
    assert torch.equal(masks[1][1], _regex_mask(grammars, [b]))
    assert torch.equal(masks[1][2], every)
    assert torch.equal(masks[1][3], every)
    assert torch.equal(masks[2][0], every)  # below the third place of the depth before
    assert torch.equal(masks[2][1], _regex_mask(grammars, [a, b]))
    assert torch.equal(masks[2][2], every)
    nodes = xgr.allocate_token_bitmask(4, VOCAB)
    assert state.node_masks(nodes, 0, [a, c, c], [0, 0, 2]) == 0
    for node, path in enumerate([[], [a], [c], [c, c]]):
        assert torch.equal(nodes[node], _regex_mask(grammars, path)), node


def test_a_trees_depth_guides_its_best_place_alone_past_two_grammar_rows(
    grammars: Grammars, tokenizer: Tokenizer
) -> None:
    """Under ``[a-c]{3}-[0-9]{2}``, a depth of two places in a step of three grammar rows:
    each row's best place takes its mask, its second allows every token."""
    assert [depth_guided(rows) for rows in (1, 2, 3, 32)] == [2, 2, 1, 1]
    a, b = (tokenizer.hf.convert_tokens_to_ids(t) for t in "ab")
    rows = RowGrammars([_start(grammars, GRAMMARS["regex"]) for _ in range(3)])
    every = torch.full((xgr.allocate_token_bitmask(1, VOCAB).shape[1],), -1, dtype=torch.int32)
    rows.path_masks(xgr.allocate_token_bitmask(3, VOCAB), [0, 1, 2], torch.tensor([[[]]] * 3))
    out = xgr.allocate_token_bitmask(6, VOCAB)
    out[:] = 0
    rows.path_masks(out, [0, 2, 4], torch.tensor([[[a], [b]]] * 3))
    for row in range(3):
        assert torch.equal(out[2 * row], _regex_mask(grammars, [a])), row
        assert torch.equal(out[2 * row + 1], every), row


def test_free_text_goes_on_unguided_until_a_committed_token_may_leave_it(
    grammars: Grammars, tokenizer: Tokenizer
) -> None:
    """A step that started in free text and commits no token holding a quotation mark or a
    backslash (``Grammars.text_exits``) starts the next unguided: its first place allows
    every token, and its root's mask comes with the verify nodes, the true one. A step
    whose root was not known, or that commits a quotation mark, guides the next one."""
    schema = GRAMMARS["json_schema"]
    inside = tokenizer.hf.encode(INSIDE_NOTE, add_special_tokens=False)
    b, quote, backslash = (tokenizer.hf.convert_tokens_to_ids(t) for t in 'b"\\')
    exits = grammars.text_exits
    assert exits[quote] and exits[backslash] and not exits[b]
    state = _start(grammars, schema)
    rows = RowGrammars([state])

    def first_place() -> torch.Tensor:
        out = xgr.allocate_token_bitmask(1, VOCAB)
        out[:] = 0
        rows.path_masks(out, [0], torch.zeros(1, 1, 0, dtype=torch.int64))
        return out[0]

    every = torch.full_like(first_place(), -1)
    assert state.advance(inside)  # the step before knew no root
    assert torch.equal(first_place(), _mask(grammars, schema, inside))
    assert state.advance([b])  # from free text, no exit
    assert torch.equal(first_place(), every)
    assert not rows.guides_paths()
    nodes = xgr.allocate_token_bitmask(2, VOCAB)
    state.node_masks(nodes, 0, [b], None)
    assert torch.equal(nodes[0], _mask(grammars, schema, [*inside, b]))
    assert torch.equal(nodes[1], _mask(grammars, schema, [*inside, b, b]))
    assert state.advance([b, quote])  # the string ends
    closed = _mask(grammars, schema, [*inside, b, b, quote])
    assert not torch.equal(closed, every)
    assert torch.equal(first_place(), closed)


@pytest.mark.parametrize("prepared", [False, True], ids=["restrict", "prepared"])
def test_a_later_draft_place_waits_for_the_device_only_where_a_row_guides_it(
    grammars: Grammars, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, prepared: bool
) -> None:
    """``GrammarGuide.restrict`` at a chain's first place and its second: with every row in
    free text the second allows every token and never waits for the device (its paths go
    unread); with a structural row beside it, it waits and masks that row: for all the work
    queued, or, where its paths were handed over before (``prepare``, as a worker does before
    the forward that computes the place's logits), for their copy alone."""
    schema = GRAMMARS["json_schema"]
    inside = tokenizer.hf.encode(INSIDE_NOTE, add_special_tokens=False)
    brace = tokenizer.hf.convert_tokens_to_ids("{")
    waits: Counter[str] = Counter()
    monkeypatch.setattr(TokenMasks, "wait_for_device", lambda masks: waits.update(["device"]))
    monkeypatch.setattr(DeviceMark, "wait", lambda mark: waits.update(["mark"]))
    for structural in (False, True):
        states = [_start(grammars, schema) for _ in range(1 + structural)]
        assert states[0].advance(inside)
        rows = len(states)
        host = HostMasks(TokenMasks(VOCAB, rows, 2, torch.device("cpu")))
        plan = StepPlan("decode", [], [], [], [], [], [], [], [], [], 0, True)
        plan = msgspec.structs.replace(plan, masked_rows=list(range(rows)))
        host.begin(plan, RowGrammars(states), None)
        host.padded(rows)
        guide = host.guide()
        waits.clear()
        first = torch.zeros(rows, VOCAB)
        guide.restrict(first, torch.zeros(rows, 0, dtype=torch.int64))
        assert first.isinf().any(dim=1).all()  # the first place: every row masked
        second = torch.zeros(rows, VOCAB)
        paths = torch.tensor([[inside[-1]], [brace]])[:rows]
        if prepared:
            guide.prepare(paths)
        guide.restrict(second, paths)
        assert waits == Counter({"mark" if prepared else "device": structural}), waits
        assert not second[0].isinf().any()  # free text: every token
        if structural:
            expected = _mask(grammars, schema, [brace])
            bits = (expected.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
            assert torch.equal(~second[1].isinf(), bits.view(-1)[:VOCAB].bool())


def test_places_chosen_on_the_host_wait_for_the_device_only_after_one_it_could_not_choose(
    grammars: Grammars, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block of five places under ``[a-c]{3}-[0-9]{2}`` with its places' best ids handed
    over (``GrammarGuide.candidates``): the first place is masked and waits for nothing; the
    second waits and reads the path the device drew, then the host chooses each place whose
    masked argmax is among its best ids, or alone in its mask (the place allows that id
    alone), and the next place does not wait; a place whose best ids the grammar all refuses
    while its mask allows several keeps its whole mask, and the place after it waits again."""
    a, b, c, x, dash, one = (tokenizer.hf.convert_tokens_to_ids(t) for t in "abcx-1")
    waits: Counter[str] = Counter()
    monkeypatch.setattr(TokenMasks, "wait_for_device", lambda masks: waits.update(["device"]))
    host = HostMasks(TokenMasks(VOCAB, 1, 6, torch.device("cpu")))
    plan = StepPlan("decode", [], [], [], [], [], [], [], [], [], 0, True)
    rows = RowGrammars([_start(grammars, GRAMMARS["regex"])])
    host.begin(msgspec.structs.replace(plan, masked_rows=[0]), rows, None)
    host.padded(1)
    guide = host.guide()
    assert guide.candidate_count(1) == WALK_CANDIDATES
    assert guide.candidate_count(WALK_ROWS + 1) == 0
    best = [[a, b, c], [x, b, c], [x, dash, one], [x, a, b], [one, x, a]]  # best first
    guide.candidates(torch.tensor([best]))
    drawn = [a, b, c, dash, one]  # what the device draws at each place
    allowed = []
    for place, token in enumerate(drawn):
        logits = torch.zeros(1, VOCAB)
        guide.restrict(logits, torch.tensor([drawn[:place]]))
        allowed.append(set(torch.nonzero(~logits[0].isinf()).flatten().tolist()))
        assert token in allowed[-1]
    assert allowed[0] == allowed[2] == {a, b, c}  # the device draws
    assert allowed[1] == {b} and allowed[3] == {dash} and allowed[4] == {one}  # chosen
    assert waits["device"] == 2  # at the second place, and after the third


def test_a_places_masked_argmax_is_told_from_its_best_ids_or_a_mask_of_one_id() -> None:
    """Per row: the first of its best ids the mask allows; else the mask's one id where it
    allows one alone and the logits have no column past the vocabulary; -1 otherwise, and
    past an id beyond the vocabulary."""
    words = np.zeros((3, 4), dtype=np.uint32)
    words[0, 1] = 1 << 3  # row 0: id 35 alone
    words[2, 1] = 1 << 3
    words[2, 2] = 1  # row 2: ids 35 and 64
    rows = np.array([0, 2])

    def told(best: list[list[int]], narrow: bool = True) -> list[int]:
        return _told_argmax(words, rows, np.array(best), 100, narrow).tolist()

    assert told([[5, 35, 7], [64, 35, 7]]) == [35, 64]
    assert told([[40, 41, 42], [40, 41, 42]]) == [35, -1]  # row 0's mask: 35 alone
    assert told([[40, 41, 42], [40, 41, 42]], narrow=False) == [-1, -1]
    assert told([[5, 120, 35], [7, 35, 120]]) == [-1, 35]  # an id past the vocabulary first
    lone = np.zeros((3, 4), dtype=np.uint32)
    lone[0, 1] = 1 << 31  # id 63 alone
    lone[1, 0] = 0b11  # ids 0 and 1
    assert _alone(lone).tolist() == [63, -1, -1]


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


def test_a_block_guides_fewer_places_the_more_rows_its_batch_holds() -> None:
    """Seven places up to 13 rows a batch, then fewer as the masks a step would take pass
    96, and never fewer than three."""
    assert [block_guided(rows) for rows in (0, 1, 13, 14, 16, 24, 32, 256)] == [
        7, 7, 7, 6, 6, 4, 3, 3,
    ]  # fmt: skip


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


def test_a_chain_walks_each_draft_once_and_its_commit_starts_from_the_walk(
    grammars: Grammars, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chain's draft places, then its verify nodes, then its commit, under
    ``[a-c]{3}-[0-9]{2}``: the matcher takes each draft token once (the nodes reuse the
    places' masks), the commit takes only what follows the accepted drafts, and every mask
    is a fresh matcher's after its path."""
    a, b, c = (tokenizer.hf.convert_tokens_to_ids(t) for t in "abc")
    state = _start(grammars, GRAMMARS["regex"])
    taken: list[int] = []
    accept = xgr.GrammarMatcher.accept_token

    def counted(matcher: xgr.GrammarMatcher, token: int, **kwargs: bool) -> bool:
        taken.append(token)
        return accept(matcher, token, **kwargs)

    monkeypatch.setattr(xgr.GrammarMatcher, "accept_token", counted)
    places = xgr.allocate_token_bitmask(3, VOCAB)
    for place, path in enumerate([[], [a], [a, b]]):
        state.place_masks(places, place, [path])
    nodes = xgr.allocate_token_bitmask(4, VOCAB)
    assert state.node_masks(nodes, 0, [a, b, c], None) == 0
    assert taken == [a, b, c]
    for node, path in enumerate([[], [a], [a, b], [a, b, c]]):
        assert torch.equal(nodes[node], _regex_mask(grammars, path)), node
        if node < 3:
            assert torch.equal(places[node], nodes[node]), node
    taken.clear()
    assert state.advance([a, b, a])  # two drafts accepted, then the target's own token
    assert taken == [a]
    after = xgr.allocate_token_bitmask(1, VOCAB)
    state.fill(after, 0)
    assert torch.equal(after[0], _regex_mask(grammars, [a, b, a]))


def test_a_draft_vocabulary_is_masked_through_its_columns() -> None:
    """``TokenMasks.apply_staged`` with ``columns`` (a draft vocabulary's target ids): each
    column takes its token's bit, ids past the vocabulary are refused, a row that allows none
    of the columns keeps every logit, and rows staged without a mask allow every token."""
    masks = TokenMasks(40, 2, 2, torch.device("cpu"))
    words = torch.zeros(2, 2, dtype=torch.int32)
    words[0, 0] = (1 << 2) | (1 << 6)  # tokens 2 and 6
    words[0, 1] = 1 << 3  # token 35
    words[1, 0] = 1 << 1  # token 1: no column holds it

    def fill(out: torch.Tensor) -> list[int]:
        out[[0, 2]] = words
        return [0, 2]

    masks.stage(3, fill)
    columns = torch.tensor([0, 2, 4, 6, 35, 41])
    logits = torch.zeros(3, 6)
    masks.apply_staged(logits, columns)
    inf = float("-inf")
    assert logits.tolist() == [[inf, 0, inf, 0, 0, inf], [0] * 6, [0] * 6]
    masks.stage(3)  # a capture's scratch rows: every token
    full = torch.zeros(3, 40)
    masks.apply_staged(full)
    assert not full.isinf().any()


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
