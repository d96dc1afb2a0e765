"""Grammars of an output in the harmony format (gpt-oss's, daemon/harmony.py): xgrammar
structural tags over its message stream, which hold a chat's tool calls (``tool_choice``
auto, required or one named function) or its final answer (the request's grammar), and leave
the reasoning and preambles before them free.

The stream the model writes after its prompt's ``<|start|>assistant``::

    stream  := (message <|start|> "assistant")* last
    message := <|channel|> ("analysis" | "commentary") <|message|> text <|end|>
    call    := <|channel|> "commentary to=functions." NAME suffix <|message|> ARGUMENTS <|call|>
             | " to=functions." NAME <|channel|> "commentary" suffix <|message|> ARGUMENTS <|call|>
    suffix  := [" "] <|constrain|> "json" | " json" | nothing
    final   := <|channel|> "final" <|message|> (text | GRAMMAR) <|return|>
    last    := call (required: any tool's; named: that one's) | call or final (auto)
             | final with GRAMMAR (a request's grammar)

``<|x|>`` is the special token itself (by id: ``ids`` maps the format's ``SPECIALS`` to the
model's), never its spelling in plain text; ``text`` is any token but those specials;
ARGUMENTS is the tool's parameters' JSON schema, GRAMMAR the request's grammar (compiler.py
reads it as for any other output). A call ends the turn (``<|call|>`` is a stop token): one
call a turn, whatever ``parallel_tool_calls`` says.

No torch: the grammar's child process compiles these.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from xgrammar import structural_tag as st

from outrider.daemon.grammar.tool_calls import function_schema
from outrider.daemon.internal import ToolUse
from outrider.protocol.messages import Tool

CHANNEL, MESSAGE, END, START = "<|channel|>", "<|message|>", "<|end|>", "<|start|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
# Never inside a message's text: the format's own tokens and the vocabulary's bounds.
SPECIALS = [CHANNEL, MESSAGE, END, START, CONSTRAIN, CALL, RETURN,
            "<|endoftext|>", "<|startoftext|>"]  # fmt: skip


Ids = Mapping[str, int]  # the model's id of each of ``SPECIALS``


def _text(value: str) -> st.ConstStringFormat:
    return st.ConstStringFormat(value=value)


def _seq(*elements: Any) -> st.SequenceFormat:
    return st.SequenceFormat(elements=list(elements))


class _Stream:
    """The formats of one model's stream (its special tokens' ids)."""

    def __init__(self, ids: Ids) -> None:
        self.ids = ids

    def token(self, text: str) -> st.TokenFormat:
        return st.TokenFormat(token=self.ids[text])

    def free_text(self) -> st.AnyTokensFormat:
        return st.AnyTokensFormat(exclude_tokens=[self.ids[text] for text in SPECIALS])

    def messages(self) -> st.StarFormat:
        """Any number of reasoning and preamble messages, each followed by the next one's
        start."""
        channel = st.OrFormat(elements=[_text("analysis"), _text("commentary")])
        message = _seq(
            self.token(CHANNEL), channel, self.token(MESSAGE), self.free_text(),
            self.token(END), self.token(START), _text("assistant"),
        )  # fmt: skip
        return st.StarFormat(content=message)

    def call(self, tool: Tool, max_whitespace_cnt: int) -> st.OrFormat:
        """``tool``'s call in either header form, its arguments held to its parameters'
        schema."""
        recipient = f"to=functions.{tool.name}"
        space = st.OptionalFormat(content=_text(" "))
        constrain = _seq(space, self.token(CONSTRAIN), _text("json"))
        suffix = st.OptionalFormat(content=st.OrFormat(elements=[constrain, _text(" json")]))
        arguments = st.JSONSchemaFormat(
            json_schema=function_schema(tool)["function"]["parameters"],
            max_whitespace_cnt=max_whitespace_cnt,
        )
        body = (self.token(MESSAGE), arguments, self.token(CALL))
        return st.OrFormat(
            elements=[
                _seq(self.token(CHANNEL), _text(f"commentary {recipient}"), suffix, *body),
                _seq(_text(f" {recipient}"), self.token(CHANNEL), _text("commentary"), suffix,
                     *body),
            ]
        )  # fmt: skip

    def final(self, content: Any) -> st.SequenceFormat:
        return _seq(
            self.token(CHANNEL), _text("final"), self.token(MESSAGE), content, self.token(RETURN)
        )


def calls_tag(ids: Ids, use: ToolUse, max_whitespace_cnt: int) -> st.StructuralTag:
    """The stream of a chat whose tools ``use`` holds: ``required`` ends in a call (of
    ``use.name`` where named), ``auto`` in a call or a final answer; each call's arguments
    hold to its tool's schema, whitespace runs at most ``max_whitespace_cnt`` long."""
    stream = _Stream(ids)
    tools = [tool for tool in use.tools if use.name is None or tool.name == use.name]
    last: list[st.Format] = [stream.call(tool, max_whitespace_cnt) for tool in tools]
    if use.choice == "auto":
        last.append(stream.final(stream.free_text()))
    return st.StructuralTag(format=_seq(stream.messages(), st.OrFormat(elements=last)))


def final_tag(ids: Ids, grammar_ebnf: str) -> st.StructuralTag:
    """The stream of a chat whose final answer is held to ``grammar_ebnf`` (xgrammar's EBNF,
    rooted at ``root``)."""
    stream = _Stream(ids)
    final = stream.final(st.GrammarFormat(grammar=grammar_ebnf))
    return st.StructuralTag(format=_seq(stream.messages(), final))
