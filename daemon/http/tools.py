"""Tools in the OpenAI chat API: the request's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` and its messages' tool calls as the client library takes them, and an
answer's calls as ``message.tool_calls`` (streamed: ``delta.tool_calls``).

The daemon holds the calls to their schemas in the model's own format
(``server_info().configuration["tool_call_format"]``); the text the model wrote is parsed here
by that format (protocol/tool_calls.py): the calls leave the content, and ``finish_reason`` is
``tool_calls`` when there are any. Streamed (``CallStream``), the content goes out as it comes
until a call may begin, each call as soon as its name is read and its arguments as they are
written (their JSON text as the model wrote it; the answer not streamed carries them
re-serialised).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import msgspec

from outrider.protocol import GenerateResult, TokenChunk, Tool
from outrider.protocol.messages import ToolCall
from outrider.protocol.tool_calls import (
    ParsedCall,
    ToolCallFormat,
    new_call_id,
    parse_tool_calls,
)


class FunctionIn(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolIn(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionIn


class CalledFunction(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as the API carries it


class ToolCallIn(msgspec.Struct):
    id: str
    function: CalledFunction
    type: Literal["function"] = "function"


class ChosenFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: ChosenFunction


ToolChoiceIn = Literal["auto", "none", "required"] | NamedToolChoice


def tools_kwargs(
    tools: list[ToolIn] | None, choice: ToolChoiceIn | None, parallel: bool | None
) -> dict[str, Any]:
    """The client arguments of a chat request's tools (none without tools or a choice)."""
    if not tools and choice is None:
        return {}
    kwargs: dict[str, Any] = {
        "tools": [
            Tool(
                t.function.name,
                t.function.description,
                json.dumps(t.function.parameters) if t.function.parameters is not None else "",
            )
            for t in tools or []
        ],
        "parallel_tool_calls": True if parallel is None else parallel,
    }
    if isinstance(choice, NamedToolChoice):
        kwargs |= {"tool_choice": "required", "tool_name": choice.function.name}
    elif choice is not None:
        kwargs["tool_choice"] = choice
    return kwargs


def message_calls(calls: list[ToolCallIn] | None) -> list[dict[str, str]]:
    """An assistant message's calls as the client library's chat message carries them."""
    return [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in calls or []
    ]


def answer_with_calls(fmt: ToolCallFormat, result: GenerateResult) -> tuple[dict[str, Any], str]:
    """The chat message of ``result`` with its calls parsed out, and its finish reason."""
    content, calls = parse_tool_calls(fmt, result.text)
    if not calls:
        return {"role": "assistant", "content": result.text}, result.finish_reason
    message = {
        "role": "assistant",
        "content": content or None,
        "tool_calls": [_call_body(call) for call in calls],
    }
    return message, "tool_calls"


def channel_message(result: GenerateResult) -> tuple[dict[str, Any], str]:
    """The chat message of ``result`` and its finish reason, where the daemon split the
    output into channels (``GenerateResult.reasoning`` and ``tool_calls``: empty otherwise):
    the reasoning as ``reasoning_content``, as vLLM and SGLang return it."""
    message: dict[str, Any] = {"role": "assistant", "content": result.text}
    if result.reasoning:
        message["reasoning_content"] = result.reasoning
    if not result.tool_calls:
        return message, result.finish_reason
    message["content"] = result.text or None
    message["tool_calls"] = [wire_call(call) for call in result.tool_calls]
    return message, "tool_calls"


def channel_delta(chunk: TokenChunk, first_call: int) -> dict[str, Any]:
    """A streamed chunk's delta where the daemon split the output into channels: its answer
    (``content``, where it adds any), reasoning and whole calls, numbered from
    ``first_call``."""
    delta: dict[str, Any] = {}
    if chunk.text:
        delta["content"] = chunk.text
    if chunk.reasoning:
        delta["reasoning_content"] = chunk.reasoning
    if chunk.tool_calls:
        delta["tool_calls"] = [
            {"index": first_call + i} | wire_call(call) for i, call in enumerate(chunk.tool_calls)
        ]
    return delta


def wire_call(call: ToolCall) -> dict[str, Any]:
    """A call the daemon parsed (``ToolCall``) as the API carries it."""
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}  # fmt: skip


def _call_body(
    call: ParsedCall, index: int | None = None, arguments: str | None = None
) -> dict[str, Any]:
    """A call as the API carries it (``index``: a streamed one's; ``arguments``: its JSON
    text, default the parsed arguments')."""
    body: dict[str, Any] = {} if index is None else {"index": index}
    text = json.dumps(call.arguments) if arguments is None else arguments
    return body | {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": text},
    }


