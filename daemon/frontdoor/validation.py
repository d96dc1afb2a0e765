"""Validation of ``Generate`` requests at the front door, against the model facts.

``Validator.admit`` turns a decoded request into the daemon's inputs or raises ``Rejected``
with a wire error code and a message that names the field. What msgspec already enforces
while decoding (the ``Meta`` bounds of ``Generate``, protocol/messages.py) is not repeated
here; every float field has both bounds, so NaN and +-inf never decode.

A request's sampling values are resolved and checked by ``resolve_sampling``
(plugins/sampling_spec.py): those it leaves out (None) take the daemon's ``SamplingDefaults``
(sampling_defaults.py), before anything sees them: the speculative plugin's ``check_request``
and the daemon get one concrete ``SamplingSpec``.

Admission has two halves around tokenization, which may run on another thread for a long
prompt: ``check`` decides everything the text itself can (the sampling included, and refuses a
prompt with more characters than the context can hold before any tokenizing), ``admit`` the
rest.

A ``max_new_tokens`` the context cannot hold after the prompt is refused, never clamped; a
request that leaves it out runs until a stop condition or the context limit.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Literal

from outrider.daemon.frontdoor.tools import ToolsRefused, template_inputs, tool_use
from outrider.daemon.grammar.tool_calls import HARMONY
from outrider.daemon.internal import ModelFacts, ToolUse
from outrider.daemon.sampling_defaults import OUTRIDER_DEFAULTS, SamplingDefaults
from outrider.daemon.tokenizer import ChatTemplateError, Tokenizer
from outrider.plugins.api import RequestFacts
from outrider.plugins.checks import request_refusal
from outrider.plugins.registry import discover
from outrider.plugins.sampling_spec import (
    Adjustments,
    SamplingError,
    SamplingSpec,
    resolve_sampling,
)
from outrider.protocol.messages import MAX_STOP_STRING_CHARS, ErrorCode, Generate

log = logging.getLogger("outrider.frontdoor")

# NFC / NFKC compose at most four characters into one (e.g. U+1F82 from alpha and three marks).
NORMALIZER_COMPOSITION = 4
INLINE_PROMPT_CHARS = 16_384  # tokenized on the event loop: about 10 ms at worst
MAX_WAITING_PROMPTS = 8  # longer prompts queued for the tokenizing thread

RequestCheck = Callable[[RequestFacts], "str | None"]


class Rejected(Exception):
    """A request answered with a typed ``Error`` instead of being forwarded."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code: ErrorCode = code
        self.message = message


@dataclass(frozen=True)
class Admitted:
    """What the daemon gets for a valid request (``TokenizedRequest`` minus bookkeeping)."""

    input_ids: list[int]
    sampling: SamplingSpec
    max_new_tokens: int | None  # None: until a stop condition or the context limit
    tools: ToolUse | None = None


PromptSource = Literal["prompt", "input_ids", "messages"]


@dataclass(frozen=True)
class Prompt:
    """Where a request's prompt comes from and how many characters tokenizing it reads."""

    source: PromptSource
    chars: int  # 0 for input_ids


@dataclass(frozen=True)
class Checked:
    """What ``Validator.check`` decided before tokenizing: the prompt to tokenize, the
    request's sampling and what its tool calls are held to."""

    prompt: Prompt
    sampling: SamplingSpec
    tools: ToolUse | None = None


def speculative_request_check(algorithm: str) -> RequestCheck | None:
    """What the speculative plugin ``algorithm`` refuses per request: its declared
    capabilities, then its own ``check_request`` (None for "none"). The front door's one
    discovery.

    Raises ``PluginError`` when the plugin cannot be found: the daemon already checked it at
    start, so this is fatal for the front door, never a per-request error.
    """
    if algorithm == "none":
        return None
    return functools.partial(request_refusal, discover().get("speculative", algorithm))


def prompt_char_limit(tokenizer: Tokenizer, context_length: int) -> int:
    """The most characters a prompt that fits in the context can have.

    Byte-level BPE and SentencePiece keep every character, and a token covers at most as many
    characters as its text in the vocabulary has (a byte-level token shows one character per
    UTF-8 byte), so a longer prompt cannot fit in ``context_length - 1`` tokens. A normalizer
    may compose up to ``NORMALIZER_COMPOSITION`` characters into one (Unicode NFC / NFKC).
    """
    per_token = tokenizer.longest_token_chars
    if tokenizer.has_normalizer:
        per_token *= NORMALIZER_COMPOSITION
    return (context_length - 1) * per_token


