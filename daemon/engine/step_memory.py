"""A decode step's memory: the working set of a step of so many rows and tokens a row
(``graph_pool_bytes``, the estimate the start-up memory plan and the CUDA graph pool are sized
by), the widths a drafting step may take (``StepWidth``) and the most rows each takes
(``rows_at``, ``rows_fitting``), and the padded batch sizes and KV bounds decode graphs are
keyed by (``batch_buckets``, ``kv_buckets``). Plain numbers in and out; engine/memory_plan.py
decides the budgets.

Invariant: a step's working set grows with its rows and with its width, so a wider step never
takes more rows than a narrower one (``rows_at`` relies on it).
"""

from __future__ import annotations

from dataclasses import dataclass

from outrider.plugins.models.config import ModelConfig

MIN_KV_BUCKET = 64
KV_BUCKET_GROWTH = 2  # each KV bucket is this many times the previous one
# Sampling scratch per logit of a sampled row at its peak: the sorted values and their int64
# ids, the softmax and its running mass, the race's int64 hash words and its float scores;
# and the float32 copy of a batch that adjusts its logits (engine/penalties.py).
SAMPLING_BYTES_PER_LOGIT = 44
# A drafting step's share per logit of its rows (``draft_logit_rows``): measured with DFlash b16
# on Qwen3-8B, 64 sampled rows, eager: 7,251 MiB at the draft's peak over 64 x 15 rows of
# 151,936 logits. Within a capture the pool does not hand the draft's freed blocks to the
# verify after it: the captured pool measured the draft's peak plus the verify's.
DRAFT_BYTES_PER_LOGIT = 52


@dataclass(frozen=True)
class StepWidth:
    """A width a drafting step may take (drafting_setup.py's ``step_widths``)."""

    width: int  # tokens a row verifies, the root included
    draft_logits: int = 0  # vocabulary logits its drafting scores per batch row


# A decode step as the plan sizes it: its rows and its width.
Step = tuple[int, StepWidth]


def rows_at(drafting_rows: tuple[tuple[int, int], ...], width: int, max_running: int) -> int:
    """The most rows a decode step of ``width`` takes, from (width, most rows) of each
    drafting width (``MemoryPlan.drafting_rows``): those of the narrowest width at least as
    wide, ``max_running`` for a plain step or where none is listed."""
    if width == 1:
        return max_running
    # Rows shrink as widths grow: the narrowest width at least ``width`` has the most.
    return max((rows for w, rows in drafting_rows if w >= width), default=max_running)


def rows_fitting(
    model: ModelConfig, itemsize: int, step: StepWidth, max_running: int, budget: int, tp: int
) -> int:
    """The most rows, a batch bucket and ``max_running`` at most, whose decode step of
    ``step`` has a working set within ``budget`` (0: not one row)."""
    per_row = graph_pool_bytes(model, itemsize, 1, step.width, None, tp, step.draft_logits)
    rows = min(budget // per_row, max_running)
    return max((bs for bs in batch_buckets(max_running) if bs <= rows), default=0)


def batch_buckets(max_bs: int) -> list[int]:
    """Padded batch sizes: every size up to 8, then every 8 (the small ones matter most)."""
    sizes = list(range(1, min(max_bs, 8) + 1)) + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def kv_buckets(max_kv: int, bounded: bool) -> list[int]:
    """KV bounds graphs are built with: growing from ``MIN_KV_BUCKET`` by ``KV_BUCKET_GROWTH``
    up to ``max_kv`` when the backends' work grows with the bound (``bounded``), else
    ``max_kv`` alone."""
    sizes = []
    size = MIN_KV_BUCKET
    while bounded and size < max_kv:
        sizes.append(size)
        size *= KV_BUCKET_GROWTH
    return [*sizes, max_kv]


def graph_pool_bytes(
    model: ModelConfig,
    itemsize: int,
    bs: int,
    width: int,
    kv_bound: int | None,
    tensor_parallel_size: int = 1,
    draft_logits: int = 0,
) -> int:
    """Estimated peak working set of a decode step (a captured one's is what the shared graph
    pool holds): ``bs`` rows of ``width`` tokens, all sampled, through the target model (one rank's
    shard of it under tensor parallelism: its heads, MLP rows and vocabulary slice, plus the
    gathered logits). ``kv_bound``: the largest KV bucket when a backend declares
    ``graph_kv_bound`` (budgeted as gathering each row's K and V over the bound at query-head
    width, with a boolean mask), None when the backends' work does not grow with it.
    ``draft_logits``: vocabulary logits a drafting step scores per batch row
    (``StepWidth.draft_logits``), budgeted beside the target's at
    ``DRAFT_BYTES_PER_LOGIT``; the draft's layers are small next to them."""
    tokens, tp = bs * width, tensor_parallel_size
    q_width = model.num_q_heads // tp * model.head_dim
    kv_width = model.num_kv_heads // tp * model.head_dim
    # One layer at a time: the residual stream, its norm (statistics in float32), the q/k/v
    # projections and the attention output, the MLP's (or the routed experts') gate and up and
    # their product.
    layer = tokens * (
        itemsize * (3 * model.hidden_size + 2 * q_width + 2 * kv_width)
        + 4 * model.hidden_size
        + itemsize * 3 * (model.mlp_rows_per_token // tp)
    )
    # The head's output (gathered: the rank's slice too, when sharded), its float32 copy, and
    # the sampling scratch of every row.
    head = itemsize * (1 if tp == 1 else 1 + 1 / tp)
    logits = int(tokens * model.vocab_size * (head + 4 + SAMPLING_BYTES_PER_LOGIT))
    attention = 0
    if kv_bound is not None:
        gathered = 2 * (kv_width + q_width) * itemsize  # K and V, as stored and per q head
        attention = bs * kv_bound * (gathered + 8) + tokens * kv_bound  # + indices, mask
    return layer + logits + attention + _draft_bytes(bs, draft_logits)


def _draft_bytes(bs: int, draft_logits: int) -> int:
    """A drafting step's vocabulary rows in the graph pool: ``draft_logits`` a batch row."""
    return bs * draft_logits * DRAFT_BYTES_PER_LOGIT
