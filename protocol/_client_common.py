"""What ``Client`` and ``AsyncClient`` share above the socket: the result and chunk types they
hand back, building and validating the requests they send, and turning replies into results
or ``RequestError``. ``GenerateCall`` is the one description of the arguments of
``generate`` and ``stream``; ``takes_generate_arguments`` gives both clients' methods its
parameters. Nothing here blocks or awaits.
"""

from __future__ import annotations

import functools
import inspect
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Concatenate, ParamSpec, TypeVar, cast

import msgspec

from outrider.protocol.errors import RequestError
from outrider.protocol.messages import (
    Abort,
    ChatMessage,
    Chunk,
    ClientReply,
    Error,
    Finished,
    FinishReason,
    Generate,
    Grammar,
    HealthQuery,
    ReasoningEffort,
    ServerInfoQuery,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolChoice,
    Usage,
)

CurveKey = bytes | str
R = TypeVar("R", bound=ClientReply)
P = ParamSpec("P")
A = TypeVar("A")
S = TypeVar("S")
T = TypeVar("T")


class GenerateResult(msgspec.Struct, frozen=True):
    """The outcome of one generation request (the daemon's ``Finished`` frame)."""

    request_id: str
    output_ids: list[int]
    text: str
    finish_reason: FinishReason
    matched_stop: str | int | None
    usage: Usage
    logprobs: list[TokenLogprob] | None
    # A chat answer of a model whose output has channels (``Chunk``): its reasoning and calls.
    reasoning: str = ""
    tool_calls: list[ToolCall] = []


class TokenChunk(msgspec.Struct, frozen=True):
    """Tokens committed since the previous chunk of a streamed request."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    reasoning: str = ""
    tool_calls: list[ToolCall] = []


def new_id() -> str:
    return uuid.uuid4().hex


def abort_request(target_id: str) -> Abort:
    return Abort(request_id=new_id(), target_id=target_id)


def health_query() -> HealthQuery:
    return HealthQuery(request_id=new_id())


def server_info_query() -> ServerInfoQuery:
    return ServerInfoQuery(request_id=new_id())


@dataclass(frozen=True)
class GenerateCall:
    """The arguments of ``generate`` and ``stream`` (both clients): one generation request
    and the ``timeout`` of the call that sends it."""

    prompt: str | None = None
    _: KW_ONLY
    input_ids: Sequence[int] | None = None
    messages: Sequence[ChatMessage | Mapping[str, str]] | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    grammar: Grammar | None = None
    tools: Sequence[Tool] = ()
    tool_choice: ToolChoice = "auto"
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    max_drafts: int | None = None
    reasoning_effort: ReasoningEffort | None = None
    request_id: str | None = None
    timeout: float | None = None

    def request(self, *, stream: bool) -> Generate:
        """The ``Generate`` frame; raises ``RequestError('invalid_request')`` unless exactly
        one prompt form is given and valid."""
        request_id = self.request_id if self.request_id is not None else new_id()
        if sum(x is not None for x in (self.prompt, self.input_ids, self.messages)) != 1:
            raise RequestError(
                "invalid_request", "give exactly one of prompt, input_ids, messages", request_id
            )
        chat: list[ChatMessage] | None = None
        if self.messages is not None:
            try:
                chat = [
                    m if isinstance(m, ChatMessage) else msgspec.convert(m, ChatMessage)
                    for m in self.messages
                ]
            except msgspec.ValidationError as exc:
                raise RequestError("invalid_request", f"messages: {exc}", request_id) from None
        return Generate(
            request_id=request_id,
            prompt=self.prompt,
            input_ids=list(self.input_ids) if self.input_ids is not None else None,
            messages=chat,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            stream=stream,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=dict(self.logit_bias or {}),
            grammar=self.grammar,
            tools=list(self.tools),
            tool_choice=self.tool_choice,
            tool_name=self.tool_name,
            parallel_tool_calls=self.parallel_tool_calls,
            max_drafts=self.max_drafts,
            reasoning_effort=self.reasoning_effort,
        )


def _taking_arguments_of(
    build: Callable[P, A],
) -> Callable[[Callable[[S, A], T]], Callable[Concatenate[S, P], T]]:
    """A decorator: the method ``(self, built)`` becomes ``(self, *args, **kwargs)`` with the
    parameters of ``build`` (for type checkers and ``help()``), and is handed
    ``build(*args, **kwargs)``. A coroutine function stays one: ``build`` then runs when the
    call is awaited, as a body would."""
    parameters = list(inspect.signature(build).parameters.values())

    def decorate(method: Callable[[S, A], T]) -> Callable[Concatenate[S, P], T]:
        def call(self: S, *args: P.args, **kwargs: P.kwargs) -> T:
            return method(self, build(*args, **kwargs))

        async def call_async(self: S, *args: P.args, **kwargs: P.kwargs) -> object:
            return await cast(Awaitable[object], method(self, build(*args, **kwargs)))

        # NOTE: the async wrapper's result is the coroutine T stands for.
        wrapper = (
            cast(Callable[Concatenate[S, P], T], call_async)
            if inspect.iscoroutinefunction(method)
            else call
        )
        functools.update_wrapper(wrapper, method)
        self_parameter = next(iter(inspect.signature(method).parameters.values()))
        # NOTE: inspect.signature (help()) stops at __signature__; without it, it would follow
        # __wrapped__ to (self, built). mypy does not model the attribute on a function.
        wrapper.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [self_parameter, *parameters],
            return_annotation=inspect.signature(method).return_annotation,
        )
        return wrapper

    return decorate


# The parameters of GenerateCall for a method (self, call: GenerateCall); see
# _taking_arguments_of.
takes_generate_arguments = _taking_arguments_of(GenerateCall)


def expect(reply: ClientReply, kind: type[R]) -> R:
    """``reply`` if it is a ``kind``; otherwise the ``RequestError`` it stands for."""
    if isinstance(reply, kind):
        return reply
    if isinstance(reply, Error):
        raise RequestError(reply.code, reply.message, reply.request_id)
    raise RequestError("malformed", f"unexpected {type(reply).__name__} reply", reply.request_id)


def to_result(reply: ClientReply) -> GenerateResult:
    done = expect(reply, Finished)
    return GenerateResult(
        request_id=done.request_id,
        output_ids=done.output_ids,
        text=done.text,
        finish_reason=done.finish_reason,
        matched_stop=done.matched_stop,
        usage=done.usage,
        logprobs=done.logprobs,
        reasoning=done.reasoning,
        tool_calls=done.tool_calls,
    )


def to_chunk(reply: Chunk) -> TokenChunk:
    return TokenChunk(
        request_id=reply.request_id,
        token_ids=reply.token_ids,
        text=reply.text,
        logprobs=reply.logprobs,
        reasoning=reply.reasoning,
        tool_calls=reply.tool_calls,
    )
