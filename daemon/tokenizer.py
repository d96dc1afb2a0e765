"""The model's tokenizer, as the daemon and its two children use it.

- ``load_tokenizer(dir)``: transformers' own fast tokenizer (so chat templates are rendered by
  transformers), or None when the model directory has no tokenizer files: the daemon then
  serves token ids only.
- ``IncrementalDecoder``: output text token by token. The detokenizer process and the daemon's
  stop-string matcher both use it, so a character offset (``FinishInfo.text_cut``) means the
  same text on both sides.

NOTE: the children must never import torch, and transformers imports torch whenever it can
find it. Children call ``child_environment_setup()`` first, which blocks torch; this module
imports transformers only inside ``load_tokenizer``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding
    from transformers import PreTrainedTokenizerFast

# Any of these marks a directory as having a tokenizer; from_pretrained then must succeed.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def child_environment_setup() -> None:
    """Prepare a child process: call it before anything imports transformers."""
    # NOTE: transformers imports torch whenever it can find it, and not every version honours
    # USE_TORCH=0. A None entry in sys.modules makes torch unfindable (find_spec returns None,
    # import raises), so transformers takes its torch-free paths.
    sys.modules["torch"] = None  # type: ignore[assignment]  # the import system's block marker
    # Without torch, importing transformers logs an advisory ("PyTorch was not found. Models
    # won't be available ...") that reads as a broken install; the child wants none of what
    # it names. This variable is transformers' switch for its advisory warnings only.
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    # One thread per child: the daemon's torch threads (--threads) leave them one core in all.
    # tokenizers' Rust thread pool reads these when first used, after this point.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    # Only the daemon's main process talks to systemd (NotifyAccess=main).
    os.environ.pop("NOTIFY_SOCKET", None)


class ChatTemplateError(ValueError):
    """The chat template cannot render these messages (the template's own message)."""


class Tokenizer:
    """The part of a model's tokenizer the daemon uses."""

    def __init__(self, hf: PreTrainedTokenizerFast) -> None:
        self._hf = hf
        # A model whose chats are in the harmony format (daemon/harmony.py) renders them with
        # this encoding, its chat template aside.
        self.harmony: HarmonyEncoding | None = None

    def __len__(self) -> int:
        """Number of ids the tokenizer knows (base vocabulary plus added tokens)."""
        return len(self._hf)

    @property
    def eos_token_id(self) -> int | None:
        return self._hf.eos_token_id

    @property
    def has_chat_template(self) -> bool:
        return self.harmony is not None or self._hf.chat_template is not None

    @property
    def backend(self) -> BackendTokenizer:
        return self._hf.backend_tokenizer

    @property
    def hf(self) -> PreTrainedTokenizerFast:
        """transformers' tokenizer itself (the grammar engine reads its vocabulary)."""
        return self._hf

    @property
    def longest_token_chars(self) -> int:
        """Characters of the longest token text in the vocabulary, added tokens included."""
        return max(len(text) for text in self._hf.get_vocab())

    @property
    def has_normalizer(self) -> bool:
        return self.backend.normalizer is not None

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a ``prompt`` string, with the tokenizer's default special-token
        behaviour: whatever its post-processor adds (e.g. BOS for Llama 3) is added."""
        return list(self._hf.encode(text))

    @property
    def chat_template(self) -> str | None:
        """The chat template's text (the default one where a tokenizer names several)."""
        template = self._hf.chat_template
        if isinstance(template, dict):
            return template.get("default")
        return template

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        reasoning_effort: str | None = None,
    ) -> list[int]:
        """Token ids of ``messages`` (with ``tools``, in the OpenAI shape, where given)
        rendered by transformers' ``apply_chat_template`` with ``add_generation_prompt=True``,
        or in the harmony format (``harmony``; with ``reasoning_effort``, which only it
        takes). Raises ``ChatTemplateError`` when it cannot."""
        if self.harmony is not None:
            from outrider.daemon.harmony import HarmonyRefused, render_chat

            try:
                return render_chat(self.harmony, messages, tools or [], reasoning_effort)
            except HarmonyRefused as exc:
                raise ChatTemplateError(str(exc)) from None
        assert reasoning_effort is None, "refused at the front door for a chat template"
        if not self.has_chat_template:
            raise ChatTemplateError("this model's tokenizer has no chat template")
        try:
            ids = self._hf.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        except Exception as exc:  # a template is model-supplied code and may raise anything
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from None
        return list(ids)

    def decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self.backend)


def load_tokenizer(directory: str | os.PathLike[str]) -> Tokenizer | None:
    """The tokenizer of a model directory (or of the directory of a config.json path).

    None when the directory holds none of ``TOKENIZER_FILES``; a tokenizer that is present but
    cannot be loaded raises (a start error, never a silent fall-back to token ids).
    """
    path = Path(directory)
    if path.is_file():
        path = path.parent
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import PreTrainedTokenizerFast

    return Tokenizer(PreTrainedTokenizerFast.from_pretrained(str(path)))


class IncrementalDecoder:
    """The text of one request's output tokens, fed one token at a time.

    Special tokens are skipped. Bytes of an incomplete UTF-8 character are held back until a
    later token completes it (and never appear if the output ends first); ids the tokenizer
    does not know decode to nothing.
    """

    def __init__(self, backend: BackendTokenizer) -> None:
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=True)
        self._parts: list[str] = []
        self.length = 0  # characters decoded so far

    def step(self, token_id: int) -> str:
        """Append one token; return the text it completes (often "", never None)."""
        piece = self._stream.step(self._backend, token_id) or ""
        if piece:
            self._parts.append(piece)
            self.length += len(piece)
        return piece

    def extend(self, token_ids: Sequence[int]) -> str:
        """``step`` over several tokens; returns the concatenated new text."""
        return "".join([self.step(token_id) for token_id in token_ids])

    @property
    def text(self) -> str:
        """All text so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""
