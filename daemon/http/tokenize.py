"""``/tokenize`` and ``/detokenize`` of the HTTP front, in vLLM's shapes.

    POST /tokenize   {"prompt": str} | {"messages": [...]}
                     -> {"count": n, "max_model_len": L, "tokens": [...]}
    POST /detokenize {"tokens": [...]} -> {"prompt": str}

The ids are the daemon's: the HTTP process loads the same tokenizer files the front door does
(``load_tokenizer`` on the model directory) and calls the same two methods, ``encode_prompt``
for a prompt and ``apply_chat_template`` (with the generation prompt) for messages, so
``count`` is what a ``/v1/completions`` or ``/v1/chat/completions`` request with that input
would get as ``usage.prompt_tokens``.

Limits: both answer at most ``max_tokens`` ids (``--http-max-tokenize-tokens``), and the work
spent on a longer input is bounded by the limit, not by the input. A text with more
characters than ``max_tokens`` tokens can hold (``prompt_char_limit``) is refused at once; a
longer text than ``PIECE_CHARS`` is counted piece by piece first (cut at a space before a
word, where pre-tokenizers split anyway; each cut may add up to ``CUT_TOKENS`` tokens) and
refused as soon as its pieces hold more than ``max_tokens``, so that no more than about
``max_tokens`` tokens' worth of it is ever tokenized. A ``tokens`` list longer than
``max_tokens`` is refused before its ids are decoded. All work proportional to the input
(decoding the body, the range check, the tokenizer) runs on the one worker thread of
``Tokenization``, off the event loop, with at most ``MAX_QUEUED`` requests queued there
(more: 429).

NOTE: a transformers tokenizer must not be used from two threads at once; every call runs on
the one worker thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec

from outrider.daemon.frontdoor.validation import prompt_char_limit
from outrider.daemon.http.openai import ChatMessageIn, InvalidRequest, chat_turns, decode_request
from outrider.daemon.tokenizer import ChatTemplateError, Tokenizer, load_tokenizer

T = TypeVar("T")

# Requests queued on (or running in) the worker at once.
MAX_QUEUED = 4
PIECE_CHARS = 2**16
# Tokens a cut at a space before a word may add: none for byte-level BPE (the pre-tokenizer
# splits there too), one for a Metaspace tokenizer that prefixes every text with a space.
CUT_TOKENS = 2

CheckModel = Callable[[str | None], None]


class TokenizeRequest(msgspec.Struct):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None


class _DetokenizeHead(msgspec.Struct):
    tokens: msgspec.Raw  # decoded once its length is known to be within the limit
    model: str | None = None


def _cut(text: str, near: int) -> int:
    """A cut of ``text`` at or before ``near``: before a space that precedes a word, else at
    ``near`` itself."""
    lowest = max(near - PIECE_CHARS // 2, 1)
    at = text.rfind(" ", lowest, near)
    while at > lowest and (text[at - 1].isspace() or text[at + 1 : at + 2].isspace()):
        at = text.rfind(" ", lowest, at)
    return at if at > lowest else near


class Tokenization:
    """The daemon's tokenizer in the HTTP process (None: the model has none)."""

    def __init__(self, model_dir: str | None, max_tokens: int) -> None:
        self._tokenizer: Tokenizer | None = load_tokenizer(model_dir) if model_dir else None
        self._max_tokens = max_tokens
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="http-tokenize")
        self._queued = 0

    def _require(self) -> Tokenizer:
        if self._tokenizer is None:
            raise InvalidRequest(
                "this model has no tokenizer: the daemon serves token ids only",
                code="unsupported",
            )
        return self._tokenizer

    async def tokenize(self, body: bytes, check_model: CheckModel) -> list[int]:
        """The ids of a ``/tokenize`` body; raises ``InvalidRequest``."""
        return await self._run(self._tokenize, body, check_model)

    async def detokenize(self, body: bytes, check_model: CheckModel) -> str:
        """The text of a ``/detokenize`` body's ids, special tokens included; raises
        ``InvalidRequest`` (an id the tokenizer does not know, too many ids)."""
        return await self._run(self._detokenize, body, check_model)

    def _tokenize(self, body: bytes, check_model: CheckModel) -> list[int]:
        req = decode_request(body, TokenizeRequest)
        check_model(req.model)
        tokenizer = self._require()
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("exactly one of prompt and messages must be set", "prompt")
        if req.prompt is not None:
            self._check_length(tokenizer, req.prompt, "prompt")
            ids = tokenizer.encode_prompt(req.prompt)
        else:
            assert req.messages is not None
            turns = chat_turns(req.messages)
            # The template only adds to the contents' tokens.
            self._check_length(tokenizer, "\n".join(t["content"] for t in turns), "messages")
            try:
                ids = tokenizer.apply_chat_template(turns)
            except ChatTemplateError as exc:
                raise InvalidRequest(f"chat template failed: {exc}", "messages") from None
        if len(ids) > self._max_tokens:
            raise self._too_many(len(ids), "prompt" if req.prompt is not None else "messages")
        return ids

    def _check_length(self, tokenizer: Tokenizer, text: str, param: str) -> None:
        """Raises unless ``text`` may have at most ``max_tokens`` tokens (the module
        docstring says how, in bounded work)."""
        if len(text) > prompt_char_limit(tokenizer, self._max_tokens + 1):
            raise self._too_many(None, param)
        counted, start, cuts = 0, 0, 0
        while len(text) - start > PIECE_CHARS:
            end = _cut(text, start + PIECE_CHARS)
            piece = tokenizer.backend.encode(text[start:end], add_special_tokens=False)
            counted += len(piece.ids)
            if counted - cuts * CUT_TOKENS > self._max_tokens:
                raise self._too_many(None, param)
            start, cuts = end, cuts + 1

    def _detokenize(self, body: bytes, check_model: CheckModel) -> str:
        head = decode_request(body, _DetokenizeHead)
        check_model(head.model)
        tokenizer = self._require()
        raw = bytes(head.tokens)
        # The commas bound the ids of a JSON array of integers (anything else fails below).
        if raw.count(b",") + 1 > self._max_tokens:
            raise self._too_many(None, "tokens")
        tokens = decode_request(raw, list[int], path_prefix="tokens")
        if len(tokens) > self._max_tokens:
            raise self._too_many(len(tokens), "tokens")
        known = len(tokenizer)
        if tokens and not (min(tokens) >= 0 and max(tokens) < known):
            i, token_id = next((i, t) for i, t in enumerate(tokens) if not 0 <= t < known)
            raise InvalidRequest(
                f"tokens[{i}] = {token_id} is out of range: the tokenizer knows ids [0, {known})",
                "tokens",
            )
        return str(tokenizer.backend.decode(tokens, False))

    def _too_many(self, count: int | None, param: str) -> InvalidRequest:
        found = "" if count is None else f" ({count})"
        return InvalidRequest(
            f"more than {self._max_tokens} tokens{found} (--http-max-tokenize-tokens)", param
        )

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._queued >= MAX_QUEUED:
            raise InvalidRequest(
                "too many /tokenize and /detokenize requests at once", status=429, code="overloaded"
            )
        work = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        self._queued += 1
        work.add_done_callback(self._done)
        # NOTE: shielded, so that a client that goes away does not free its slot while the
        # worker still runs its request.
        return await asyncio.shield(work)

    def _done(self, work: asyncio.Future[Any]) -> None:
        self._queued -= 1
        if not work.cancelled():
            work.exception()  # retrieved: an abandoned request's error is not logged

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
