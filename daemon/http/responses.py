"""The OpenAI response shapes of the HTTP front: a response's or chunk's body (``Shape``),
usage and logprobs in the API's form, and the token texts logprobs show.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outrider.daemon.http.tools import answer_with_calls, channel_delta, channel_message
from outrider.protocol import GenerateResult, TokenChunk
from outrider.protocol.messages import TokenLogprob, Usage
from outrider.protocol.tool_calls import ToolCallFormat


class TokenTexts:
    """Token id -> its text, for logprobs. Without the model's ``tokenizer.json`` (tokenizers
    only, no transformers) a token reads ``token_id:N``, as vLLM writes it."""

    def __init__(self, model_dir: str | None) -> None:
        self._backend: Any = None
        path = Path(model_dir) / "tokenizer.json" if model_dir else None
        if path is not None and path.is_file():
            from tokenizers import Tokenizer

            self._backend = Tokenizer.from_file(str(path))

    def text(self, token_id: int) -> str:
        if self._backend is None:
            return f"token_id:{token_id}"
        return str(self._backend.decode([token_id], skip_special_tokens=False))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage_body(usage: Usage) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if usage.spec_drafts:
        body["spec_drafts"] = usage.spec_drafts
        body["spec_accepted_tokens"] = usage.spec_accepted_tokens
    return body


def merged_usage(usages: list[Usage]) -> Usage:
    """One response's usage over its choices: the prompt (and its cached part) once, as
    the first choice counted it; the completion tokens and the drafts of every choice."""
    first = usages[0]
    return Usage(
        prompt_tokens=first.prompt_tokens,
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=first.cached_tokens,
        spec_drafts=sum(u.spec_drafts for u in usages),
        spec_accepted_tokens=sum(u.spec_accepted_tokens for u in usages),
    )


def chat_logprobs(
    logprobs: list[TokenLogprob] | None, top: int, texts: TokenTexts
) -> dict[str, Any] | None:
    if logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = texts.text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            entry(lp.token_id, lp.logprob)
            | {"top_logprobs": [entry(t, v) for t, v in lp.top[:top]]}
            for lp in logprobs
        ]
    }


def completion_logprobs(
    logprobs: list[TokenLogprob] | None, top: int, texts: TokenTexts, offset: int = 0
) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    tokens = [texts.text(lp.token_id) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{texts.text(t): v for t, v in lp.top[:top]} for lp in logprobs],
        "text_offset": offsets,
    }


@dataclass(frozen=True)
class Shape:
    """What one response (or stream) of an endpoint is made of."""

    chat: bool
    request_id: str
    model: str
    created: int
    top_logprobs: int
    texts: TokenTexts
    # The model's tool-call format, where the request's tools may be called (tools.py).
    tool_format: ToolCallFormat | None = None

    def _head(self, streamed: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if streamed else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if self.chat:
            return chat_logprobs(logprobs, self.top_logprobs, self.texts)
        return completion_logprobs(logprobs, self.top_logprobs, self.texts)

    def full(self, results: list[GenerateResult]) -> dict[str, Any]:
        """The non-streamed response: a choice per result."""
        choices = []
        for index, result in enumerate(results):
            choice: dict[str, Any] = {"index": index}
            finish_reason: str = result.finish_reason
            if self.chat and self.tool_format is not None:
                choice["message"], finish_reason = answer_with_calls(self.tool_format, result)
            elif self.chat:
                choice["message"], finish_reason = channel_message(result)
            else:
                choice["text"] = result.text
            choice["logprobs"] = self._logprobs(result.logprobs)
            choice["finish_reason"] = finish_reason
            choices.append(choice)
        usage = merged_usage([r.usage for r in results])
        return self._head(False) | {"choices": choices, "usage": usage_body(usage)}

    def chunk(
        self,
        text: str | None,
        logprobs: list[TokenLogprob] | None = None,
        finish_reason: str | None = None,
        role: bool = False,
        index: int = 0,
    ) -> dict[str, Any]:
        """One streamed chunk of choice ``index`` (``text`` None: an empty delta)."""
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice["logprobs"] = self._logprobs(logprobs)
        choice["finish_reason"] = finish_reason
        return self._head(True) | {"choices": [choice]}

    def token_chunk(self, chunk: TokenChunk, index: int = 0, first_call: int = 0) -> dict[str, Any]:
        """``chunk`` as choice ``index``'s (``first_call``: the index of its first tool call,
        where the daemon split the output into channels)."""
        body = self.chunk(chunk.text, chunk.logprobs, index=index)
        if self.chat and (chunk.reasoning or chunk.tool_calls):
            body["choices"][0]["delta"] = channel_delta(chunk, first_call)
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._head(True) | {"choices": [], "usage": usage_body(usage)}
