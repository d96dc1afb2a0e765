"""Tools in the OpenAI chat API: the request's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` and its messages' tool calls as the client library takes them, and an
answer's calls as ``message.tool_calls`` (streamed: as deltas once the answer is complete).

The daemon holds the calls to their schemas in the model's own format
(``server_info().configuration["tool_call_format"]``); the text the model wrote is parsed here
by that format (daemon/tool_calls.py): the calls leave the content, and ``finish_reason`` is
``tool_calls`` when there are any.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

import msgspec

from outrider.daemon.tool_calls import ToolCallFormat, parse_tool_calls
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
        "tool_calls": [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
            }
            for call in calls
        ],
    }
    return message, "tool_calls"
