"""Tool calls on the daemon's side: which format a chat template speaks (the daemon detects
it at start and reports it in ``server_info().configuration["tool_call_format"]``), and a tool
as templates and grammars read it. No torch: the HTTP front reads this module. The formats
and their parser are the client library's (outrider/protocol/tool_calls.py); the daemon's
grammar for a request with tools is the structural tag of its format (daemon/grammar/).
"""

from __future__ import annotations

import json
from typing import Any

from outrider.protocol.messages import Tool
from outrider.protocol.tool_calls import ToolCallFormat

# The format of a chat's calls where its output is in the harmony format (gpt-oss): parsed
# from its channels (daemon/harmony.py), held by daemon/grammar/channels.py.
HARMONY = "harmony"


def function_schema(tool: Tool) -> dict[str, Any]:
    """``tool`` in the OpenAI shape (``{"type": "function", "function": {...}}``), as chat
    templates and xgrammar's structural tags read it."""
    parameters = json.loads(tool.parameters) if tool.parameters else {"type": "object"}
    function = {"name": tool.name, "description": tool.description, "parameters": parameters}
    return {"type": "function", "function": function}


def tool_call_format(chat_template: str | None) -> ToolCallFormat | None:
    """The tool-call format a chat template renders, None when it renders none."""
    if not chat_template or "tools" not in chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "qwen_3"
    if "<|python_tag|>" in chat_template or '"parameters"' in chat_template:
        return "llama"
    return None
