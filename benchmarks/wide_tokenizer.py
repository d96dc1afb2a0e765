"""Widen a byte-level BPE tokenizer to a model's vocabulary size, for benchmarks that pair a
model's config (dummy weights) with a smaller tokenizer.

A grammar engine treats the ids past a tokenizer's vocabulary as special tokens, and its cost
follows: xgrammar searches the special ids on every token it accepts (about 13 us a token for
the 79,104 ids between SmolLM2's 49,152 and Llama-3.1's 128,256, against 2 us for a tokenizer
of the model's size), while its masks skip them. The widened tokenizer gives every id a text,
so that accepts cost what a tokenizer of the model's size costs: each new token is two of the
tokenizer's own pieces joined, a piece encoding never produces (no merge makes it). Its masks
do not: inside a JSON string xgrammar fills them about 8x slower than a real tokenizer's
(BENCHMARKS.md); host-time figures take ``real_vocab.py``'s real tokenizer.

    python benchmarks/wide_tokenizer.py SOURCE_DIR OUT_DIR --vocab-size 128256
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
from pathlib import Path


def widen(vocab: dict[str, int], size: int, special: set[int]) -> dict[str, int]:
    """``vocab`` (piece -> id, ids ``0 .. n - 1``) with pieces up to id ``size - 1``, joined
    from pieces whose ids are not ``special``."""
    pieces = sorted((piece for piece, i in vocab.items() if i not in special), key=vocab.get)
    wide = dict(vocab)
    n = len(pieces)
    for pair in itertools.count():
        if len(wide) == size:
            return wide
        # Round r pairs piece i with piece i + 7919 r + 1: every round a new partner.
        first, rounds = pair % n, pair // n
        piece = pieces[first] + pieces[(first + 7919 * rounds + 1) % n]
        wide.setdefault(piece, len(wide))
    raise AssertionError("unreachable")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a directory with a byte-level BPE tokenizer")
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab-size", type=int, required=True)
    args = parser.parse_args()
    spec = json.loads((args.source / "tokenizer.json").read_text())
    model = spec["model"]
    if model["type"] != "BPE":
        raise SystemExit(f"a BPE tokenizer is needed, not {model['type']}")
    taken = {token["id"] for token in spec["added_tokens"]}
    if len(model["vocab"]) != max(model["vocab"].values()) + 1 or max(taken) >= len(model["vocab"]):
        raise SystemExit("the vocabulary's ids must run 0 .. n - 1, added tokens among them")
    model["vocab"] = widen(model["vocab"], args.vocab_size, taken)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.source.iterdir():
        if path.is_file() and path.name != "tokenizer.json":
            shutil.copy(path, args.out / path.name)
    (args.out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))


if __name__ == "__main__":
    main()
