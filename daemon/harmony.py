"""The harmony format gpt-oss models speak: its encoding, loaded from the model's own tokenizer
without a download, and one request's output split into its channels.

- ``output_format(model_type, tokenizer)``: whether a model's chat outputs are split, as the
  daemon reports it (``ServerInfo.configuration["output_format"]``).
- ``harmony_encoding(tokenizer)``: the ``openai-harmony`` package's gpt-oss encoding. The
  package reads the o200k vocabulary file from the folder ``TIKTOKEN_ENCODINGS_BASE`` names
  (else downloads it) and checks the file's hash. A gpt-oss checkpoint's tokenizer holds the
  same vocabulary, so the file is written from it (``tiktoken_vocab``): no host needs the
  network, and a tokenizer whose vocabulary is not o200k's is refused by that hash
  (``HarmonyRefused``).
- ``render_chat(encoding, turns, tools, reasoning_effort)``: a chat's prompt, rendered by the
  package from the OpenAI-shaped messages and tools.
- ``ChannelSplit``: one request's output tokens, fed as they come, split into the answer (the
  ``final`` channel, and ``commentary`` messages addressed to no tool: the format's preambles,
  meant for the user), the reasoning (``analysis``) and tool calls (``commentary`` messages to
  ``functions.NAME``, their JSON arguments as the message's text).

Invariants of a split:
- Nothing but format is dropped: text the format's parser cannot place (an output that
  leaves the format or never speaks it, a call cut short or whose arguments are not a JSON
  object) goes to the answer as plain text, decoded from its tokens; a header cut short
  after the format was spoken (role and channel names) is format.
- Deltas only: each ``feed`` returns what its tokens add; the concatenated deltas of a request
  equal what one ``feed`` of all its tokens returns.
- The package is imported on first use, in the process that splits (a child never imports
  torch; this module does not).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from outrider.protocol.tool_calls import ParsedCall

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding, StreamableParser

    from outrider.daemon.tokenizer import Tokenizer

log = logging.getLogger("outrider.harmony")

VOCAB_FILE = "o200k_base.tiktoken"  # the name the package looks for
TOOL_PREFIX = "functions."  # a call's recipient: the tool's name after it
MAX_SPLIT = 3  # tokens a UTF-8 character may end in past its first (a byte a token)
MESSAGE_START = "<|message|>"  # after a message's header
MESSAGE_ENDS = ("<|end|>", "<|return|>", "<|call|>")


HARMONY_MODEL_TYPES = frozenset({"gpt_oss"})


def output_format(model_type: str, tokenizer: Tokenizer | None) -> Literal["harmony", "text"]:
    """How chat outputs of a model of ``model_type`` (config.json's) are served: "harmony"
    (split into channels, ``ChannelSplit``) where the family speaks it and ``tokenizer`` gives
    its encoding; else "text", the decoded tokens (a warning says why, where the family speaks
    harmony)."""
    if model_type not in HARMONY_MODEL_TYPES:
        return "text"
    if tokenizer is None:
        log.warning("%s outputs are served as token ids: no tokenizer to split them", model_type)
        return "text"
    try:
        harmony_encoding(tokenizer)
    except HarmonyRefused as exc:
        log.warning("%s chat outputs are served as plain text, not split into channels: %s",
                    model_type, exc)  # fmt: skip
        return "text"
    return "harmony"


class HarmonyRefused(ValueError):
    """The model's tokenizer cannot give the harmony encoding (the reason in the message)."""


def tiktoken_vocab(tokenizer: Tokenizer) -> bytes:
    """The tokenizer's base vocabulary (every token that is not an added one) as a tiktoken
    file: one line a token, ``base64(bytes) id``, in id order. The ids must run from 0 without
    a gap, as a tiktoken file's ranks do."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    added = set(tokenizer.hf.get_added_vocab().values())
    base = sorted((i, text) for text, i in tokenizer.hf.get_vocab().items() if i not in added)
    if [i for i, _ in base] != list(range(len(base))):
        raise HarmonyRefused("the tokenizer's base vocabulary has gaps in its ids")
    lines = []
    for i, text in base:
        try:
            raw = bytes(byte_of[char] for char in text)
        except KeyError:
            raise HarmonyRefused(f"token {i} ({text!r}) is not a byte-level token") from None
        lines.append(b"%s %d\n" % (base64.b64encode(raw), i))
    return b"".join(lines)


def harmony_encoding(tokenizer: Tokenizer) -> HarmonyEncoding:
    """The gpt-oss harmony encoding over ``tokenizer``'s vocabulary (module docstring); the
    vocabulary file lives in a temporary folder while the package reads it."""
    with tempfile.TemporaryDirectory(prefix="outrider-harmony-") as folder:
        (Path(folder) / VOCAB_FILE).write_bytes(tiktoken_vocab(tokenizer))
        return load_encoding_from(Path(folder))


def load_encoding_from(vocab_dir: Path) -> HarmonyEncoding:
    """The gpt-oss harmony encoding from the vocabulary file in ``vocab_dir``; refused
    (``HarmonyRefused``) where the file is not o200k's."""
    from openai_harmony import HarmonyEncodingName, HarmonyError, load_harmony_encoding

    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(vocab_dir)
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except HarmonyError as exc:
        raise HarmonyRefused(f"the tokenizer's vocabulary is not o200k's: {exc}") from None


def render_chat(
    encoding: HarmonyEncoding,
    turns: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]],
    reasoning_effort: str | None = None,
) -> list[int]:
    """The prompt of a chat in the harmony format, up to the assistant's turn: ``turns`` and
    ``tools`` in the OpenAI shape (frontdoor/tools.py's ``template_inputs``). The system
    message carries ``reasoning_effort`` (None: the format's default, medium); ``system``
    and ``developer`` turns become the developer message's instructions, in order, beside
    the tools; an assistant turn's content is its ``final`` message (reasoning of earlier
    turns is not rendered), each of its calls a ``commentary`` message to the function, and
    a ``tool`` turn the result of the call its ``tool_call_id`` names. Raises
    ``HarmonyRefused`` for a turn the format has no place for."""
    from openai_harmony import (
        Author,
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    system = SystemContent.new()
    if reasoning_effort is not None:
        system = system.with_reasoning_effort(ReasoningEffort(reasoning_effort.capitalize()))
    messages = [Message.from_role_and_content(Role.SYSTEM, system)]
    instructions = [t["content"] for t in turns if t["role"] in ("system", "developer")]
    if instructions or tools:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions("\n\n".join(instructions))
        if tools:
            developer = developer.with_function_tools([
                ToolDescription.new(f["name"], f["description"], parameters=f["parameters"])
                for f in (tool["function"] for tool in tools)
            ])  # fmt: skip
        messages.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    called: dict[str, str] = {}  # call id -> its function
    for i, turn in enumerate(turns):
        role, content = turn["role"], turn["content"]
        if role in ("system", "developer"):
            continue
        if role == "user":
            messages.append(Message.from_role_and_content(Role.USER, content))
        elif role == "assistant":
            if content:
                message = Message.from_role_and_content(Role.ASSISTANT, content)
                messages.append(message.with_channel("final"))
            for call in turn.get("tool_calls", []):
                name = called[call["id"]] = call["function"]["name"]
                arguments = json.dumps(call["function"]["arguments"])
                message = Message.from_role_and_content(Role.ASSISTANT, arguments)
                messages.append(
                    message.with_channel("commentary").with_recipient(TOOL_PREFIX + name)
                    .with_content_type("<|constrain|>json")
                )  # fmt: skip
        elif role == "tool":
            name = called.get(turn.get("tool_call_id", ""))
            if name is None:
                raise HarmonyRefused(
                    f"messages[{i}]: its tool_call_id names no call of an earlier message"
                )
            author = Author.new(Role.TOOL, TOOL_PREFIX + name)
            message = Message.from_author_and_content(author, content)
            messages.append(message.with_recipient("assistant").with_channel("commentary"))
        else:
            raise HarmonyRefused(
                f"messages[{i}]: role {role!r}: the harmony format takes system, developer, "
                "user, assistant and tool messages"
            )
    conversation = Conversation.from_messages(messages)
    return list(encoding.render_conversation_for_completion(conversation, Role.ASSISTANT))


@dataclass
class ChannelDelta:
    """What some output tokens add: answer text, reasoning text, and the tool calls they
    completed."""

    content: str = ""
    reasoning: str = ""
    calls: list[ParsedCall] = field(default_factory=list)

    def __add__(self, later: ChannelDelta) -> ChannelDelta:
        """This delta followed by ``later``."""
        return ChannelDelta(
            self.content + later.content, self.reasoning + later.reasoning, self.calls + later.calls
        )


class ChannelSplit:
    """One request's output split into channels as its tokens come (module docstring)."""

    def __init__(self, encoding: HarmonyEncoding) -> None:
        from openai_harmony import Role, StreamableParser

        self._encoding = encoding
        self._parser: StreamableParser | None = StreamableParser(encoding, role=Role.ASSISTANT)
        self._unplaced: list[int] = []  # tokens of a header being parsed
        self._spoken = False  # some message's header was parsed: the model speaks the format
        self._message_start = _special(encoding, MESSAGE_START)
        self._message_ends = {_special(encoding, end) for end in MESSAGE_ENDS}
        # The recipient ("": none) and channel of the message whose content is being parsed;
        # None between messages.
        self._recipient: str | None = None
        self._channel = ""
        self._call_text: list[str] = []  # the arguments of the call being parsed
        self._raw: list[int] = []  # tokens past the format not yet decoded

    def feed(self, token_ids: Sequence[int]) -> ChannelDelta:
        """The channels' text and the calls ``token_ids`` add."""
        delta = ChannelDelta()
        for token in token_ids:
            if self._parser is None:
                self._raw.append(token)
                continue
            self._step(self._parser, token, delta)
        delta.content += self._raw_text()
        return delta

    def finish(self) -> ChannelDelta:
        """What is left at the output's end: a call cut short goes to the answer as its
        partial arguments, and so do the tokens of an output that never spoke the format. A
        header cut short after the format was spoken holds no text (role and channel names)."""
        delta = ChannelDelta()
        if self._parser is not None:
            if self._spoken:
                self._unplaced = []
            self._leave_format(delta)
        delta.content += self._raw_text(final=True)
        return delta

    def _step(self, parser: StreamableParser, token: int, delta: ChannelDelta) -> None:
        from openai_harmony import HarmonyError

        self._unplaced.append(token)
        try:
            parser.process(token)
        except HarmonyError:
            self._leave_format(delta)
            return
        # NOTE: the parser's ``state`` and ``messages`` serialise its whole state as JSON on
        # every read (tens of microseconds, growing with the output): a message's bounds are
        # read from the tokens the parser accepted instead.
        if token == self._message_start:  # the header is parsed: format, not text
            self._spoken = True
            self._unplaced.clear()
            self._recipient = parser.current_recipient or ""
            self._channel = parser.current_channel or ""
            return
        if self._recipient is None:
            return  # a header's token, unplaced so far
        self._unplaced.clear()  # a message's: placed
        if token in self._message_ends:
            self._end_message(self._recipient, delta)
            self._recipient = None
        elif self._recipient.startswith(TOOL_PREFIX):
            self._call_text.append(parser.last_content_delta or "")
        elif self._channel == "analysis":
            delta.reasoning += parser.last_content_delta or ""
        else:
            delta.content += parser.last_content_delta or ""

    def _end_message(self, recipient: str, delta: ChannelDelta) -> None:
        if not recipient.startswith(TOOL_PREFIX):
            return
        text, self._call_text = "".join(self._call_text), []
        call = _call(recipient.removeprefix(TOOL_PREFIX), text)
        if call is None:
            delta.content += text
        else:
            delta.calls.append(call)

    def _leave_format(self, delta: ChannelDelta) -> None:
        """From here on the output is plain text: a call's partial arguments and the tokens
        of the header being parsed go to the answer."""
        self._parser = None
        delta.content += "".join(self._call_text)
        self._call_text = []
        self._raw, self._unplaced = self._unplaced + self._raw, []

    def _raw_text(self, final: bool = False) -> str:
        """The text of the tokens past the format (special tokens skipped, as the plain
        decoder skips them), up to the last whole character: a character split over tokens
        waits for the rest (at most ``MAX_SPLIT`` trailing tokens); ``final``: all of it,
        an incomplete character as U+FFFD."""
        from openai_harmony import HarmonyError

        self._raw = [t for t in self._raw if not self._encoding.is_special_token(t)]
        if final:
            text, self._raw = self._encoding.decode(self._raw), []
            return text
        for keep in range(min(MAX_SPLIT, len(self._raw)) + 1):
            whole = self._raw[: len(self._raw) - keep]
            try:
                text = self._encoding.decode_utf8(whole)
            except HarmonyError:
                continue
            self._raw = self._raw[len(whole) :]
            return text
        # Bytes that are not UTF-8 before the end: no later token completes them.
        text, self._raw = self._encoding.decode(self._raw), []
        return text


def _special(encoding: HarmonyEncoding, text: str) -> int:
    """The id of the special token ``text``."""
    (token,) = encoding.encode(text, allowed_special="all")
    return int(token)


def _call(name: str, arguments: str) -> ParsedCall | None:
    """A call of ``name`` with ``arguments`` where they are a JSON object, else None."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return ParsedCall(name, value) if isinstance(value, dict) and name else None
