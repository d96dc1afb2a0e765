"""outrider.protocol: the wire messages and the ZeroMQ client library.

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
]
