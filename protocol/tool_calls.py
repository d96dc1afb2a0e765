"""Tool calls in a model's own output format, parsed out of its text: what the daemon's
answers hold when a request had tools (``Generate.tools``). The format a daemon's model
speaks is ``server_info().configuration["tool_call_format"]``:

- ``qwen_3`` (Qwen, Hermes): ``<tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>``,
  one block per call, text outside the blocks is the message's content;
- ``llama`` (Llama 3.x JSON tool calling): ``{"name": N, "parameters": A}`` objects.

Parsing is exact where the daemon's grammar held the calls (``tool_choice`` required or
named, and every call of ``auto``): it reads what the grammar lets through. Standard
library only.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

ToolCallFormat = Literal["qwen_3", "llama"]
TOOL_CALL_FORMATS: tuple[ToolCallFormat, ...] = ("qwen_3", "llama")

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_LLAMA_START = '{"name": '


def new_call_id() -> str:
    """A fresh id for a call the daemon parsed (OpenAI's ``call_`` form)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict[str, Any]


def parse_tool_calls(fmt: ToolCallFormat, text: str) -> tuple[str, list[ParsedCall]]:
    """The content left once the calls are taken out of ``text``, and the calls, in order;
    a block that does not hold a call stays in the content."""
    if fmt == "qwen_3":
        return _parse_hermes(text)
    return _parse_llama(text)


def _as_call(value: Any, arguments_key: str) -> ParsedCall | None:
    if not isinstance(value, dict) or set(value) != {"name", arguments_key}:
        return None
    name, arguments = value["name"], value[arguments_key]
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return ParsedCall(name, arguments)


def _parse_hermes(text: str) -> tuple[str, list[ParsedCall]]:
    calls: list[ParsedCall] = []
    kept: list[str] = []
    last = 0
    for match in _HERMES_CALL.finditer(text):
        try:
            call = _as_call(json.loads(match.group(1)), "arguments")
        except ValueError:
            call = None
        if call is None:
            continue
        kept.append(text[last : match.start()])
        calls.append(call)
        last = match.end()
    kept.append(text[last:])
    return "".join(kept).strip(), calls


def _parse_llama(text: str) -> tuple[str, list[ParsedCall]]:
    decoder = json.JSONDecoder()
    calls: list[ParsedCall] = []
    kept: list[str] = []
    at = last = 0
    while (start := text.find(_LLAMA_START, at)) >= 0:
        try:
            value, end = decoder.raw_decode(text, start)
        except ValueError:
            at = start + 1
            continue
        call = _as_call(value, "parameters")
        if call is None:
            at = start + 1
            continue
        kept.append(text[last:start])
        calls.append(call)
        at = last = end
    kept.append(text[last:])
    content = "".join(kept).strip().removeprefix("<|python_tag|>").strip(" ;\n")
    return content, calls
