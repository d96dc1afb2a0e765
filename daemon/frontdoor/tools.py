"""A chat request's tools at the front door: what it may ask (``tool_use``), and its
messages and tools as the chat template takes them (``template_inputs``, the OpenAI shape
transformers' templates read: a call's arguments as an object)."""

from __future__ import annotations

import json
from typing import Any, Literal

from outrider.daemon.grammar.tool_calls import HARMONY, function_schema
from outrider.daemon.internal import ToolUse
from outrider.protocol.messages import ChatMessage, Generate


class ToolsRefused(ValueError):
    """A request's tools cannot be honoured; ``code`` is the wire error's."""

    def __init__(self, code: Literal["invalid_request", "unsupported"], message: str) -> None:
        super().__init__(message)
        self.code = code


def tool_use(msg: Generate, tool_format: str | None) -> ToolUse | None:
    """What the daemon holds ``msg``'s calls to (None: nothing: no tools, or
    ``tool_choice`` none); raises ``ToolsRefused``. ``tool_format``: the model's
    (daemon/grammar/tool_calls.py), None where its chat template renders no tool calls;
    ``HARMONY`` for a chat in the harmony format, whose calls are parsed from its channels
    (daemon/harmony.py): at most one call, which ends the turn (``tool_choice`` ``none``:
    no tool is shown to the model)."""
    for i, message in enumerate(msg.messages or []):
        for j, call in enumerate(message.tool_calls):
            _object(call.arguments, f"messages[{i}].tool_calls[{j}].arguments")
    if msg.tool_name is not None and msg.tool_choice != "required":
        raise ToolsRefused("invalid_request", "tool_name needs tool_choice required")
    if not msg.tools:
        if msg.tool_choice == "required":
            raise ToolsRefused("invalid_request", "tool_choice required needs tools")
        return None
    if msg.messages is None:
        raise ToolsRefused("invalid_request", "tools need a chat request (messages)")
    names = [tool.name for tool in msg.tools]
    if len(set(names)) != len(names):
        raise ToolsRefused("invalid_request", "tools: two tools have the same name")
    for i, tool in enumerate(msg.tools):
        if tool.parameters:
            _object(tool.parameters, f"tools[{i}].parameters")
    if msg.tool_name is not None and msg.tool_name not in names:
        raise ToolsRefused("invalid_request", f"tool_name {msg.tool_name!r} is not one of tools")
    if msg.tool_choice == "none":
        return None
    if msg.grammar is not None:
        raise ToolsRefused(
            "invalid_request", "a grammar and tools cannot both constrain one output"
        )
    if tool_format is None:
        raise ToolsRefused(
            "unsupported",
            "tools: this model's chat template renders no tool-call format Outrider knows "
            "(Qwen / Hermes <tool_call>, Llama 3 JSON)",
        )
    choice: Literal["auto", "required"] = "required" if msg.tool_choice == "required" else "auto"
    # A harmony call ends the turn (its ``<|call|>`` is a stop token): one call at most.
    parallel = msg.parallel_tool_calls and tool_format != HARMONY
    return ToolUse(tool_format, msg.tools, choice, msg.tool_name, parallel)


def _object(text: str, field: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ToolsRefused("invalid_request", f"{field}: not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ToolsRefused("invalid_request", f"{field}: not a JSON object")
    return value


def template_inputs(msg: Generate) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``msg``'s messages and tools as the chat template takes them."""
    turns = [_turn(message) for message in msg.messages or []]
    return turns, [function_schema(tool) for tool in msg.tools]


def _turn(message: ChatMessage) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        turn["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.loads(call.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    return turn
