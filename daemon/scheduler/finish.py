"""The single finish check of a committed run of tokens (ARCHITECTURE.md 4.4).

Tokens are scanned one by one; the first index at which any condition holds ends the request.
At one index the precedence is: abort > invalid token > stop string > stop token / EOS >
max_new_tokens > context limit. ``output_ids`` keeps tokens through that index; the text is cut
before a matched stop string (the detokenizer trims at ``text_cut``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from outrider.daemon.scheduler.request import Request
from outrider.protocol.messages import FinishReason


class TextDecoder(Protocol):
    """Incremental detokenizer shared with the detokenizer process (same text, same offsets)."""

    def step(self, token_id: int) -> str: ...


@dataclass(frozen=True)
class Finish:
    reason: FinishReason
    matched_stop: str | int | None = None
    text_cut: int | None = None


class StopStrings:
    """Matches a request's stop strings over its decoded output, and says how many output
    tokens are safe to stream (their text cannot be the start of a stop string)."""

    def __init__(self, stops: list[str], decoder: TextDecoder) -> None:
        self.stops = stops
        self.decoder = decoder
        self.text = ""
        self.ends: list[int] = []  # text length after each output token
        self._longest = max(len(s) for s in stops)

    def push(self, token_id: int) -> tuple[str, int] | None:
        """Append one token; return (stop string, cut offset) of the earliest match, if any."""
        start = max(0, len(self.text) - self._longest + 1)
        self.text += self.decoder.step(token_id)
        self.ends.append(len(self.text))
        best: tuple[str, int] | None = None
        for stop in self.stops:
            at = self.text.find(stop, start)
            if at >= 0 and (best is None or at < best[1]):
                best = (stop, at)
        return best

    def safe_tokens(self) -> int:
        """Output tokens whose text ends before any suffix that could begin a stop string."""
        held = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:k]):
                    held = max(held, k)
                    break
        limit = len(self.text) - held
        count = 0
        while count < len(self.ends) and self.ends[count] <= limit:
            count += 1
        return count


class FinishChecker:
    def __init__(
        self,
        eos_ids: frozenset[int],
        context_length: int,
        decoder_factory: Callable[[], TextDecoder] | None,
    ) -> None:
        self.eos_ids = eos_ids
        self.context_length = context_length
        self.decoder_factory = decoder_factory
        self._stops: dict[int, StopStrings] = {}

    def stop_strings(self, req: Request) -> StopStrings | None:
        if not req.stop or self.decoder_factory is None:
            return None
        matcher = self._stops.get(req.rid)
        if matcher is None:
            matcher = self._stops[req.rid] = StopStrings(req.stop, self.decoder_factory())
        return matcher

    def forget(self, req: Request) -> None:
        self._stops.pop(req.rid, None)

    def append(self, req: Request, tokens: list[int]) -> tuple[int, Finish | None]:
        """Append a committed run to ``req.output_ids``; returns how many tokens were kept and
        the finish, if the run ended the request."""
        matcher = self.stop_strings(req)
        for i, token in enumerate(tokens):
            req.output_ids.append(token)
            finish = self._check(req, token, matcher)
            if finish is not None:
                return i + 1, finish
        return len(tokens), None

    def _check(self, req: Request, token: int, matcher: StopStrings | None) -> Finish | None:
        if matcher is not None:
            hit = matcher.push(token)
            if hit is not None:
                return Finish("stop", hit[0], hit[1])
        if token in req.stop_token_ids or (not req.ignore_eos and token in self.eos_ids):
            return Finish("stop", token)
        if req.max_new_tokens is not None and len(req.output_ids) >= req.max_new_tokens:
            return Finish("length")
        if len(req.prompt_ids) + len(req.output_ids) >= self.context_length:
            return Finish("length")
        return None

    def streamable(self, req: Request) -> int:
        """Output tokens that may be streamed now (all of them without stop strings)."""
        matcher = self._stops.get(req.rid)
        return len(req.output_ids) if matcher is None else matcher.safe_tokens()
