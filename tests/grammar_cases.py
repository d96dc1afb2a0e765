"""The grammar tests' cases: a tiny random llama with a real BPE tokenizer (its model, tokenizer,
compiled grammars and trained drafts as module fixtures), each kind of grammar on a few
prompts beside unconstrained requests, and the check that every constrained output matches
its grammar."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import xgrammar as xgr
from chat_model_fixture import CHAT_VOCAB, chat_tokenizer, save_chat_model
from engine_harness import request
from frontdoor_harness import build_tokenizer
from model_fixtures import save_drafts

from outrider.daemon.grammar.compiler import Grammars
from outrider.daemon.grammar.state import GrammarState
from outrider.daemon.tokenizer import Tokenizer
from outrider.protocol.messages import Grammar

VOCAB = CHAT_VOCAB  # the model's: past the tokenizer's 320 ids, which no mask may let through
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
        "digit": {"type": "integer", "minimum": 0, "maximum": 9},
        "flag": {"type": "boolean"},
        # Free text, bounded: strict JSON (no raw control character) however long.
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["answer", "digit", "flag", "note"],
    "additionalProperties": False,
}
GRAMMARS = {
    "json_schema": Grammar("json_schema", json.dumps(SCHEMA)),
    "regex": Grammar("regex", "[a-c]{3}-[0-9]{2}"),
    "choice": Grammar("choice", choices=["red", "green", "blue"]),
    "ebnf": Grammar("ebnf", 'root ::= "(" item ("," item)* ")"\nitem ::= [xyz]'),
    "lark": Grammar("lark", 'start: "[" pair "]"\npair: item ";" item\nitem: "p" | /q/'),
}
PROMPTS = [[1, 17, 40, 99, 7], [1, 5, 6, 200, 31, 77, 3], [1, 250, 12]]
NEW_TOKENS = 80  # the tiny tokenizer spends about a token a character


def grammar_fixtures() -> tuple[Callable[..., object], ...]:
    """The module fixtures ``model_dir``, ``tokenizer``, ``grammars`` and ``drafts``, for a
    test module to bind at its top level (each module builds its own)."""

    @pytest.fixture(scope="module", name="model_dir")
    def model_dir_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
        directory = tmp_path_factory.mktemp("grammar-llama")
        save_chat_model(directory)
        return directory

    @pytest.fixture(scope="module", name="tokenizer")
    def tokenizer_fixture(model_dir: Path) -> Tokenizer:
        return chat_tokenizer(model_dir)

    @pytest.fixture(scope="module", name="grammars")
    def grammars_fixture(model_dir: Path, tokenizer: Tokenizer) -> Grammars:
        assert tokenizer.eos_token_id is not None
        return Grammars(str(model_dir), VOCAB, [tokenizer.eos_token_id])

    @pytest.fixture(scope="module", name="drafts")
    def drafts_fixture(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
        found = save_drafts(tmp_path_factory.mktemp("grammar-drafts"), model_dir)
        build_tokenizer(Path(found["standalone"]))  # a standalone draft shares the tokenizer
        return found

    return model_dir_fixture, tokenizer_fixture, grammars_fixture, drafts_fixture


def grammar_requests(temperature: float = 0.0) -> list:
    """Each grammar on each prompt, then the prompts unconstrained (rids from 100)."""
    reqs = [
        request(10 * g + p, prompt, max_new_tokens=NEW_TOKENS, ignore_eos=False,
                temperature=temperature, seed=g + p, grammar=grammar)
        for g, grammar in enumerate(GRAMMARS.values())
        for p, prompt in enumerate(PROMPTS)
    ]  # fmt: skip
    reqs += [
        request(100 + p, prompt, max_new_tokens=12, temperature=temperature, seed=p)
        for p, prompt in enumerate(PROMPTS)
    ]
    return reqs


def matches(kind: str, text: str) -> bool:
    if kind == "json_schema":
        value = json.loads(text)
        return (
            set(value) == {"answer", "digit", "flag", "note"}
            and value["answer"] in ("yes", "no", "maybe")
            and value["digit"] in range(10)
            and isinstance(value["flag"], bool)
            and isinstance(value["note"], str)
            and len(value["note"]) <= 6
        )
    if kind == "regex":
        return re.fullmatch(r"[a-c]{3}-[0-9]{2}", text) is not None
    if kind == "choice":
        return text in ("red", "green", "blue")
    if kind == "lark":
        return re.fullmatch(r"\[[pq];[pq]\]", text) is not None
    return re.fullmatch(r"\([xyz](,[xyz])*\)", text) is not None


def check_outputs(outcomes: dict, tokenizer: Tokenizer) -> None:
    """Every constrained output matches its grammar and ended on its stop token."""
    eos = tokenizer.eos_token_id
    for g, kind in enumerate(GRAMMARS):
        for p in range(len(PROMPTS)):
            outcome = outcomes[10 * g + p]
            tokens = outcome.token_ids
            assert outcome.finish.reason == "stop", (kind, p, tokens)
            assert tokens[-1] == eos and all(t < 320 for t in tokens)
            text = tokenizer.hf.decode(tokens[:-1])
            assert matches(kind, text), (kind, p, text)


def start_state(grammars: Grammars, grammar: Grammar) -> GrammarState:
    """``grammar``'s state at the start of an output, as the daemon starts it."""
    return grammars.start(request(0, [1], grammar=grammar, ignore_eos=False))


def mask_after(grammars: Grammars, grammar: Grammar, path: list[int]) -> torch.Tensor:
    """``grammar``'s next mask after ``path``, from a fresh state."""
    state = start_state(grammars, grammar)
    assert state.advance(path)
    row = xgr.allocate_token_bitmask(1, VOCAB)
    state.fill(row, 0)
    return row[0]


def regex_mask(grammars: Grammars, path: list[int]) -> torch.Tensor:
    """The regex grammar's next mask after ``path``, from a fresh state."""
    return mask_after(grammars, GRAMMARS["regex"], path)
