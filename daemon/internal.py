"""Messages of the internal pipes (never reused on the client socket).

```
front door (tokenizer process) --ToDaemon--> daemon --Outputs--> detokenizer --Outputs--> front door
daemon --Control--> front door
```
A request is keyed inside the daemon by ``rid``, an integer the front door assigns; only the
front door maps it back to (client identity, client request id).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from msgspec import Struct

from outrider.plugins.sampling_spec import SamplingSpec
from outrider.protocol.frames import FrameCodec
from outrider.protocol.messages import (
    ErrorCode,
    FinishReason,
    Grammar,
    TokenLogprob,
    Tool,
    Usage,
)

FAMILY_TO_DAEMON = 3
FAMILY_OUTPUTS = 4
FAMILY_CONTROL = 5


class TokenizedRequest(Struct, array_like=True, tag=1, frozen=True):
    rid: int
    request_id: str
    input_ids: list[int]
    sampling: SamplingSpec
    max_new_tokens: int | None  # None: until a stop condition or the context limit
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    stream: bool
    want_logprobs: bool
    arrival: float  # time.time() at the front door
    grammar: Grammar | None = None  # compiled by the daemon (daemon/grammar/)
    tools: ToolUse | None = None  # its calls held to their schemas (daemon/grammar/)
    # The most drafts a step may commit for it (0: speculation off); None: the engine's.
    max_drafts: int | None = None
    # A chat whose output is in the harmony format: its grammar holds the final message
    # alone, its tools' calls are in that format (daemon/grammar/channels.py).
    harmony: bool = False


class ToolUse(Struct, array_like=True, frozen=True):
    """A chat request's tools as the daemon constrains their calls: in the model's
    ``format`` (daemon/grammar/tool_calls.py), ``choice`` ``auto`` (it may call) or ``required`` (at
    least one call; ``name``: that function's), one call or several (``parallel``)."""

    format: str
    tools: list[Tool]
    choice: Literal["auto", "required"]
    name: str | None
    parallel: bool


class FinalMessage(Struct, array_like=True, frozen=True):
    """``grammar`` held to the final message of an output in the harmony format, the
    messages before it free (daemon/grammar/channels.py)."""

    grammar: Grammar


GREEDY = SamplingSpec()


def own_request(
    rid: int,
    request_id: str,
    input_ids: list[int],
    max_new_tokens: int | None,
    sampling: SamplingSpec = GREEDY,
) -> TokenizedRequest:
    """A request the daemon makes itself (warm-up, start-up timing, benchmarks): no stop
    condition but the length, nothing streamed, logprobs when ``sampling`` asks for some."""
    return TokenizedRequest(
        rid=rid,
        request_id=request_id,
        input_ids=input_ids,
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        stop=[],
        stop_token_ids=[],
        ignore_eos=True,
        stream=False,
        want_logprobs=sampling.logprobs > 0,
        arrival=time.time(),
    )


class AbortRid(Struct, array_like=True, tag=2, frozen=True):
    rid: int
    reason: str


class InfoQuery(Struct, array_like=True, tag=3, frozen=True):
    query_id: int


ToDaemon = TokenizedRequest | AbortRid | InfoQuery


class FinishInfo(Struct, array_like=True, frozen=True, gc=False):
    reason: FinishReason
    matched_stop: str | int | None
    usage: Usage
    # Character offset at which the text is cut (a matched stop string), else None.
    text_cut: int | None = None
    # time.time() when its first token was committed (0.0: none was): the front door's time to
    # first token of a request it did not stream, whose tokens it sees only at the end.
    first_token_at: float = 0.0


class ErrorInfo(Struct, array_like=True, frozen=True, gc=False):
    code: ErrorCode
    message: str


class RequestUpdate(Struct, array_like=True, gc=False):
    """New committed tokens of one request; final when ``finish`` or ``error`` is set."""

    rid: int
    token_ids: list[int]
    text: str = ""  # filled in by the detokenizer
    logprobs: list[TokenLogprob] | None = None
    finish: FinishInfo | None = None
    error: ErrorInfo | None = None

    @property
    def is_final(self) -> bool:
        return self.finish is not None or self.error is not None


class Outputs(Struct, array_like=True, tag=1):
    updates: list[RequestUpdate]


class Counters(Struct, array_like=True, frozen=True, gc=False):
    running: int = 0
    waiting: int = 0
    kv_used_tokens: int = 0
    kv_total_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    requests_finished: dict[str, int] = {}
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []


class ModelFacts(Struct, array_like=True, tag=1, frozen=True):
    """Sent once after loading: everything the front door validates against."""

    model: str
    vocab_size: int  # valid token ids are [0, vocab_size)
    context_length: int
    kv_total_tokens: int
    eos_token_ids: list[int]
    tokenizer_dir: str | None  # None: token ids only
    max_new_tokens_default: int | None
    configuration: dict[str, Any]
    plugins: dict[str, str]
    speculative_algorithm: str


class StateChange(Struct, array_like=True, tag=2, frozen=True):
    state: Literal["ready", "draining"]


class Heartbeat(Struct, array_like=True, tag=3, frozen=True):
    counters: Counters


class InfoReply(Struct, array_like=True, tag=4, frozen=True):
    query_id: int
    counters: Counters


Control = ModelFacts | StateChange | Heartbeat | InfoReply


def to_daemon_codec() -> FrameCodec[ToDaemon]:
    return FrameCodec(FAMILY_TO_DAEMON, ToDaemon)


def outputs_codec() -> FrameCodec[Outputs]:
    return FrameCodec(FAMILY_OUTPUTS, Outputs)


def control_codec() -> FrameCodec[Control]:
    return FrameCodec(FAMILY_CONTROL, Control)


# --- child -> parent (the multiprocessing pipe each child is spawned with) -----------------

FAMILY_CHILD_STATUS = 6


ChildState = Literal["started", "serving", "alive", "bind_failed"]


class ChildStatus(Struct, array_like=True, frozen=True, gc=False):
    """A child's report to the daemon over its spawn pipe (``Connection.send_bytes``).

    ``started``: the child's internal sockets are bound. ``serving`` (front door, HTTP
    front): the client (or HTTP) socket is bound at ``endpoint`` (the resolved address, e.g. a
    TCP port chosen by the system for port 0). ``bind_failed`` (front door, HTTP front): the
    socket could not be bound; ``error`` says why (e.g. "Address already in use"), and the
    child stays up, without a client socket, until the daemon stops it. ``alive``: a
    heartbeat from the child's event loop, every ``CHILD_HEARTBEAT_S`` (processes/child_runtime.py).
    ``torch_imported`` must be False: children never import torch.
    """

    child: Literal["frontdoor", "detokenizer", "http"]
    pid: int
    state: ChildState
    torch_imported: bool
    endpoint: str = ""
    error: str = ""


def child_status_codec() -> FrameCodec[ChildStatus]:
    return FrameCodec(FAMILY_CHILD_STATUS, ChildStatus)
