"""The tiny chat model the grammar and tool tests share: a random llama whose vocabulary
reaches past its tokenizer's 320 ids (which no mask may let through), with the front door
tests' byte-level BPE tokenizer and, where given, another chat template."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from frontdoor_harness import build_tokenizer
from model_fixtures import save_tiny_model

from outrider.daemon.tokenizer import Tokenizer, load_tokenizer

CHAT_VOCAB = 336


def save_chat_model(
    directory: Path, *, chat_template: str | None = None, context: int | None = None
) -> Tokenizer:
    """Save the model to ``directory`` (``context``: its max positions, where the default
    256 is too few) and return its tokenizer."""
    overrides = {} if context is None else {"max_position_embeddings": context}
    with torch.no_grad():
        save_tiny_model("llama", directory, vocab_size=CHAT_VOCAB, config_overrides=overrides)
    build_tokenizer(directory)
    if chat_template is not None:
        config = json.loads((directory / "tokenizer_config.json").read_text())
        config["chat_template"] = chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return chat_tokenizer(directory)


def chat_tokenizer(directory: Path) -> Tokenizer:
    """The tokenizer ``save_chat_model`` saved in ``directory``."""
    tokenizer = load_tokenizer(directory)
    assert tokenizer is not None and tokenizer.eos_token_id is not None
    return tokenizer
