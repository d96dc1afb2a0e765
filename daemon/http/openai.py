"""The OpenAI request shapes of the HTTP front (http/process.py) and their translation to the
client library's ``generate`` arguments (the responses: responses.py).

Sampling fields a request leaves out stay None on the way to the daemon, so that the model's
generation defaults apply there. ``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids`` and ``ignore_eos`` are extensions (vLLM's names), and ``max_drafts`` this
daemon's own (the drafted tokens a speculative step may accept for the request; 0 turns
speculation off for it); the daemon checks every value's range.

Structured output (``response_format``, vLLM's ``structured_outputs`` and ``guided_*``) goes
to the daemon as one grammar (structured.py); a chat request's tools as the client library's
tool arguments (tools.py).

Nothing a request sends is dropped in silence: a field these shapes do not know is refused
(400 naming it, as the OpenAI API itself answers), and a field of the API (or of vLLM's
extensions) that this front does not implement is accepted only at its neutral value
(``UNIMPLEMENTED``): ``best_of: 1`` changes nothing, ``best_of: 2`` is refused.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from outrider.daemon.http.errors import split_path
from outrider.daemon.http.structured import GrammarFieldError, StructuredFields, grammar_of
from outrider.daemon.http.tools import (
    ToolCallIn,
    ToolChoiceIn,
    ToolIn,
    message_calls,
    tools_kwargs,
)
from outrider.protocol.messages import (
    MAX_LOGPROBS,
    MAX_SEED,
    MAX_TOKEN_ID,
    Grammar,
    ReasoningEffort,
    Seed,
    TopK,
)

# Integers a request may give (``Count``, and the daemon's ``TopK`` and ``Seed``); wider ones
# would not fit in the daemon's frame (and the daemon would refuse them anyway), so they are
# refused here, by their OpenAI names.
Count = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
# Choices one request may ask for (``n``): each is a request of its own to the daemon.
MAX_CHOICES = 16
Choices = Annotated[int, Meta(ge=1, le=MAX_CHOICES)]

# --- requests -----------------------------------------------------------------------------


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str = ""


class ChatMessageIn(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls (tools.py)
    tool_call_id: str | None = None  # a tool message: the call it answers


class _Sampling(StructuredFields, forbid_unknown_fields=True):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Count] | None = None  # vLLM's extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Choices = 1
    ignore_eos: bool = False
    user: str | None = None  # the caller's end-user id: changes nothing here
    # Checked by the daemon (protocol 1.1); None: the neutral value.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    min_p: float | None = None
    max_drafts: int | None = None  # checked by the daemon (protocol 1.3); None: its own
    # Fields of ``UNIMPLEMENTED``: None when left out, checked by ``refuse_unimplemented``.
    min_tokens: Any = None
    best_of: Any = None
    suffix: Any = None
    functions: Any = None
    function_call: Any = None


class CompletionRequest(_Sampling):
    prompt: str | list[Any] = ""
    max_tokens: Count | None = 16  # the OpenAI default for completions
    logprobs: int | None = None
    echo: bool = False


class ChatRequest(_Sampling):
    messages: list[ChatMessageIn] = msgspec.field(default_factory=list)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoiceIn | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: ReasoningEffort | None = None  # the harmony format's (gpt-oss)


class InvalidRequest(ValueError):
    """A request the front refuses itself (400, or ``status``); ``param`` names the field."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str = ""
    ) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code or "invalid_request"


@dataclass(frozen=True)
class GenerateArgs:
    """The keyword arguments of ``AsyncClient.generate`` / ``stream`` for one request."""

    prompt: str | None
    input_ids: list[int] | None
    messages: list[dict[str, Any]] | None
    max_new_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int  # what the daemon is asked for: 0, or 1 + the alternatives wanted
    top_logprobs: int  # alternatives shown per token (<= logprobs)
    adjustments: dict[str, Any]  # min_p, the penalties and logit_bias a request gave
    n: int  # choices: one daemon request each
    grammar: Grammar | None  # structured output (structured.py)
    max_drafts: int | None  # the request's draft cap (None: the daemon's)
    tools: dict[str, Any] = field(default_factory=dict)  # tools.py's client arguments
    reasoning_effort: ReasoningEffort | None = None  # a chat's (protocol 1.4)

    @property
    def calls_tools(self) -> bool:
        """The model may (or must) call the request's tools: its answer is parsed for them."""
        return bool(self.tools.get("tools")) and self.tools.get("tool_choice") != "none"

    def choice_kwargs(self) -> list[dict[str, Any]]:
        """The client arguments of each choice: choice ``i`` draws with ``seed + i`` (a seed
        left out: one the daemon picks for each)."""
        one = self.client_kwargs()
        if self.seed is None:
            return [one] * self.n
        return [one | {"seed": (self.seed + i) % (MAX_SEED + 1)} for i in range(self.n)]

    def client_kwargs(self) -> dict[str, Any]:
        constrained = {} if self.grammar is None else {"grammar": self.grammar}
        return (
            self.adjustments
            | constrained
            | self.tools
            | {
                "prompt": self.prompt,
                "input_ids": self.input_ids,
                "messages": self.messages,
                "max_new_tokens": self.max_new_tokens,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "top_k": self.top_k,
                "seed": self.seed,
                "stop": self.stop,
                "stop_token_ids": self.stop_token_ids,
                "ignore_eos": self.ignore_eos,
                "logprobs": self.logprobs,
                "max_drafts": self.max_drafts,
                "reasoning_effort": self.reasoning_effort,
            }
        )


T = TypeVar("T")

