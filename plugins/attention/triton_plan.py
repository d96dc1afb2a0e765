"""The ``triton`` backend's launches, from host bounds only (no Triton import: the registry and
tests read it anywhere).

A launch depends on the batch size, the query width and the attention shape, never on
``max_kv`` or a length: a decode graph captured for a batch size replays for any KV length,
and a batch runs the same launch eagerly or from a graph (the same rounding).

The split count fills the GPU when rows are few: about ``PROGRAMS_PER_SM`` programs per SM
across ``bs x kv_heads x query tiles x splits``, at most ``MAX_KV_SPLITS``. Prompt chunks bring
enough query tiles to run with one split (no merge); decode, verify and DFlash blocks of a few
rows split each row's KV.
"""

from __future__ import annotations

from dataclasses import dataclass

# What a query attends (the kernels' MODE).
MODE_CAUSAL = 0
MODE_NON_CAUSAL = 1
MODE_TREE = 2

PROGRAMS_PER_SM = 2
MAX_KV_SPLITS = 32
# tl.dot takes tiles of at least 16 x 16.
MIN_BLOCK = 16
MAX_BLOCK_M = 64
MAX_HEAD_DIM = 256
# A split's share of a row's KV is rounded up to this many positions: short rows use fewer
# splits (the rest see nothing and the merge weighs them 0).
SPLIT_GRAIN = 16
LOG2_E = 1.4426950408889634  # the kernels' softmax runs in base 2
# Rows of one query tile stream their KV: two stages beat Triton's default of three in every
# such batch timed on an H200, 1.33x at 256 rows (BENCHMARKS.md, fourteenth session). Longer
# rows (prompts) keep Triton's own, untimed.
SHORT_ROW_STAGES = 2


@dataclass(frozen=True)
class LaunchPlan:
    """One forward's launch."""

    mode: int  # MODE_*
    block_m: int  # (query, head) pairs per tile
    block_n: int  # KV positions per loop iteration
    query_tiles: int  # tiles over a row's max_q x group pairs
    splits: int  # KV splits per (row, kv head, query tile)

    @property
    def merged(self) -> bool:
        """Splits write partial outputs that a second kernel merges."""
        return self.splits > 1

    def stages(self, chosen: int = 0) -> int:
        """The KV loop's pipeline depth: ``chosen`` (``TritonOptions.num_stages``), else
        ``SHORT_ROW_STAGES`` where each row's queries fit one tile (decode, verify and draft
        batches) and 0, Triton's own (3 on Hopper), for longer rows."""
        return chosen or (SHORT_ROW_STAGES if self.query_tiles == 1 else 0)


def launch_plan(
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    bs: int,
    max_q: int,
    mode: int,
    programs_wanted: int,
    kv_splits: int = 0,
    block_n: int = 0,
) -> LaunchPlan:
    """The launch for ``bs`` rows of at most ``max_q`` queries. ``programs_wanted``: programs
    that fill the device; ``kv_splits`` > 0 fixes the split count instead, ``block_n`` > 0 the
    KV positions a loop step."""
    pairs = max_q * (num_q_heads // num_kv_heads)
    block_m = min(MAX_BLOCK_M, max(MIN_BLOCK, 1 << (pairs - 1).bit_length()))
    query_tiles = -(-pairs // block_m)
    programs = bs * num_kv_heads * query_tiles
    splits = kv_splits or max(1, min(MAX_KV_SPLITS, programs_wanted // programs))
    block_n = block_n or (64 if head_dim <= 128 else 32)
    return LaunchPlan(mode, block_m, block_n, query_tiles, splits)
