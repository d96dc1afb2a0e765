"""The grammar guide of draft places (engine/host_masks.py's ``GrammarGuide``, the states'
place masks, grammar/state.py): each place masked by the state its path reaches; free text,
a tree's depths and a DFlash block guiding fewer places; the waits for the device a guided
place makes, and the places the host chooses from their best ids; a draft vocabulary masked
through its columns. Engines under grammars: test_grammar.py."""

from __future__ import annotations

from collections import Counter

import msgspec
import numpy as np
import pytest
import torch
import xgrammar as xgr
from engine_harness import debug_checks_fixture
from grammar_cases import GRAMMARS, VOCAB, grammar_fixtures, mask_after, regex_mask, start_state

from outrider.daemon.engine.host_masks import (
    DeviceMark,
    HostMasks,
    _alone,
    _told_argmax,
    block_guided,
)
from outrider.daemon.engine.plan import StepPlan
from outrider.daemon.engine.token_masks import WALK_CANDIDATES, WALK_ROWS, TokenMasks
from outrider.daemon.grammar import state as state_module
from outrider.daemon.grammar.compiler import Grammars
from outrider.daemon.grammar.state import RowGrammars, depth_guided
from outrider.daemon.tokenizer import Tokenizer

debug_checks = debug_checks_fixture()
_model_dir, _tokenizer, _grammars = grammar_fixtures()[:3]


def test_each_draft_place_is_masked_by_the_state_its_path_reaches(
    grammars: Grammars, tokenizer: Tokenizer
) -> None:
    """``RowGrammars.path_masks`` under ``[a-c]{3}-[0-9]{2}``: a place's mask is a fresh
    matcher's after its path; a path the grammar refuses or ends allows every token; the
    states are where they were after."""
    a, b, x, dash, one = (tokenizer.hf.convert_tokens_to_ids(c) for c in "abx-1")
    eos = tokenizer.eos_token_id
    assert eos is not None
    states = [start_state(grammars, GRAMMARS["regex"]) for _ in range(3)]
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
        regex_mask(grammars, [a, b]), everything, everything, everything,
        regex_mask(grammars, [a, b, a, dash, one, one]), everything,
    ]  # fmt: skip
    for place, row in enumerate(expected):
        assert torch.equal(masks[place], row), place
    again = xgr.allocate_token_bitmask(1, VOCAB)
    states[1].fill(again, 0)
    assert torch.equal(again[0], regex_mask(grammars, [a, b, a, dash, one]))


INSIDE_NOTE = '{"answer": "yes", "digit": 3, "flag": true, "note": "a'


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
    free, structural = start_state(grammars, schema), start_state(grammars, schema)
    assert free.advance(inside)
    cases = [(free, inside, [c, d], False), (structural, [], [brace, quote], True)]
    for state, before, path, guided in cases:
        rows = RowGrammars([state])
        places = xgr.allocate_token_bitmask(3, VOCAB)
        places[:] = 0
        for place in range(3):
            rows.path_masks(places[place:], [0], torch.tensor([[path[:place]]]))
        assert rows.guides_paths() is guided
        assert torch.equal(places[0], mask_after(grammars, schema, before))
        for place in (1, 2):
            expected = mask_after(grammars, schema, before + path[:place])
            assert not torch.equal(expected, torch.full_like(expected, -1))
            if guided:
                assert torch.equal(places[place], expected), place
            else:
                assert torch.equal(places[place], torch.full_like(expected, -1)), place
        nodes = xgr.allocate_token_bitmask(3, VOCAB)
        state.node_masks(nodes, 0, path, None)
        for node in range(3):
            assert torch.equal(nodes[node], mask_after(grammars, schema, before + path[:node])), (
                node
            )
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
    state = start_state(grammars, schema)
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
    assert torch.equal(masks[0][0], mask_after(grammars, schema, before))
    assert torch.equal(masks[1][0], mask_after(grammars, schema, [*before, quote]))  # free text
    assert torch.equal(masks[1][1], every)  # the grammar refuses a space after the key
    assert torch.equal(masks[2][0], every)  # below free text: unguided
    assert torch.equal(masks[2][1], every)  # below a refused place
    assert torch.equal(masks[3][0], every)
    inside = mask_after(grammars, schema, [*before, quote, a])
    assert not torch.equal(inside, every)
    nodes = xgr.allocate_token_bitmask(4, VOCAB)
    state.node_masks(nodes, 0, [quote, a, b], None)
    for node, path in enumerate([[], [quote], [quote, a], [quote, a, b]]):
        assert torch.equal(nodes[node], mask_after(grammars, schema, [*before, *path])), node


