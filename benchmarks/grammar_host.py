"""The host time a constrained row adds to a step: its grammar's masks, per row and step.

Compiles the JSON schema (``benchmarks/structured/review.schema.json`` unless ``--schema``)
against a model directory's tokenizer as the daemon does and walks a valid answer's tokens as
a chain of ``--width`` verify nodes whose drafts are all accepted would: at each cycle it
times, per row, the guide's masks of the drafts, one place at a time (``RowGrammars.path_masks``,
as a chain's worker asks for them), then the verify nodes' masks (``RowGrammars.node_masks``,
which reuse the places'), then the commit of the drafts and the target's next token
(``GrammarState.advance``); and, on a state of its own, a plain step's mask at each token
(``pack_masks``); then steps of ``--rows`` grammar rows, each row at its own place of the
answer: a plain step's masks, a chain's guide (its first ``--guided-places`` places, as a
DFlash block at many rows guides) and its verify nodes; and a tree's step of
``--rows`` rows (``--tree-depth`` draft places deep, ``--tree-topk`` paths a depth past the
first, the answer's own token first and other tokens of the answer beside it; verify nodes:
the answer's next ``--tree-depth - 1`` tokens and a sibling of each). Medians in
microseconds.

    python benchmarks/grammar_host.py --model-dir DIR [--width 4] [--rows 32]
        [--guided-places K] [--tree-depth 5 --tree-topk 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from outrider.daemon.grammar.compiler import Grammars
from outrider.daemon.grammar.state import GrammarState, RowGrammars, pack_masks
from outrider.protocol.messages import Grammar

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "benchmarks" / "structured" / "review.schema.json"
ANSWER = {
    "sentiment": "positive",
    "rating": 4,
    "topics": ["quality", "delivery"],
    "summary": "Sturdy, arrived early, and the colour is right.",
    "recommend": True,
}


def timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return (time.perf_counter() - start) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--vocab-size", type=int, help="the model's (default: the tokenizer's)")
    parser.add_argument("--schema", type=Path, default=SCHEMA)
    parser.add_argument("--width", type=int, default=4, help="verify nodes of a chain")
    parser.add_argument("--rows", type=int, default=32, help="a step's grammar rows")
    parser.add_argument(
        "--guided-places", type=int, help="of a step's chain, those guided (default: all)"
    )
    parser.add_argument("--tree-depth", type=int, default=5, help="a tree's draft places deep")
    parser.add_argument("--tree-topk", type=int, default=4, help="a tree's paths a depth")
    args = parser.parse_args()
    hf = AutoTokenizer.from_pretrained(args.model_dir)
    vocab = args.vocab_size or len(hf)
    grammars = Grammars(args.model_dir, vocab, [hf.eos_token_id])
    grammar = Grammar("json_schema", args.schema.read_text())
    fill: list[float] = []
    accepted: list[bool] = []
    start = time.perf_counter()
    state = GrammarState(grammars.compile(grammar), [hf.eos_token_id], grammars.text_exits)
    compile_ms = (time.perf_counter() - start) * 1e3
    plain = GrammarState(grammars.compile(grammar), [hf.eos_token_id], grammars.text_exits)
    # The schema's form: its properties in order, ", " and ": " between (any_whitespace off).
    tokens = hf.encode(json.dumps(ANSWER), add_special_tokens=False)
    tokens.append(hf.eos_token_id)
    for token in tokens:
        fill.append(timed(lambda: pack_masks([plain])))
        assert plain.advance([token])
    rows = RowGrammars([state])
    out = xgr.allocate_token_bitmask(args.width, vocab)
    nodes, places, commits = [], [], []
    drafts = args.width - 1
    for position in range(0, len(tokens) - args.width, args.width):
        chain = torch.tensor([tokens[position : position + drafts]])
        paths = [chain[:, :place].view(1, 1, place) for place in range(drafts)]
        places.append(sum(timed(partial(rows.path_masks, out, [0], path)) for path in paths))
        nodes.append(timed(partial(rows.node_masks, out, [0], chain, None)))
        committed = tokens[position : position + args.width]
        commits.append(timed(lambda c=committed: accepted.append(state.advance(c))))  # type: ignore[misc]
    assert all(accepted)
    # Steps of ``--rows`` grammar rows, each at its own place of the answer: a plain step's
    # masks, a chain's guide (place after place) and its verify nodes.
    rows_states = [
        GrammarState(grammars.compile(grammar), [hf.eos_token_id], grammars.text_exits)
        for _ in range(args.rows)
    ]
    offsets = [row % (len(tokens) - args.width) for row in range(args.rows)]
    for offset, row_state in zip(offsets, rows_states, strict=True):
        assert row_state.advance(tokens[:offset])
    chains = torch.tensor([tokens[offset : offset + drafts] for offset in offsets])
    batch = RowGrammars(rows_states)
    plain_out = xgr.allocate_token_bitmask(args.rows, vocab)
    step_out = xgr.allocate_token_bitmask(args.rows * args.width, vocab)
    firsts = [row * args.width for row in range(args.rows)]
    plain_us, guide_us, nodes_us = [], [], []
    guided = drafts if args.guided_places is None else min(drafts, args.guided_places)
    for _ in range(50):
        for row_state in rows_states:
            row_state.advance([])  # a new step: no mask of this one known yet
        plain_us.append(timed(partial(batch.masks, plain_out, range(args.rows))))
        guide_us.append(
            sum(
                timed(partial(batch.path_masks, step_out, firsts, chains[:, None, :place]))
                for place in range(guided)
            )
        )
        nodes_us.append(timed(partial(batch.node_masks, step_out, firsts, chains, None)))
    tree_guide_us, tree_nodes_us = tree_step(
        rows_states, tokens, offsets, args.tree_depth, args.tree_topk, vocab
    )
    report = {
        "model_dir": args.model_dir,
        "vocab": vocab,
        "answer_tokens": len(tokens),
        "first_compile_ms": round(compile_ms, 1),
        "plain_mask_us": round(statistics.median(fill), 1),
        "verify_node_masks_us": round(statistics.median(nodes), 1),
        "guide_masks_us": round(statistics.median(places), 1),
        "commit_us": round(statistics.median(commits), 1),
        "width": args.width,
        "rows": args.rows,
        "guided_places": guided,
        "plain_step_masks_us": round(statistics.median(plain_us), 1),
        "step_guide_us": round(statistics.median(guide_us), 1),
        "step_verify_nodes_us": round(statistics.median(nodes_us), 1),
        "tree_step_guide_us": round(statistics.median(tree_guide_us), 1),
        "tree_step_verify_nodes_us": round(statistics.median(tree_nodes_us), 1),
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(report))


def tree_step(
    states: list[GrammarState],
    tokens: list[int],
    offsets: list[int],
    depth: int,
    topk: int,
    vocab: int,
) -> tuple[list[float], list[float]]:
    """Steps of a tree's draft places and verify nodes for ``states`` (row ``i`` committed up
    to ``tokens[offsets[i]]``), timed: (the guide's masks, depth after depth; the nodes')."""
    rows = len(states)
    answer = len(tokens)

    def token(offset: int, at: int, choice: int) -> int:
        # The answer's own token first, then others of the answer.
        return tokens[(offset + at + 7 * choice) % answer]

    def path(offset: int, d: int, choice: int) -> list[int]:
        # The answer's first d - 1 tokens, then its d-th or another of the answer's.
        return [token(offset, at, 0) for at in range(d - 1)] + [token(offset, d - 1, choice)]

    # Depth 0: one place, the empty path; each depth past it: ``topk`` paths a row.
    depths = [torch.zeros(rows, 1, 0, dtype=torch.int64)]
    for d in range(1, depth):
        paths = [[path(o, d, p) for p in range(topk)] for o in offsets]
        depths.append(torch.tensor(paths).view(rows, topk, d))
    chain = depth - 1
    # Nodes 1..chain: the answer's tokens (each the child of the one before); chain+1..: a
    # sibling of each of them.
    node_tokens = torch.tensor(
        [
            [token(o, at, 0) for at in range(chain)] + [token(o, at, 1) for at in range(chain)]
            for o in offsets
        ]
    )
    parents = torch.tensor([list(range(chain)) + list(range(chain))] * rows)
    batch = RowGrammars(states)
    widest = max(places.shape[1] for places in depths)
    place_out = xgr.allocate_token_bitmask(rows * widest, vocab)
    node_out = xgr.allocate_token_bitmask(rows * (2 * chain + 1), vocab)
    firsts = [row * (2 * chain + 1) for row in range(rows)]
    guide_us, nodes_us = [], []
    for _ in range(20):
        for state in states:
            state.advance([])  # a new step: no mask of this one known yet
        guide_us.append(
            sum(
                timed(
                    partial(
                        batch.path_masks,
                        place_out,
                        [row * places.shape[1] for row in range(rows)],
                        places,
                    )
                )
                for places in depths
            )
        )
        nodes_us.append(timed(partial(batch.node_masks, node_out, firsts, node_tokens, parents)))
    return guide_us, nodes_us


if __name__ == "__main__":
    main()
