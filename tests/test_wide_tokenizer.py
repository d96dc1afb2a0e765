"""benchmarks/wide_tokenizer.py: a tokenizer widened to a model's vocabulary size encodes as
before and gives every new id a text, so that the grammar engine counts none as special."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import xgrammar as xgr
from chat_model_fixture import CHAT_VOCAB
from frontdoor_harness import build_tokenizer
from transformers import AutoTokenizer

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "wide_tokenizer.py"
TEXT = 'A review: {"rating": 4, "summary": "fine"}'


def test_a_widened_tokenizer_encodes_as_before_and_has_no_new_special_ids(
    tmp_path: Path,
) -> None:
    source, wide = tmp_path / "source", tmp_path / "wide"
    build_tokenizer(source)
    narrow = AutoTokenizer.from_pretrained(source)
    assert len(narrow) < CHAT_VOCAB
    command = [sys.executable, str(SCRIPT), str(source), str(wide), "--vocab-size"]
    subprocess.run([*command, str(CHAT_VOCAB)], check=True)
    widened = AutoTokenizer.from_pretrained(wide)
    assert len(widened) == CHAT_VOCAB
    assert widened.encode(TEXT) == narrow.encode(TEXT)
    pieces = narrow.convert_ids_to_tokens(range(len(narrow)))
    added = {token.content for token in narrow.added_tokens_decoder.values()}
    for piece in widened.convert_ids_to_tokens(range(len(narrow), CHAT_VOCAB)):
        assert any(
            piece == first + piece[len(first) :] and piece[len(first) :] in pieces
            for first in pieces
            if first not in added and piece.startswith(first)
        ), piece
    special = {
        name: set(xgr.TokenizerInfo.from_huggingface(t, vocab_size=CHAT_VOCAB).special_token_ids)
        for name, t in (("narrow", narrow), ("wide", widened))
    }
    assert special["wide"] < special["narrow"], special
    assert all(i < len(narrow) for i in special["wide"]), special
