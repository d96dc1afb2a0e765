"""The choices of one OpenAI request (``n``): a daemon request each, run together, and the
server-sent events of their streams merged as their chunks come, each tagged with its index
(a chat request whose tools may be called: its content until a call may begin, then each
call as it is written, tools.py). Whatever ends a response early aborts the requests of every
choice not finished."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

import msgspec

from outrider.daemon.http.errors import STATUS_OF_CODE, error_body, public_message
from outrider.daemon.http.responses import Shape, merged_usage
from outrider.daemon.http.tools import CallStream
from outrider.protocol import (
    AsyncTokenStream,
    GenerateResult,
    RequestError,
    TokenChunk,
    TokenLogprob,
)

T = TypeVar("T")


def sse(body: Any) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


def close_all(streams: list[AsyncTokenStream]) -> None:
    """Abort the requests of the streams not finished yet."""
    for stream in streams:
        stream.close()


async def rest_of(stream: AsyncTokenStream) -> GenerateResult:
    """The result of a stream whose first chunk was read."""
    async for _ in stream:
        pass
    assert stream.result is not None
    return stream.result


async def every(calls: Sequence[Awaitable[T]]) -> list[T]:
    """Every call's result, run together; the first that raises cancels the others (which
    aborts their requests) and is raised."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def first_chunk(stream: AsyncTokenStream) -> TokenChunk | None:
    """A stream's first chunk (which sends its request); None: it ended without one (no
    token: its result is set)."""
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return None


async def sse_events(
    shape: Shape,
    streams: list[AsyncTokenStream],
    firsts: list[TokenChunk | None],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The events of one streamed response: each choice's chunks as they come (tagged with
    its index), its finish, then the usage of all and ``[DONE]``."""
    events: asyncio.Queue[tuple[int, TokenChunk | RequestError | None]] = asyncio.Queue()

    async def pump(index: int) -> None:
        stream, first = streams[index], firsts[index]
        try:
            if first is not None:
                await events.put((index, first))
                async for chunk in stream:
                    await events.put((index, chunk))
            await events.put((index, None))
        except RequestError as exc:
            await events.put((index, exc))

    pumps = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
    fmt = shape.tool_format if shape.chat else None
    calls = [CallStream(fmt) for _ in streams] if fmt is not None else None
    held: list[list[TokenLogprob]] = [[] for _ in streams]  # logprobs of text held back
    called = [0] * len(streams)  # calls the daemon parsed, sent (channels: tools.py)
    try:
        if shape.chat:
            for index in range(len(streams)):
                yield sse(with_usage(shape.chunk("", role=True, index=index), include_usage))
        for _ in range(len(streams)):
            while True:
                index, event = await events.get()
                if isinstance(event, RequestError):
                    raise event
                if event is None:
                    break
                if calls is None:
                    body = shape.token_chunk(event, index, called[index])
                    called[index] += len(event.tool_calls)
                    yield sse(with_usage(body, include_usage))
                    continue
                held[index] += event.logprobs or []
                piece, taken = calls[index].take(event.text)
                if piece or taken:
                    yield sse(with_usage(_delta(shape, piece, taken, held, index), include_usage))
            result = streams[index].result
            assert result is not None
            reason: str = result.finish_reason
            if calls is not None:
                rest, taken = calls[index].finish()
                if rest or taken or held[index]:
                    yield sse(with_usage(_delta(shape, rest, taken, held, index), include_usage))
                if calls[index].calls:
                    reason = "tool_calls"
            if called[index]:
                reason = "tool_calls"
            text = None if shape.chat else ""
            finish = shape.chunk(text, finish_reason=reason, index=index)
            yield sse(with_usage(finish, include_usage))
        if include_usage:
            usages = [stream.result.usage for stream in streams if stream.result is not None]
            yield sse(shape.usage_chunk(merged_usage(usages)))
    except RequestError as exc:
        status = STATUS_OF_CODE.get(exc.code, 500)
        yield b"data: " + error_body(status, public_message(exc), None, exc.code) + b"\n\n"
    finally:
        for task in pumps:
            task.cancel()
    yield b"data: [DONE]\n\n"


def _delta(
    shape: Shape,
    content: str,
    calls: list[dict[str, Any]],
    held: list[list[TokenLogprob]],
    index: int,
) -> dict[str, Any]:
    """A chunk of choice ``index``: its content and calls, with the logprobs held for it."""
    body = shape.chunk(content or None, held[index] or None, index=index)
    held[index] = []
    if calls:
        body["choices"][0]["delta"]["tool_calls"] = calls
    return body


def with_usage(chunk: dict[str, Any], include_usage: bool) -> dict[str, Any]:
    # With include_usage, every chunk but the last carries "usage": null (OpenAI's shape).
    return chunk | {"usage": None} if include_usage else chunk