_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `([^`]+)`")


def decode_request(body: bytes, kind: type[T], path_prefix: str = "") -> T:
    """``body`` decoded as ``kind``; raises ``InvalidRequest`` (with the offending field as
    ``param``, after ``path_prefix``) for anything else, whatever the bytes."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message, param = split_path(str(exc), prefix=path_prefix)
        unknown = _UNKNOWN_FIELD.match(message)
        if unknown is not None:
            name = unknown.group(1)
            param = f"{param}.{name}" if param else name
            message = f"{name} is not a field this server takes"
        raise InvalidRequest(message, param) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the body is not JSON: {exc}") from None
    # NOTE: msgspec passes invalid UTF-8 on as CPython's UnicodeDecodeError, and nesting past
    # the interpreter's recursion limit as RecursionError, even in a field it only skips.
    except UnicodeDecodeError:
        raise InvalidRequest("the body is not valid UTF-8") from None
    except RecursionError:
        raise InvalidRequest("the body is nested too deeply") from None


# The daemon's field names in its validation errors, as an OpenAI request names them.
DAEMON_FIELDS = {"max_new_tokens": "max_tokens", "input_ids": "prompt"}


# The logit adjustments of protocol 1.1, passed on by name when a request gives them.
ADJUSTMENT_FIELDS = (
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
)


# The fields this front knows but does not implement, each with the values that ask for
# nothing (a request may send those). ``functions`` and ``function_call`` are the API's
# older spelling of tools: a request sends ``tools`` instead.
UNIMPLEMENTED: dict[str, Callable[[Any], bool]] = {
    "min_tokens": lambda v: v == 0,
    "best_of": lambda v: v == 1,
    "suffix": lambda v: v == "",
    "functions": lambda v: v == [],
    "function_call": lambda v: v == "none",
}


def refuse_unimplemented(req: _Sampling) -> None:
    """Raises ``InvalidRequest`` naming the first field of ``UNIMPLEMENTED`` that asks for
    something (the front would otherwise answer as if it had been honoured)."""
    for name, neutral in UNIMPLEMENTED.items():
        value = getattr(req, name)
        if value is not None and not neutral(value):
            raise InvalidRequest(f"{name} is not supported by this server", name)


def _common_checks(req: _Sampling) -> None:
    refuse_unimplemented(req)
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options needs stream: true", "stream_options")


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def completion_args(req: CompletionRequest) -> GenerateArgs:
    _common_checks(req)
    if req.echo:
        raise InvalidRequest("echo is not supported", "echo")
    prompt: str | None = None
    input_ids: list[int] | None = None
    raw: Any = req.prompt
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
        raw = raw[0]  # a batch of one
    if isinstance(raw, str):
        prompt = raw
    elif isinstance(raw, list) and all(type(x) is int for x in raw):
        if not all(0 <= x <= MAX_TOKEN_ID for x in raw):
            raise InvalidRequest(f"prompt: token ids must be in [0, {MAX_TOKEN_ID}]", "prompt")
        input_ids = raw
    else:
        raise InvalidRequest(
            "prompt: a string, a list of token ids, or a batch of one of those", "prompt"
        )
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"logprobs must be in [0, {MAX_LOGPROBS}]", "logprobs")
    wanted = -1 if req.logprobs is None else req.logprobs
    return _args(req, prompt, input_ids, None, req.max_tokens, wanted)


def chat_turns(messages_in: list[ChatMessageIn]) -> list[dict[str, Any]]:
    """The messages as the daemon's chat template takes them (text parts joined)."""
    messages = []
    for i, msg in enumerate(messages_in):
        content = msg.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise InvalidRequest("only text content parts are supported", f"messages[{i}]")
            content = "".join(part.text for part in content)
        turn: dict[str, Any] = {"role": msg.role, "content": content or ""}
        if msg.tool_calls:
            turn["tool_calls"] = message_calls(msg.tool_calls)
        if msg.tool_call_id is not None:
            turn["tool_call_id"] = msg.tool_call_id
        messages.append(turn)
    if not messages:
        raise InvalidRequest("messages must not be empty", "messages")
    return messages


def chat_args(req: ChatRequest) -> GenerateArgs:
    _common_checks(req)
    messages = chat_turns(req.messages)
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
    wanted = (req.top_logprobs or 0) if req.logprobs else -1
    max_tokens = req.max_completion_tokens
    if max_tokens is None:
        max_tokens = req.max_tokens
    args = _args(req, None, None, messages, max_tokens, wanted)
    tools = tools_kwargs(req.tools, req.tool_choice, req.parallel_tool_calls)
    return replace(args, tools=tools, reasoning_effort=req.reasoning_effort)


def _args(
    req: _Sampling,
    prompt: str | None,
    input_ids: list[int] | None,
    messages: list[dict[str, Any]] | None,
    max_tokens: int | None,
    top_wanted: int,  # -1: no logprobs
) -> GenerateArgs:
    return GenerateArgs(
        prompt=prompt,
        input_ids=input_ids,
        messages=messages,
        max_new_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop=_stop_list(req.stop),
        stop_token_ids=req.stop_token_ids or [],
        ignore_eos=req.ignore_eos,
        # The daemon's logprobs=N: the chosen token's logprob and N alternatives (0: none at
        # all), so 0 alternatives shown still asks for 1.
        logprobs=0 if top_wanted < 0 else max(top_wanted, 1),
        top_logprobs=max(top_wanted, 0),
        adjustments={
            name: value for name in ADJUSTMENT_FIELDS if (value := getattr(req, name)) is not None
        },
        n=req.n,
        grammar=_grammar(req),
        max_drafts=req.max_drafts,
    )


def _grammar(req: _Sampling) -> Grammar | None:
    try:
        return grammar_of(req)
    except GrammarFieldError as exc:
        raise InvalidRequest(str(exc), exc.param) from None
