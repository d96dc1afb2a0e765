"""In-process checks of the shared tokenizer pieces and the detokenizer's per-request state."""

from __future__ import annotations

from pathlib import Path

import pytest
from frontdoor_harness import REPLY_TEXT, build_tokenizer, finish

from outrider.daemon.detokenizer import OutputTexts
from outrider.daemon.internal import ErrorInfo, RequestUpdate
from outrider.daemon.tokenizer import ChatTemplateError, Tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    (path / "config.json").write_text("{}")
    tok = load_tokenizer(path / "config.json")  # a config.json path means its directory
    assert tok is not None
    return tok


def test_no_tokenizer_files_means_token_ids_only(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path) is None


def test_incremental_text_equals_the_full_decode(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode_prompt(REPLY_TEXT)  # BOS first: skipped as a special token
    decoder = tokenizer.decoder()
    pieces = [decoder.step(t) for t in ids]
    assert "".join(pieces) == decoder.text == REPLY_TEXT
    assert decoder.length == len(REPLY_TEXT)
    assert "" in pieces  # BOS, and bytes of a character split over tokens, wait for more
    assert decoder.step(10**6) == ""  # an id the tokenizer does not know decodes to nothing


def test_chat_template_errors_are_typed(tokenizer: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="unknown role robot"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "x"}])


def test_output_texts_cut_at_the_stop_and_forget_the_request(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode_prompt(REPLY_TEXT)[1:]
    texts = OutputTexts(tokenizer)
    first = RequestUpdate(1, ids[:4])
    texts.fill(first)
    cut = REPLY_TEXT.index("fox")
    final = RequestUpdate(1, ids[4:], finish=finish("stop", cut, "fox"))
    texts.fill(final)
    assert first.text + final.text == REPLY_TEXT[:cut]
    other = RequestUpdate(2, ids)
    texts.fill(other)
    assert texts.active == 1  # request 1 is forgotten at its final update
    texts.fill(RequestUpdate(2, [], error=ErrorInfo("internal", "x")))
    assert (other.text, texts.active) == (REPLY_TEXT, 0)
