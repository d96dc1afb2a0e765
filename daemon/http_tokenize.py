"""``/tokenize`` and ``/detokenize`` of the HTTP front, in vLLM's shapes.

    POST /tokenize   {"prompt": str} | {"messages": [...]}
                     -> {"count": n, "max_model_len": L, "tokens": [...]}
    POST /detokenize {"tokens": [...]} -> {"prompt": str}

The ids are the daemon's: the HTTP process loads the same tokenizer files the front door does
(``load_tokenizer`` on the model directory) and calls the same two methods, ``encode_prompt``
for a prompt and ``apply_chat_template`` (with the generation prompt) for messages, so
``count`` is what a ``/v1/completions`` or ``/v1/chat/completions`` request with that input
would get as ``usage.prompt_tokens``.

NOTE: a transformers tokenizer must not be used from two threads at once; every call runs on
the one worker thread of ``Tokenization``, off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec

from outrider.daemon.http_openai import ChatMessageIn, InvalidRequest, chat_turns
from outrider.daemon.tokenizer import ChatTemplateError, Tokenizer, load_tokenizer

T = TypeVar("T")


class TokenizeRequest(msgspec.Struct):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None


class DetokenizeRequest(msgspec.Struct):
    tokens: list[int]
    model: str | None = None


class Tokenization:
    """The daemon's tokenizer in the HTTP process (None: the model has none)."""

    def __init__(self, model_dir: str | None) -> None:
        self._tokenizer: Tokenizer | None = load_tokenizer(model_dir) if model_dir else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="http-tokenize")

    def _require(self) -> Tokenizer:
        if self._tokenizer is None:
            raise InvalidRequest(
                "this model has no tokenizer: the daemon serves token ids only",
                code="unsupported",
            )
        return self._tokenizer

    async def tokenize(self, req: TokenizeRequest) -> list[int]:
        """Raises ``InvalidRequest``."""
        tokenizer = self._require()
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("exactly one of prompt and messages must be set", "prompt")
        if req.prompt is not None:
            return await self._run(tokenizer.encode_prompt, req.prompt)
        assert req.messages is not None
        turns = chat_turns(req.messages)
        try:
            return await self._run(tokenizer.apply_chat_template, turns)
        except ChatTemplateError as exc:
            raise InvalidRequest(f"chat template failed: {exc}", "messages") from None

    async def detokenize(self, req: DetokenizeRequest) -> str:
        """The text of ``req.tokens``, special tokens included; raises ``InvalidRequest`` for
        an id the tokenizer does not know."""
        tokenizer = self._require()
        known = len(tokenizer)
        for i, token_id in enumerate(req.tokens):
            if not 0 <= token_id < known:
                raise InvalidRequest(
                    f"tokens[{i}] = {token_id} is out of range: the tokenizer knows ids "
                    f"[0, {known})",
                    "tokens",
                )
        return await self._run(tokenizer.backend.decode, req.tokens, False)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