def test_a_trees_best_places_of_a_depth_take_masks_and_the_rest_with_their_children_none(
    grammars: Grammars, tokenizer: Tokenizer
) -> None:
    """Under ``[a-c]{3}-[0-9]{2}``, a tree's depth of four places (best first): the
    ``GUIDED_PLACES`` best take their masks, the others allow every token, and so does a
    place of the next depth below one of those, even as that depth's best; the verify
    nodes mask every path."""
    assert state_module.GUIDED_PLACES == 2
    a, b, c, dash = (tokenizer.hf.convert_tokens_to_ids(t) for t in "abc-")
    state = start_state(grammars, GRAMMARS["regex"])
    rows = RowGrammars([state])
    depths = [[[]], [[a], [b], [c], [dash]], [[c, a], [a, b], [b, c]]]
    every = torch.full((xgr.allocate_token_bitmask(1, VOCAB).shape[1],), -1, dtype=torch.int32)
    masks = []
    for paths in depths:
        out = xgr.allocate_token_bitmask(len(paths), VOCAB)
        out[:] = 0
        rows.path_masks(out, [0], torch.tensor([paths]))
        masks.append(out)
    assert torch.equal(masks[0][0], regex_mask(grammars, []))
    assert torch.equal(masks[1][0], regex_mask(grammars, [a]))
    assert torch.equal(masks[1][1], regex_mask(grammars, [b]))
    assert torch.equal(masks[1][2], every)
    assert torch.equal(masks[1][3], every)
    assert torch.equal(masks[2][0], every)  # below the third place of the depth before
    assert torch.equal(masks[2][1], regex_mask(grammars, [a, b]))
    assert torch.equal(masks[2][2], every)
    nodes = xgr.allocate_token_bitmask(4, VOCAB)
    assert state.node_masks(nodes, 0, [a, c, c], [0, 0, 2]) == 0
    for node, path in enumerate([[], [a], [c], [c, c]]):
        assert torch.equal(nodes[node], regex_mask(grammars, path)), node


def test_a_trees_depth_guides_its_best_place_alone_past_two_grammar_rows(
    grammars: Grammars, tokenizer: Tokenizer
) -> None:
    """Under ``[a-c]{3}-[0-9]{2}``, a depth of two places in a step of three grammar rows:
    each row's best place takes its mask, its second allows every token."""
    assert [depth_guided(rows) for rows in (1, 2, 3, 32)] == [2, 2, 1, 1]
    a, b = (tokenizer.hf.convert_tokens_to_ids(t) for t in "ab")
    rows = RowGrammars([start_state(grammars, GRAMMARS["regex"]) for _ in range(3)])
    every = torch.full((xgr.allocate_token_bitmask(1, VOCAB).shape[1],), -1, dtype=torch.int32)
    rows.path_masks(xgr.allocate_token_bitmask(3, VOCAB), [0, 1, 2], torch.tensor([[[]]] * 3))
    out = xgr.allocate_token_bitmask(6, VOCAB)
    out[:] = 0
    rows.path_masks(out, [0, 2, 4], torch.tensor([[[a], [b]]] * 3))
    for row in range(3):
        assert torch.equal(out[2 * row], regex_mask(grammars, [a])), row
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
    state = start_state(grammars, schema)
    rows = RowGrammars([state])

    def first_place() -> torch.Tensor:
        out = xgr.allocate_token_bitmask(1, VOCAB)
        out[:] = 0
        rows.path_masks(out, [0], torch.zeros(1, 1, 0, dtype=torch.int64))
        return out[0]

    every = torch.full_like(first_place(), -1)
    assert state.advance(inside)  # the step before knew no root
    assert torch.equal(first_place(), mask_after(grammars, schema, inside))
    assert state.advance([b])  # from free text, no exit
    assert torch.equal(first_place(), every)
    assert not rows.guides_paths()
    nodes = xgr.allocate_token_bitmask(2, VOCAB)
    state.node_masks(nodes, 0, [b], None)
    assert torch.equal(nodes[0], mask_after(grammars, schema, [*inside, b]))
    assert torch.equal(nodes[1], mask_after(grammars, schema, [*inside, b, b]))
    assert state.advance([b, quote])  # the string ends
    closed = mask_after(grammars, schema, [*inside, b, b, quote])
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
        states = [start_state(grammars, schema) for _ in range(1 + structural)]
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
            expected = mask_after(grammars, schema, [brace])
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
    rows = RowGrammars([start_state(grammars, GRAMMARS["regex"])])
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


def test_a_block_guides_fewer_places_the_more_rows_its_batch_holds() -> None:
    """Seven places up to 13 rows a batch, then fewer as the masks a step would take pass
    96, and never fewer than three."""
    assert [block_guided(rows) for rows in (0, 1, 13, 14, 16, 24, 32, 256)] == [
        7, 7, 7, 6, 6, 4, 3, 3,
    ]  # fmt: skip


def test_a_chain_walks_each_draft_once_and_its_commit_starts_from_the_walk(
    grammars: Grammars, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chain's draft places, then its verify nodes, then its commit, under
    ``[a-c]{3}-[0-9]{2}``: the matcher takes each draft token once (the nodes reuse the
    places' masks), the commit takes only what follows the accepted drafts, and every mask
    is a fresh matcher's after its path."""
    a, b, c = (tokenizer.hf.convert_tokens_to_ids(t) for t in "abc")
    state = start_state(grammars, GRAMMARS["regex"])
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
        assert torch.equal(nodes[node], regex_mask(grammars, path)), node
        if node < 3:
            assert torch.equal(places[node], nodes[node]), node
    taken.clear()
    assert state.advance([a, b, a])  # two drafts accepted, then the target's own token
    assert taken == [a]
    after = xgr.allocate_token_bitmask(1, VOCAB)
    state.fill(after, 0)
    assert torch.equal(after[0], regex_mask(grammars, [a, b, a]))


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
