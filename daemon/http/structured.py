"""Structured output in an OpenAI request: the fields that ask for a constrained output, as
one ``Grammar`` for the daemon (protocol 1.2).

Three spellings, at most one per request:

- OpenAI's ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``
  (the schema is enforced whether ``strict`` is true or not);
- vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, as an object or its JSON
  text), ``regex``, ``choice``, ``grammar`` (GBNF, or Lark where it has no ``::=`` rule),
  ``json_object: true``;
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

A value of the wrong shape is refused by the request's decoding (``openai.py``), naming its
path; what decoding cannot see is refused here, naming the field. The daemon compiles the
grammar and refuses, with the compiler's reason, one it cannot.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from outrider.protocol.messages import Grammar

JsonSchemaText = dict[str, Any] | str


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    json: JsonSchemaText | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(msgspec.Struct):
    """The request fields this module reads (a mixin of the request shapes)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonSchemaText | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class GrammarFieldError(ValueError):
    """A structured-output field that cannot be honoured; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def grammar_of(req: StructuredFields) -> Grammar | None:
    """The grammar ``req`` asks for, None for none; raises ``GrammarFieldError``."""
    asked = [
        (name, grammar)
        for name, grammar in (
            ("response_format", _response_format(req.response_format)),
            ("structured_outputs", _structured_outputs(req.structured_outputs)),
            ("guided_json", _schema(req.guided_json, "guided_json")),
            ("guided_regex", _text("regex", req.guided_regex)),
            ("guided_choice", _choice(req.guided_choice, "guided_choice")),
            ("guided_grammar", _grammar(req.guided_grammar)),
        )
        if grammar is not None
    ]
    if len(asked) > 1:
        names = " and ".join(name for name, _ in asked)
        raise GrammarFieldError(f"{names} both constrain the output: give one", asked[1][0])
    return asked[0][1] if asked else None


def _response_format(value: ResponseFormat | None) -> Grammar | None:
    if value is None or value.type == "text":
        return None
    if value.type == "json_object":
        return Grammar("json_object")
    if value.json_schema is None or value.json_schema.schema is None:
        raise GrammarFieldError(
            "a json_schema response_format needs json_schema.schema", "response_format"
        )
    return Grammar("json_schema", json.dumps(value.json_schema.schema))


def _structured_outputs(value: StructuredOutputs | None) -> Grammar | None:
    if value is None:
        return None
    given = {
        name: grammar
        for name, grammar in (
            ("json", _schema(value.json, "structured_outputs.json")),
            ("regex", _text("regex", value.regex)),
            ("choice", _choice(value.choice, "structured_outputs.choice")),
            ("grammar", _grammar(value.grammar)),
            ("json_object", Grammar("json_object") if value.json_object else None),
        )
        if grammar is not None
    }
    if len(given) != 1:
        raise GrammarFieldError(
            "structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
            "structured_outputs",
        )
    return next(iter(given.values()))


def _schema(value: JsonSchemaText | None, param: str) -> Grammar | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise GrammarFieldError(f"{param}: not JSON: {exc}", param) from None
        if not isinstance(value, dict):
            raise GrammarFieldError(f"{param}: a JSON schema is an object", param)
    return Grammar("json_schema", json.dumps(value))


def _text(kind: Literal["regex"], value: str | None) -> Grammar | None:
    return None if value is None else Grammar(kind, value)


def _grammar(text: str | None) -> Grammar | None:
    """A grammar's text as GBNF (rules ``name ::= ...``), else as Lark (``name: ...``)."""
    if text is None:
        return None
    return Grammar("ebnf" if "::=" in text else "lark", text)


def _choice(value: list[str] | None, param: str) -> Grammar | None:
    if value is None:
        return None
    if not value or not all(value):
        raise GrammarFieldError(f"{param}: a list of non-empty strings", param)
    return Grammar("choice", choices=value)
