"""daemon/grammar/schemas.py: the grammar of a JSON schema (or of a structural tag holding
tools' schemas) with each length-bounded string's characters made strict JSON wherever the
schema nests one, and nothing else changed; xgrammar then refuses a raw control character
inside such a string (its own grammar lets one through) and keeps the bounds."""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr

from outrider.daemon.grammar.schemas import strict_json

LOOSE = r"(([^\"\\\r\n]))"  # xgrammar's character rule of a length-bounded string
STRICT = r"(([^\0-\x1f\"\\\r\n]))"  # its unbounded strings' unescaped characters


def _schema_grammar(schema: dict[str, Any]) -> xgr.Grammar:
    return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)


def _accepts(ebnf: str, text: str) -> bool:
    return bool(xgr.testing._is_grammar_accept_string(xgr.Grammar.from_ebnf(ebnf), text))


def test_every_bounded_string_is_strict_and_nothing_else_changes() -> None:
    bounded = {"type": "string", "maxLength": 4}
    schema = {
        "type": "object",
        "properties": {
            "a": bounded,
            "b": {"type": "array", "items": {"type": "string", "minLength": 1}},
            "c": {"anyOf": [{"type": "string", "minLength": 2, "maxLength": 3}, {"type": "null"}]},
            "d": {"$ref": "#/$defs/short"},
            "e": {"type": "string", "enum": [LOOSE]},  # a value that reads like the rule
            "f": {"type": "string"},
        },
        "$defs": {"short": bounded},
    }
    loose = str(_schema_grammar(schema)).splitlines()
    strict = strict_json(_schema_grammar(schema)).splitlines()
    changed = [(a, b) for a, b in zip(loose, strict, strict=True) if a != b]
    assert len(changed) == 4, changed  # a, b's items, c's string, the $defs one
    for before, after in changed:
        name = before.split(" ::= ")[0]
        assert before == f"{name} ::= {LOOSE}" and after == f"{name} ::= {STRICT}"


def test_xgrammar_refuses_control_characters_in_bounded_strings_and_keeps_the_bounds() -> None:
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}},
        "required": ["s"],
        "additionalProperties": False,
    }
    loose, strict = str(_schema_grammar(schema)), strict_json(_schema_grammar(schema))
    tab = '{"s": "a\tb"}'
    assert _accepts(loose, tab)  # xgrammar's own: JSON that strict parsers refuse
    assert not _accepts(strict, tab)
    for value, bounded in [
        ("ab", True),
        ("abcd", True),
        ("é€x", True),
        ("a", False),
        ("abcde", False),
    ]:
        text = json.dumps({"s": value}, ensure_ascii=False)
        assert _accepts(strict, text) is bounded, value
        assert _accepts(loose, text) is bounded, value


def test_a_tools_bounded_parameter_is_strict_in_its_structural_tag() -> None:
    parameters = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 3}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    tag = xgr.get_model_structural_tag("qwen_3", tools=tools, tool_choice="auto")
    loose = str(xgr.Grammar.from_structural_tag(tag))
    strict = strict_json(xgr.Grammar.from_structural_tag(tag))
    assert loose.count(LOOSE) == 1 and LOOSE not in strict
    assert strict == loose.replace(LOOSE, STRICT)
