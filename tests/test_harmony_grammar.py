"""The harmony format's grammars (daemon/grammar/channels.py) against the gpt-oss tokenizer:
a chat's calls and its final answer held where they stand in the message stream, the
reasoning and preambles before them free."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
import xgrammar as xgr
from o200k_fixture import HARMONY_EOS, VOCAB_SIZE, save_random_gpt_oss

from outrider.daemon.grammar.channels import SPECIALS
from outrider.daemon.grammar.compiler import GrammarRefused, Grammars
from outrider.daemon.grammar.state import GrammarState
from outrider.daemon.grammar.tool_calls import HARMONY
from outrider.daemon.internal import FinalMessage, ToolUse
from outrider.daemon.tokenizer import Tokenizer, load_tokenizer
from outrider.protocol.messages import Grammar, Tool

WEATHER = Tool(
    "get_weather", "", '{"type": "object", "properties": {"city": {"type": "string"}}, '
    '"required": ["city"]}'
)  # fmt: skip
CLOCK = Tool(
    "get_time", "", '{"type": "object", "properties": {"zone": {"enum": ["UTC"]}}, '
    '"required": ["zone"]}'
)  # fmt: skip
CITY = Grammar("json_schema", WEATHER.parameters)
REASONING = "<|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant"
PREAMBLE = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
CALL = (
    "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris"}<|call|>'
)
CALL_RECIPIENT_FIRST = (
    ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
)
CLOCK_CALL = '<|channel|>commentary to=functions.get_time<|message|>{"zone": "UTC"}<|call|>'
FINAL = '<|channel|>final<|message|>{"city": "Paris"}<|return|>'


@pytest.fixture(scope="module")
def tokenizer(gpt_oss_tokenizer_dir: Path) -> Tokenizer:
    tokenizer = load_tokenizer(gpt_oss_tokenizer_dir)
    assert tokenizer is not None
    return tokenizer


@pytest.fixture(scope="module")
def grammars(gpt_oss_tokenizer_dir: Path) -> Grammars:
    return Grammars(str(gpt_oss_tokenizer_dir), VOCAB_SIZE, HARMONY_EOS)


def ends(tokenizer: Tokenizer, compiled: xgr.CompiledGrammar, stream: str) -> bool:
    """Whether the grammar takes every token of ``stream`` and ends with its last (a stop
    token of the format)."""
    matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=HARMONY_EOS)
    ids = tokenizer.hf.encode(stream, add_special_tokens=False)
    return all(matcher.accept_token(token) for token in ids) and matcher.is_terminated()


def allowed_after(tokenizer: Tokenizer, compiled: xgr.CompiledGrammar, stream: str) -> list[int]:
    state = GrammarState(compiled, HARMONY_EOS)
    assert state.advance(tokenizer.hf.encode(stream, add_special_tokens=False))
    masks = xgr.allocate_token_bitmask(1, VOCAB_SIZE)
    state.fill(masks, 0)
    bits = (masks[0].view(-1, 1) >> torch.arange(32)) & 1
    return bits.view(-1)[:VOCAB_SIZE].nonzero().view(-1).tolist()


def test_a_required_call_is_one_of_the_tools_held_to_its_schema(
    tokenizer: Tokenizer, grammars: Grammars
) -> None:
    required = grammars.compile_tools(ToolUse(HARMONY, [WEATHER, CLOCK], "required", None, False))
    for stream in (CALL, CALL_RECIPIENT_FIRST, CLOCK_CALL, REASONING + PREAMBLE + CALL):
        assert ends(tokenizer, required, stream), stream
    for stream in (
        FINAL,  # no call
        REASONING + FINAL,
        CALL.replace("city", "town"),  # not the schema's
        CALL.replace("get_weather", "get_news"),  # no such tool
        REASONING.replace("Let me", "Let<|call|> me"),  # a format token inside text
    ):
        assert not ends(tokenizer, required, stream), stream
    # After reasoning, the stream cannot end (no stop token): a call must come.
    after = allowed_after(tokenizer, required, REASONING + PREAMBLE)
    assert 200005 in after and not set(after) & {*HARMONY_EOS, 199999}  # <|channel|>
    named = grammars.compile_tools(
        ToolUse(HARMONY, [WEATHER, CLOCK], "required", "get_time", False)
    )
    assert ends(tokenizer, named, REASONING + CLOCK_CALL)
    assert not ends(tokenizer, named, CALL)


def test_auto_ends_in_a_call_or_a_final_answer(tokenizer: Tokenizer, grammars: Grammars) -> None:
    auto = grammars.compile_tools(ToolUse(HARMONY, [WEATHER], "auto", None, False))
    for stream in (
        CALL,
        FINAL,
        REASONING + FINAL,
        REASONING + "<|channel|>final<|message|>Hi<|return|>",
    ):
        assert ends(tokenizer, auto, stream), stream
    assert not ends(tokenizer, auto, CLOCK_CALL)  # not one of the request's tools
    assert not ends(tokenizer, auto, "<|channel|>final<|message|>Hi<|end|><|return|>")


def test_a_grammar_holds_the_final_message_alone(tokenizer: Tokenizer, grammars: Grammars) -> None:
    final = grammars.compile(FinalMessage(CITY))
    assert ends(tokenizer, final, FINAL)
    assert ends(tokenizer, final, REASONING + PREAMBLE + FINAL)
    assert not ends(tokenizer, final, FINAL.replace("city", "town"))
    assert not ends(tokenizer, final, CALL)
    # Where the JSON is whole, the final message ends: its <|return|> alone comes next.
    answer = REASONING + '<|channel|>final<|message|>{"city": "Paris"}'
    assert allowed_after(tokenizer, final, answer) == [200002]
    # Inside reasoning every token but the format's own may come, and the message's end.
    inside = allowed_after(tokenizer, final, "<|channel|>analysis<|message|>Let")
    assert len(inside) == VOCAB_SIZE - len(SPECIALS) + 1 and 200007 in inside  # <|end|>
    # The same grammar on a whole output (a prompt's, not a chat's) starts with its JSON.
    whole = grammars.compile(CITY)
    assert ends(tokenizer, whole, '{"city": "Paris"}<|return|>')
    assert not ends(tokenizer, whole, FINAL)


@pytest.mark.parametrize(
    ("grammar", "answer"),
    [
        (Grammar("json_object"), '{"a": [1, 2]}'),
        (Grammar("regex", r"[0-9]{3}-[a-z]+"), "123-abc"),
        (Grammar("choice", choices=["yes", "no"]), "no"),
        (Grammar("ebnf", 'root ::= "x" [0-9]+'), "x42"),
        (Grammar("lark", 'start: "x" DIGITS\nDIGITS: /[0-9]+/'), "x42"),
    ],
)
def test_every_grammar_kind_holds_a_final_message(
    tokenizer: Tokenizer, grammars: Grammars, grammar: Grammar, answer: str
) -> None:
    final = grammars.compile(FinalMessage(grammar))
    assert ends(tokenizer, final, f"{REASONING}<|channel|>final<|message|>{answer}<|return|>")
    assert not ends(tokenizer, final, f"{REASONING}<|channel|>final<|message|>?{answer}<|return|>")


def test_a_vocabulary_without_the_format_is_refused_here_and_by_a_child(tmp_path: Path) -> None:
    from chat_model_fixture import save_chat_model

    tokenizer = save_chat_model(tmp_path)
    assert tokenizer.eos_token_id is not None
    for timeout in (0.0, 60.0):  # in this process; in a compiling child
        plain = Grammars(str(tmp_path), len(tokenizer.hf), [tokenizer.eos_token_id], 0.0, timeout)
        try:
            with pytest.raises(GrammarRefused, match=r"vocabulary has no <\|channel\|>, <\|mess"):
                plain.compile(FinalMessage(CITY))
        finally:
            plain.close()


@pytest.fixture(scope="module")
def gpt_oss_dir(gpt_oss_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_gpt_oss(gpt_oss_tokenizer_dir, tmp_path_factory.mktemp("harmony-gpt-oss"))


def test_an_eagle3_tree_keeps_the_target_only_tokens_under_the_harmony_grammars(
    tokenizer: Tokenizer, grammars: Grammars, gpt_oss_dir: Path, tmp_path: Path
) -> None:
    """A final answer held to a schema (greedy) and a required call (greedy and seeded
    sampled): the tokens the target alone gives under the same grammars."""
    from engine_harness import DRAFT_ALGORITHMS, engine_for, request, run
    from model_fixtures import save_random_eagle3

    prompt = tokenizer.hf.encode(
        "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant",
        add_special_tokens=False,
    )
    calls = ToolUse(HARMONY, [WEATHER, CLOCK], "required", None, False)
    requests = [
        msgspec.structs.replace(
            request(rid, prompt, max_new_tokens=16, temperature=temperature, seed=rid,
                    ignore_eos=False),
            harmony=True, **held,  # type: ignore[arg-type]
        )
        for rid, (temperature, held) in enumerate(
            ((0.0, {"grammar": CITY}), (1.0, {"tools": calls}), (0.0, {"tools": calls}))
        )
    ]  # fmt: skip
    # ``grammars`` reads the same tokenizer, saved beside the model.
    alone = run(engine_for(str(gpt_oss_dir), no_overlap=True), requests, grammars=grammars)
    draft = save_random_eagle3(tmp_path / "eagle3", gpt_oss_dir)
    tree = engine_for(str(gpt_oss_dir), **DRAFT_ALGORITHMS["eagle3 tree"], draft_model=str(draft))
    drafted = run(tree, requests, grammars=grammars)
    for rid, outcome in alone.items():
        assert drafted[rid].token_ids == outcome.token_ids, rid
        assert drafted[rid].finish is not None and drafted[rid].finish.usage.spec_drafts > 0
    # Every output is the format's: a final message or a call, begun as the grammar holds.
    texts = [tokenizer.hf.decode(alone[rid].token_ids) for rid in sorted(alone)]
    assert all(text.startswith(("<|channel|>", " to=functions.")) for text in texts), texts