# What begins a call in each format's text (daemon/grammar/tool_calls.py), the head of a call
# up to its arguments (group 1: the name, as JSON string text), and what closes it after them.
CALL_STARTS: dict[ToolCallFormat, str] = {"qwen_3": "<tool_call>", "llama": '{"name": '}
_NAME = r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*'
_HEADS: dict[ToolCallFormat, re.Pattern[str]] = {
    "qwen_3": re.compile(r"<tool_call>\s*" + _NAME + r'"arguments"\s*:\s*'),
    "llama": re.compile(_NAME + r'"parameters"\s*:\s*'),
}
_TAILS: dict[ToolCallFormat, re.Pattern[str]] = {
    "qwen_3": re.compile(r"\s*\}\s*</tool_call>"),
    "llama": re.compile(r"\s*\}"),
}
StreamMode = Literal["content", "head", "arguments", "tail"]


class CallStream:
    """One streamed choice whose tools may be called: its text goes out as content until a
    call may begin (a text that could be the start of one, and trailing whitespace, are held
    back); a call goes out as soon as its head is read (index, id and name), its arguments as
    they are written, then content again (whitespace around calls dropped, as the answer not
    streamed strips it). A call's start that never makes a head is parsed with the rest at the
    end (``finish``)."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.sent = 0  # characters of ``text`` sent, as content or as a call
        self.mode: StreamMode = "content"
        self.calls = 0  # calls sent (begun)
        self.arguments = _JsonValue()  # the arguments of the call being written
        self.after_call = False  # content after a call: its leading whitespace is dropped
        self.head_at = 0  # where the call that may begin starts (mode "head")

    def take(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The next pieces of the answer that can go out: content ("" for none) and
        ``delta.tool_calls`` entries."""
        self.text += text
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while self._step(content, deltas):
            pass
        return "".join(content), _merged(deltas)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left at the end: the content held back, and the calls of a held text
        that parse only as a whole (a call cut off inside its arguments stays as sent)."""
        rest = self.text[self.sent :]
        self.sent = len(self.text)
        if self.mode == "content":
            return self._content(rest.rstrip() if self.calls else rest), []
        if self.mode != "head":
            return "", []
        content, calls = parse_tool_calls(self.fmt, rest)
        if not calls:
            return self._content(rest), []
        first, self.calls = self.calls, self.calls + len(calls)
        return content, [_call_body(call, first + i) for i, call in enumerate(calls)]

    def _step(self, content: list[str], deltas: list[dict[str, Any]]) -> bool:
        """Take what the text allows in the current mode; True when the mode changed."""
        text, at = self.text, self.sent
        if self.mode == "content":
            start = CALL_STARTS[self.fmt]
            found = text.find(start, at)
            end = found if found >= 0 else len(text) - _started(text, start)
            # Trailing whitespace is held: before a call it is dropped.
            end = max(at, len(text[:end].rstrip()))
            content.append(self._content(text[at:end]))
            self.sent = end
            if found < 0:
                return False
            self.head_at, self.mode = found, "head"
            return True
        if self.mode == "head":
            head = _HEADS[self.fmt].match(text, self.head_at)
            if head is None:
                return False  # not yet, or never: then ``finish`` parses it
            name = json.loads(f'"{head.group(1)}"')
            deltas.append(_call_body(ParsedCall(name, {}), self.calls, arguments=""))
            self.calls += 1
            self.sent, self.mode, self.arguments = head.end(), "arguments", _JsonValue()
            return True
        if self.mode == "arguments":
            taken = self.arguments.feed(text[at:])
            if taken:
                function = {"arguments": text[at : at + taken]}
                deltas.append({"index": self.calls - 1, "function": function})
            self.sent = at + taken
            if not self.arguments.done:
                return False
            self.mode = "tail"
            return True
        tail = _TAILS[self.fmt].match(text, at)
        if tail is None:
            return False
        self.sent, self.mode, self.after_call = tail.end(), "content", True
        return True

    def _content(self, piece: str) -> str:
        if self.after_call:
            piece = piece.lstrip()
            self.after_call = not piece
        return piece


class _JsonValue:
    """Where one JSON value ends in text fed piece by piece (strings, escapes, nesting)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.began = False
        self.done = False

    def feed(self, text: str) -> int:
        """Characters of ``text`` that belong to the value (all, until it ends)."""
        for i, char in enumerate(text):
            if self.done:
                return i
            if not self.began and char.isspace():
                continue
            if self.began and self.depth == 0 and not self.in_string and char in ",}] \n\t":
                self.done = True  # a scalar's end, not part of it
                return i
            self.began = True
            self._take(char)
        return len(text)

    def _take(self, char: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
                self.done = self.depth == 0
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            self.done = self.depth == 0


def _merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry a call: a call's argument pieces joined to the entry before them."""
    merged: list[dict[str, Any]] = []
    for delta in deltas:
        if merged and merged[-1]["index"] == delta["index"]:
            function = merged[-1]["function"]
            function["arguments"] += delta["function"]["arguments"]
        else:
            merged.append(delta)
    return merged


def _started(text: str, start: str) -> int:
    """Characters at the end of ``text`` that could be the beginning of ``start``."""
    return next((n for n in range(len(start) - 1, 0, -1) if text.endswith(start[:n])), 0)
