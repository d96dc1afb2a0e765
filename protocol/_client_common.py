"""What ``Client`` and ``AsyncClient`` share above the socket: the result and chunk types they
hand back, building and validating the requests they send, and turning replies into results
or ``RequestError``. Nothing here blocks or awaits.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import TypeVar

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
    HealthQuery,
    ServerInfoQuery,
    TokenLogprob,
    Usage,
)

CurveKey = bytes | str
R = TypeVar("R", bound=ClientReply)


class GenerateResult(msgspec.Struct, frozen=True):
    """The outcome of one generation request (the daemon's ``Finished`` frame)."""

    request_id: str
    output_ids: list[int]
    text: str
    finish_reason: FinishReason
    matched_stop: str | int | None
    usage: Usage
    logprobs: list[TokenLogprob] | None


class TokenChunk(msgspec.Struct, frozen=True):
    """Tokens committed since the previous chunk of a streamed request."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None


def new_id() -> str:
    return uuid.uuid4().hex


def abort_request(target_id: str) -> Abort:
    return Abort(request_id=new_id(), target_id=target_id)


def health_query() -> HealthQuery:
    return HealthQuery(request_id=new_id())


def server_info_query() -> ServerInfoQuery:
    return ServerInfoQuery(request_id=new_id())


def generate_request(
    *,
    prompt: str | None,
    input_ids: Sequence[int] | None,
    messages: Sequence[ChatMessage | Mapping[str, str]] | None,
    request_id: str | None,
    stream: bool,
    max_new_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
    stop: str | Sequence[str],
    stop_token_ids: Sequence[int],
    ignore_eos: bool,
    logprobs: int,
) -> Generate:
    """The ``Generate`` frame for the arguments of ``generate`` / ``stream``; raises
    ``RequestError('invalid_request')`` unless exactly one prompt form is given and valid."""
    request_id = request_id if request_id is not None else new_id()
    if sum(x is not None for x in (prompt, input_ids, messages)) != 1:
        raise RequestError(
            "invalid_request", "give exactly one of prompt, input_ids, messages", request_id
        )
    chat: list[ChatMessage] | None = None
    if messages is not None:
        try:
            chat = [
                m if isinstance(m, ChatMessage) else msgspec.convert(m, ChatMessage)
                for m in messages
            ]
        except msgspec.ValidationError as exc:
            raise RequestError("invalid_request", f"messages: {exc}", request_id) from None
    return Generate(
        request_id=request_id,
        prompt=prompt,
        input_ids=list(input_ids) if input_ids is not None else None,
        messages=chat,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=[stop] if isinstance(stop, str) else list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        stream=stream,
    )


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
    )


def to_chunk(reply: Chunk) -> TokenChunk:
    return TokenChunk(
        request_id=reply.request_id,
        token_ids=reply.token_ids,
        text=reply.text,
        logprobs=reply.logprobs,
    )
