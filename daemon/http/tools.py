"""Tools in the OpenAI chat API: the request's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` and its messages' tool calls as the client library takes them, and an
answer's calls as ``message.tool_calls`` (streamed: ``delta.tool_calls``).

The daemon holds the calls to their schemas in the model's own format
(``server_info().configuration["tool_call_format"]``); the text the model wrote is parsed here
by that format (daemon/grammar/tool_calls.py): the calls leave the content, and ``finish_reason`` is
``tool_calls`` when there are any. Streamed, the content goes out as it comes until a call
may begin (``CallStream``), the calls at the end.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

import msgspec

from outrider.daemon.grammar.tool_calls import ParsedCall, ToolCallFormat, parse_tool_calls
from outrider.protocol import GenerateResult, Tool


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


def _call_body(call: ParsedCall, index: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {} if index is None else {"index": index}
    return body | {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
    }


# What begins a call in each format's text (daemon/grammar/tool_calls.py).
CALL_STARTS: dict[ToolCallFormat, str] = {"qwen_3": "<tool_call>", "llama": '{"name": '}


class CallStream:
    """One streamed choice whose tools may be called: its text goes out as content until a
    call may begin there (a text that could be the start of one is held back); the calls,
    and whatever content follows them, once the answer is complete."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.sent = 0  # characters of ``text`` sent as content
        self.held = False  # a call began: nothing more goes out before the end

    def take(self, text: str) -> str:
        """The next piece of ``text``'s answer that can go out as content ("" for none)."""
        self.text += text
        if self.held:
            return ""
        start = CALL_STARTS[self.fmt]
        at = self.text.find(start, self.sent)
        if at >= 0:
            self.held, limit = True, at
        else:
            limit = len(self.text) - _started(self.text, start)
        piece, self.sent = self.text[self.sent : limit], max(self.sent, limit)
        return piece

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The content not sent yet and the calls (as ``delta.tool_calls``), at the end."""
        content, calls = parse_tool_calls(self.fmt, self.text[self.sent :])
        return content, [_call_body(call, i) for i, call in enumerate(calls)]


def _started(text: str, start: str) -> int:
    """Characters at the end of ``text`` that could be the beginning of ``start``."""
    return next((n for n in range(len(start) - 1, 0, -1) if text.endswith(start[:n])), 0)