def tokenize(tokenizer: Tokenizer, msg: Generate) -> list[int]:
    """The token ids of a ``prompt`` or ``messages`` request that ``check`` accepted; raises
    ``Rejected`` when the chat template fails. Safe on any thread that owns ``tokenizer``."""
    if msg.prompt is not None:
        return tokenizer.encode_prompt(msg.prompt)
    assert msg.messages is not None
    turns, tools = template_inputs(msg)
    if tokenizer.harmony is not None and msg.tool_choice == "none":
        tools = []  # a harmony chat's calls are held to nothing: the model is not shown them
    try:
        return tokenizer.apply_chat_template(turns, tools, msg.reasoning_effort)
    except ChatTemplateError as exc:
        raise Rejected("invalid_request", f"messages: chat template failed: {exc}") from None


class PromptTokenizer:
    """Tokenizes prompts without stalling the front door's event loop: up to
    ``INLINE_PROMPT_CHARS`` characters at once on the calling thread, longer prompts on one
    worker thread in arrival order, at most ``MAX_WAITING_PROMPTS`` of them waiting.

    NOTE: the worker uses its own tokenizer instance: a transformers tokenizer must not be
    used from two threads at once. The tokenizers library releases the GIL while it encodes.
    """

    def __init__(self, inline: Tokenizer | None, worker: Tokenizer | None) -> None:
        self._inline = inline
        self._worker = worker
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._waiting = 0

    def check_room(self, prompt: Prompt) -> None:
        if prompt.chars > INLINE_PROMPT_CHARS and self._waiting >= MAX_WAITING_PROMPTS:
            raise Rejected(
                "overloaded",
                f"{self._waiting} long prompts are waiting to be tokenized (the limit)",
            )

    def tokenize(
        self, msg: Generate, prompt: Prompt, done: Callable[[asyncio.Future[list[int]]], None]
    ) -> None:
        """Call ``done`` with the future of ``msg``'s token ids (it raises ``Rejected`` for a
        failing chat template): before returning, or from the event loop once the worker is
        done. ``check`` and ``check_room`` accepted ``msg``."""
        loop = asyncio.get_running_loop()
        if prompt.chars > INLINE_PROMPT_CHARS:
            assert self._worker is not None
            self._waiting += 1
            future = loop.run_in_executor(self._pool, tokenize, self._worker, msg)
            future.add_done_callback(self._finished)
            future.add_done_callback(done)
            return
        future = loop.create_future()
        try:
            if msg.input_ids is not None:
                future.set_result(msg.input_ids)
            else:
                assert self._inline is not None
                future.set_result(tokenize(self._inline, msg))
        except Exception as exc:  # tokenizer code on client input: this request fails
            future.set_exception(exc)
        done(future)

    def _finished(self, _: asyncio.Future[list[int]]) -> None:
        self._waiting -= 1


