"""Training tokens: every conversation rendered through the tokenizer's chat template,
followed by ``<|endoftext|>``, concatenated and cut into rows of ``seq_len`` tokens (the tail
that does not fill a row is dropped). Rows cross conversation boundaries; attention is plain
causal over the row."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from recipe import chat, data

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_BATCH = 512


def load_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def rendered(tokenizer: PreTrainedTokenizerBase, path: Path) -> Iterator[str]:
    for conversation in data.read_jsonl(path):
        text = tokenizer.apply_chat_template(conversation.messages, tokenize=False)
        assert isinstance(text, str)
        yield text + chat.ENDOFTEXT


def encode_file(tokenizer: PreTrainedTokenizerBase, path: Path) -> np.ndarray:
    """The token stream of a JSONL split (uint16)."""
    pieces: list[np.ndarray] = []
    batch: list[str] = []
    for text in rendered(tokenizer, path):
        batch.append(text)
        if len(batch) == _BATCH:
            pieces.extend(_encode(tokenizer, batch))
            batch = []
    pieces.extend(_encode(tokenizer, batch))
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)
    mask_id = tokenizer.convert_tokens_to_ids(chat.MASK)
    if (stream == mask_id).any():
        raise ValueError(f"{chat.MASK} occurs in the encoded {path.name}")
    return stream


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[np.ndarray]:
    if not texts:
        return []
    # The backend's batch encoder, without offsets: several times faster than __call__.
    encodings = tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    return [np.asarray(encoding.ids, dtype=np.uint16) for encoding in encodings]


def cached_stream(tokenizer: PreTrainedTokenizerBase, path: Path, cache: Path) -> np.ndarray:
    """``encode_file`` through a cache file whose name carries the inputs' identity."""
    if cache.is_file():
        return np.load(cache)
    stream = encode_file(tokenizer, path)
    partial = cache.with_suffix(".partial.npy")
    np.save(partial, stream)
    partial.replace(cache)
    return stream


def rows(stream: np.ndarray, seq_len: int) -> torch.Tensor:
    """[n_rows, seq_len] int64."""
    n_rows = len(stream) // seq_len
    if n_rows == 0:
        raise ValueError(f"{len(stream)} tokens do not fill one row of {seq_len}")
    return torch.from_numpy(stream[: n_rows * seq_len].astype(np.int64)).view(n_rows, seq_len)
