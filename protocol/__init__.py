"""outrider.protocol: the wire messages, the ZeroMQ client library, and the parser of tool
calls in a model's output (``parse_tool_calls``).

Depends on msgspec, pyzmq and the standard library only: a client never needs torch.
"""

from outrider.protocol._client_common import GenerateResult, TokenChunk
from outrider.protocol._connection import CONNECT_TIMEOUT_S, IDLE_TIMEOUT_S, REPLY_HWM
from outrider.protocol.async_client import AsyncClient, AsyncTokenStream
from outrider.protocol.client import Client, TokenStream
from outrider.protocol.endpoints import default_endpoint
from outrider.protocol.errors import NotListening, RequestError, Timeout
from outrider.protocol.messages import (
    PROTOCOL_VERSION,
    ChatMessage,
    Grammar,
    Health,
    ServerInfo,
    TokenLogprob,
    Tool,
    ToolCall,
    Usage,
)
from outrider.protocol.tool_calls import ParsedCall, parse_tool_calls

__all__ = [
    "CONNECT_TIMEOUT_S",
    "IDLE_TIMEOUT_S",
    "PROTOCOL_VERSION",
    "REPLY_HWM",
    "AsyncClient",
    "AsyncTokenStream",
    "ChatMessage",
    "Client",
    "GenerateResult",
    "Grammar",
    "Health",
    "NotListening",
    "ParsedCall",
    "RequestError",
    "ServerInfo",
    "Timeout",
    "TokenChunk",
    "TokenLogprob",
    "TokenStream",
    "Tool",
    "ToolCall",
    "Usage",
    "default_endpoint",
    "parse_tool_calls",
]