class Validator:
    def __init__(
        self,
        facts: ModelFacts,
        tokenizer: Tokenizer | None,
        request_check: RequestCheck | None,
        defaults: SamplingDefaults = OUTRIDER_DEFAULTS,
    ) -> None:
        self.facts = facts
        # A default top_k past the vocabulary keeps every token, as top_k 0 does.
        top_k = defaults.top_k if defaults.top_k <= facts.vocab_size else 0
        self.defaults = replace(defaults, top_k=top_k)
        self._default_sampling = self.defaults.sampling
        self.has_tokenizer = tokenizer is not None
        # Chat outputs split into channels after decoding (daemon/harmony.py).
        self.channels = facts.configuration.get("output_format") == "harmony"
        self.request_check = request_check
        self.max_prompt_chars = (
            prompt_char_limit(tokenizer, facts.context_length) if tokenizer is not None else 0
        )

    def check(self, msg: Generate) -> Checked:
        """What can be decided before tokenizing; raises ``Rejected``."""
        sampling = self._sampling(msg)
        self._check_stops(msg)
        self._check_grammar(msg)
        self._check_channels(msg)
        prompt = self._prompt(msg)
        chat_format = HARMONY if self.channels and msg.messages is not None else None
        try:
            tools = tool_use(msg, chat_format or self.facts.configuration.get("tool_call_format"))
        except ToolsRefused as exc:
            raise Rejected(exc.code, str(exc)) from None
        if prompt.chars > self.max_prompt_chars:
            raise Rejected(
                "prompt_too_long",
                f"{prompt.source} has {prompt.chars} characters; at most "
                f"{self.max_prompt_chars} can fit in the context length of "
                f"{self.facts.context_length} tokens",
            )
        return Checked(prompt, sampling, tools)

    def admit(self, msg: Generate, checked: Checked, input_ids: list[int]) -> Admitted:
        """The daemon's inputs for ``msg``, checked and tokenized; raises ``Rejected``."""
        source = checked.prompt.source
        if not input_ids:
            raise Rejected("invalid_request", f"{source} is empty: the prompt has no tokens")
        self._check_vocab(source, input_ids)
        if len(input_ids) >= self.facts.context_length:
            raise Rejected(
                "prompt_too_long",
                f"{source} is {len(input_ids)} tokens; the context length is "
                f"{self.facts.context_length}, so a prompt may have at most "
                f"{self.facts.context_length - 1}",
            )
        self._run_plugin_check(msg, checked.sampling, len(input_ids))
        max_new = msg.max_new_tokens
        if max_new is None:
            max_new = self.facts.max_new_tokens_default
        else:
            self._check_room(len(input_ids), max_new)
        return Admitted(input_ids, checked.sampling, max_new, checked.tools)

    def _check_room(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Refuses a ``max_new_tokens`` the context cannot hold after the prompt (as vLLM
        does): a client that asks for more than fits is told, never cut short silently. The
        message ends in the field's path, which the HTTP front renames to the client's."""
        context = self.facts.context_length
        if prompt_tokens + max_new_tokens <= context:
            return
        raise Rejected(
            "invalid_request",
            f"{max_new_tokens} new tokens after a prompt of {prompt_tokens} tokens pass the "
            f"context length of {context}: at most {context - prompt_tokens} new tokens fit "
            "- at `$.max_new_tokens`",
        )

    def _sampling(self, msg: Generate) -> SamplingSpec:
        """``msg``'s sampling, the defaults in place of the values it leaves out."""
        try:
            return resolve_sampling(
                msg.temperature,
                msg.top_p,
                msg.top_k,
                defaults=self._default_sampling,
                seed=msg.seed,
                logprobs=msg.logprobs,
                vocab_size=self.facts.vocab_size,
                adjustments=Adjustments(
                    msg.min_p,
                    msg.presence_penalty,
                    msg.frequency_penalty,
                    msg.repetition_penalty,
                    msg.logit_bias,
                ),
            )
        except SamplingError as exc:
            raise Rejected("invalid_request", str(exc)) from None

    def _check_channels(self, msg: Generate) -> None:
        """A chat request to a model whose outputs have channels: the daemon's stop strings
        act on the output's text, channel headers and reasoning included, not on the answer
        they are meant for (its grammar holds the final message alone: daemon/grammar/
        channels.py). ``reasoning_effort`` is such a chat's alone."""
        if not self.channels or msg.messages is None:
            if msg.reasoning_effort is not None:
                raise Rejected(
                    "unsupported",
                    "reasoning_effort is taken by chat requests to a model in the harmony "
                    "format (gpt-oss) only",
                )
            return
        if msg.stop:
            raise Rejected(
                "unsupported",
                "stop strings are not supported for chat requests to this model: its output "
                "is in the harmony format (channels for reasoning and answer), which they "
                "would cut as a whole",
            )

    def _check_stops(self, msg: Generate) -> None:
        vocab = self.facts.vocab_size
        for i, token_id in enumerate(msg.stop_token_ids):
            if token_id >= vocab:
                raise Rejected(
                    "invalid_request",
                    f"stop_token_ids[{i}] = {token_id} is out of range: vocab_size is {vocab}",
                )
        for i, stop in enumerate(msg.stop):
            if not stop:
                raise Rejected("invalid_request", f"stop[{i}] is an empty string")
            if len(stop) > MAX_STOP_STRING_CHARS:
                raise Rejected(
                    "invalid_request",
                    f"stop[{i}] has {len(stop)} characters; the limit is {MAX_STOP_STRING_CHARS}",
                )
        if msg.stop and not self.has_tokenizer:
            raise Rejected(
                "unsupported",
                "stop strings need a tokenizer and this model has none; use stop_token_ids",
            )

    def _check_grammar(self, msg: Generate) -> None:
        """What a grammar needs beyond its fields' bounds; the daemon compiles it (and
        refuses a schema, pattern or grammar it cannot)."""
        grammar = msg.grammar
        if grammar is None:
            return
        if not self.has_tokenizer:
            raise Rejected(
                "unsupported", "a grammar needs the model's tokenizer and this model has none"
            )
        if msg.ignore_eos:
            raise Rejected(
                "invalid_request",
                "ignore_eos cannot be combined with a grammar: a constrained output ends where "
                "its grammar lets it",
            )
        if (grammar.kind == "choice") != bool(grammar.choices):
            raise Rejected(
                "invalid_request",
                "grammar.choices: a choice grammar lists its choices, and only a choice grammar",
            )
        if (grammar.kind in ("json_object", "choice")) == bool(grammar.text):
            needs = "takes no" if grammar.text else "needs its"
            raise Rejected(
                "invalid_request", f"grammar.text: a {grammar.kind} grammar {needs} text"
            )
        if grammar.kind == "json_schema":
            try:
                schema = json.loads(grammar.text)
            except ValueError as exc:
                raise Rejected("invalid_request", f"grammar.text: not JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise Rejected("invalid_request", "grammar.text: a JSON schema is an object")

    def _prompt(self, msg: Generate) -> Prompt:
        fields: tuple[tuple[PromptSource, object], ...] = (
            ("prompt", msg.prompt),
            ("input_ids", msg.input_ids),
            ("messages", msg.messages),
        )
        given = [name for name, value in fields if value is not None]
        if len(given) != 1:
            got = " and ".join(given) if given else "none of them"
            raise Rejected(
                "invalid_request",
                f"exactly one of prompt, input_ids, messages must be set; got {got}",
            )
        source = given[0]
        if msg.input_ids is not None:
            return Prompt(source, 0)
        if not self.has_tokenizer:
            raise Rejected(
                "unsupported",
                f"{source} needs a tokenizer and this model has none; send input_ids",
            )
        if msg.prompt is not None:
            return Prompt(source, len(msg.prompt))
        assert msg.messages is not None
        if not msg.messages:
            raise Rejected("invalid_request", "messages is an empty list")
        chars = sum(len(m.role) + len(m.content) for m in msg.messages)
        chars += sum(len(t.name) + len(t.description) + len(t.parameters) for t in msg.tools)
        return Prompt(source, chars)

    def _check_vocab(self, source: str, input_ids: list[int]) -> None:
        vocab = self.facts.vocab_size
        if max(input_ids) < vocab:
            return
        i, token_id = next((i, t) for i, t in enumerate(input_ids) if t >= vocab)
        if source == "input_ids":
            where = f"input_ids[{i}] = {token_id}"
        else:  # the tokenizer knows more ids than the model: a deployment mismatch
            where = f"{source} token {i} (id {token_id} from the tokenizer)"
        raise Rejected("invalid_request", f"{where} is out of range: vocab_size is {vocab}")

    def _run_plugin_check(self, msg: Generate, sampling: SamplingSpec, prompt_tokens: int) -> None:
        if self.request_check is None:
            return
        facts = RequestFacts.from_sampling(
            sampling, has_stop_strings=bool(msg.stop), prompt_tokens=prompt_tokens
        )
        try:
            problem = self.request_check(facts)
        except Exception as exc:  # third-party code: this request fails, the front door lives
            log.exception("speculative %s check_request raised", self.facts.speculative_algorithm)
            raise Rejected(
                "internal",
                f"speculative plugin {self.facts.speculative_algorithm!r} check_request raised "
                f"{type(exc).__name__}: {exc}",
            ) from None
        if problem is not None:
            raise Rejected("unsupported", problem)
