"""The start-up memory plan: from the memory the KV pool may come from (the device's free bytes
once the weights are loaded, or the host's memory on CPU), every size the engine is built with:
the KV pool, the context length it serves, the CUDA graph pool's estimate and its KV bound,
the memory kept out of the pool for the steps, and the rows each drafting width takes. Plain
numbers in, one frozen ``MemoryPlan`` out (or ``MemoryRefusal``); nothing here touches a device
or allocates. What one step's working set is comes from engine/step_memory.py.

Invariants of a plan:

- ``pool_tokens`` is whole pages; ``num_pages`` adds the scratch page (page 0, where padding
  rows read and write).
- The pool holds one request at ``context_length`` plus one step's ``reservation``; where the
  pool sized from memory cannot hold the model's context, the context is lowered to what it
  holds (at least two pages), and an explicit ``--context-length`` is refused instead.
- Sized from memory, the pool never exceeds ``max_running`` such requests, and on CUDA it
  leaves ``activation_bytes`` (the graph pool and the eager steps' working set) out.
- Under tensor parallelism each rank plans from its own free memory, and the sizes taken from
  it (each drafting width's rows, the graphs' KV bound, then the pool) are the smallest over
  the ranks (``agree``), called in that order on every rank.

A decode step's working set grows with its rows times its width, and a drafting step's with
its draft's vocabulary rows too: a speculative engine's widest steps at every running row may
not fit beside any KV pool (a DFlash block of 16 at 256 rows of a 152k vocabulary: about
59 GB). So each drafting width runs for at most the rows whose step fits in
``STEP_MEMORY_SHARE`` of the free memory (``MemoryPlan.drafting_rows``, a batch bucket, agreed
over the ranks), graphs and eager steps alike; plain steps take every running row. The
scheduler never gives a batch a wider step than its rows allow (scheduler/planner.py).

The graph pool's estimate is the largest captured step's working set (``graph_pool_bytes``:
plain steps at the graphs' largest batch, each drafting width at the most rows it takes there)
plus the captures' workspaces and the pool's small-block segments. The width-1 graphs of a
speculative engine are captured after the wide graph of their batch and KV bucket and reuse its
blocks; what each keeps for itself (its static results, under a kilobyte a row) is within the
estimate's slack. Catch-up graphs (engine/deferred.py) are left out: a catch-up's rows are at
most the decode graphs' largest batch (its attention gathers no more), and its tokens (8 rows
of the buffer's capacity at most) pass through the draft alone, with no vocabulary rows,
against the decode step's logits and sampling of every row. A captured pool past the estimate
is a warning only where the memory the plan left free beside the KV pool does not cover the
excess either (``graph_pool_shortfall``); otherwise the estimate's error is logged at debug
level (``DecodeGraphs.capture_all``).

NOTE: a draft model's own KV pool has the target's pages (the same page ids, the draft's
heads); neither it nor the draft's weights are budgeted here: both come out of the memory
``--gpu-memory-fraction`` leaves. Only the drafting step's vocabulary rows are, in its
working set (``StepWidth.draft_logits``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from outrider.daemon.config import ConfigError, ServeConfig
from outrider.daemon.engine.step_memory import (
    Step,
    StepWidth,
    graph_pool_bytes,
    kv_buckets,
    rows_at,
    rows_fitting,
)
from outrider.plugins.models.config import ModelConfig
from outrider.plugins.models.moe.memory import grouped_bytes

log = logging.getLogger("outrider.engine")

MIB = 2**20
# Host memory the CPU KV pool may take by default.
CPU_KV_FRACTION = 0.25
# The share of the free memory (a device's after the weights) one decode step's working set may
# take where it grows with a setting: a drafting width's rows (module docstring), and the KV
# bound of graphs whose attention gathers each row's K/V over it (the torch backend: 64 rows of
# Llama-3.1-8B at a bound of 8192 would take about 11 GB).
STEP_MEMORY_SHARE = 0.125
# cuBLAS's default workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8), which it keeps for good for
# each stream it ran on: the captures' stream keeps one in the graph pool (the 32 MiB block of
# every measured pool, BENCHMARKS.md "The CUDA graph pool"), the warm-ups' stream one beside it.
CAPTURE_WORKSPACE_BYTES = 2 * 32 * 2**20
# The pool's segments of small blocks (the caching allocator keeps every block under 1 MiB,
# such as a graph's static results, in 2 MiB segments): 4 or 5 in every measured pool.
SMALL_SEGMENTS_BYTES = 8 * 2 * 2**20

# The smallest of a value over the tensor-parallel ranks (a collective every rank calls alike).
Agree = Callable[[int], int]


class MemoryRefusal(ConfigError):
    """The KV pool cannot hold one request at an explicit ``--context-length`` (or at two
    pages); the message names the flags that would make it fit."""


@dataclass(frozen=True)
class GraphSettings:
    max_bs: int  # the largest decode batch replayed from a graph
    kv_bounded: bool  # some backend of a decode batch declares graph_kv_bound


@dataclass(frozen=True)
class PlanInputs:
    """What the plan is computed from: the configuration, the model, the rank's facts."""

    config: ServeConfig
    model: ModelConfig
    itemsize: int  # bytes of an activation and of a KV element (the serving dtype)
    kv_bytes_per_token: int  # a token's KV on this rank (its share of the KV heads)
    tensor_parallel_size: int
    context_length: int  # asked for: --context-length, or the model's
    reservation: int  # KV positions one step may write past a row's committed length
    # The widths a drafting step may take, widest first (none without speculation); plain
    # steps (width 1) run besides.
    widths: tuple[StepWidth, ...]
    graphs: GraphSettings | None  # None: decode batches run eagerly
    # The memory the pool may come from: the device's free bytes now that the weights are
    # loaded (CUDA), the host's physical memory (CPU).
    free_bytes: int
    # A token's K/V in the sliding layers on this rank (kept in window pages, not in
    # ``kv_bytes_per_token``) and the widest window; 0: no window pages.
    window_bytes_per_token: int = 0
    window: int = 0
    # Pages a prefix hit gives back to be recomputed (a speculative worker's
    # ``prefix_margin_pages``): with window pages, each request's run keeps that many more.
    margin_pages: int = 0


@dataclass(frozen=True)
class MemoryPlan:
    """Every start-up size, derived once."""

    page_size: int
    pool_tokens: int  # the KV pool, whole pages, the scratch page excluded
    num_pages: int  # the KV pool's pages, the scratch page included (a draft's pool alike)
    requested_context_length: int  # --context-length, or the model's
    context_length: int  # served: the requested one, or lowered to what the pool holds
    reservation: int
    max_pages: int  # pages of one request's table: the context plus the reservation
    max_step_tokens: int  # tokens one step may carry: a prefill chunk or every decode row
    graph_max_bs: int  # the largest decode batch replayed from a graph (0: no graphs)
    graph_max_kv: int  # the largest KV bound graphs are built with (0: no graphs)
    graph_estimate: int  # the graph pool budgeted (0: no graphs)
    # (width, the most rows a decode step of it takes) of each drafting width, widest first:
    # the rows whose working set fits in ``STEP_MEMORY_SHARE`` (0: not one), a batch bucket.
    drafting_rows: tuple[tuple[int, int], ...]
    activation_bytes: int  # kept out of a pool sized from device memory (0: CPU)
    # The free device memory neither the KV pools nor ``activation_bytes`` take (0: CPU).
    headroom_bytes: int
    window_pages: int = 0  # the window page pool, the scratch page included (0: none)
    window: int = 0  # the widest sliding window the window pages serve (0: none)

    @property
    def context_lowered(self) -> bool:
        return self.context_length < self.requested_context_length

    @property
    def max_positions(self) -> int:
        """Positions a request may reach: the served context plus one step's reservation."""
        return self.context_length + self.reservation

    def rows_at(self, width: int, max_running: int) -> int:
        """The most rows a decode step of ``width`` takes: those of the narrowest drafting
        width at least as wide (a chain cut to a request's cap takes its own width's rows or
        more), ``max_running`` for a plain step."""
        return rows_at(self.drafting_rows, width, max_running)


def _alone(value: int) -> int:
    return value


def plan_memory(inputs: PlanInputs, agree: Agree = _alone) -> MemoryPlan:
    """The plan for ``inputs``; ``agree``: the smallest over the ranks (one rank: the value).
    Raises ``MemoryRefusal`` where the pool cannot hold one request."""
    config, model, graphs = inputs.config, inputs.model, inputs.graphs
    itemsize, tp, max_running = inputs.itemsize, inputs.tensor_parallel_size, config.max_running
    reservation = inputs.reservation
    budget = int(inputs.free_bytes * STEP_MEMORY_SHARE)
    drafting_rows = tuple(
        (step.width, agree(rows_fitting(model, itemsize, step, max_running, budget, tp)))
        for step in inputs.widths
    )
    _log_drafting_rows(drafting_rows, max_running)
    # Every kind of decode step at its most rows: plain, then each drafting width that runs.
    steps = [(max_running, StepWidth(1))] + [
        (rows, step) for step, (_, rows) in zip(inputs.widths, drafting_rows, strict=True) if rows
    ]
    graph_kv = inputs.context_length + reservation  # the largest KV bound a graph is built with
    graph_steps = [(min(rows, graphs.max_bs), step) for rows, step in steps] if graphs else []
    if graphs is not None and graphs.kv_bounded:
        graph_kv = agree(_graph_kv_limit(graph_steps, model, itemsize, graph_kv, budget, tp))
    bounded = graph_kv if graphs is not None and graphs.kv_bounded else None
    estimate = _graph_pool_estimate(graph_steps, model, itemsize, bounded, tp)
    activation = (
        _activation_bytes(config, model, itemsize, steps, tp, estimate)
        if config.device == "cuda"
        else 0
    )
    page_size = config.page_size
    max_step_tokens = max(
        config.chunked_prefill_tokens, *(rows * step.width for rows, step in steps)
    )
    window_pages = 0
    if inputs.window_bytes_per_token:
        window_pages = window_pool_pages(
            inputs.window, page_size, max_running, max_step_tokens, reservation,
            inputs.margin_pages,
        )  # fmt: skip
    window_bytes = window_pages * page_size * inputs.window_bytes_per_token
    pool_tokens = agree(
        _pool_tokens(
            config,
            inputs.kv_bytes_per_token,
            inputs.context_length + reservation,
            inputs.free_bytes,
            activation + window_bytes,
        )
    )
    context_length = _fit_check(config, pool_tokens, inputs.context_length, reservation, estimate)
    max_positions = context_length + reservation
    return MemoryPlan(
        page_size=page_size,
        pool_tokens=pool_tokens,
        num_pages=pool_tokens // page_size + 1,  # + the scratch page
        requested_context_length=inputs.context_length,
        context_length=context_length,
        reservation=reservation,
        max_pages=(max_positions + page_size - 1) // page_size,
        max_step_tokens=max_step_tokens,
        graph_max_bs=graphs.max_bs if graphs is not None else 0,
        graph_max_kv=min(graph_kv, max_positions) if graphs is not None else 0,
        graph_estimate=estimate,
        drafting_rows=drafting_rows,
        activation_bytes=activation,
        headroom_bytes=(
            max(
                inputs.free_bytes
                - pool_tokens * inputs.kv_bytes_per_token
                - window_bytes
                - activation,
                0,
            )
            if config.device == "cuda"
            else 0
        ),
        window_pages=window_pages,
        window=inputs.window if window_pages else 0,
    )


def window_pool_pages(
    window: int,
    page_size: int,
    max_running: int,
    step_tokens: int,
    reservation: int,
    margin_pages: int = 0,
) -> int:
    """The window pages no plan exhausts (scheduler/window_pages.py), the scratch page
    included; those only the prefix cache holds give way when a run needs one. A running
    request holds those of its positions from the first that its oldest step not yet
    processed reads (``window - 1`` before that step's lowest start, and ``margin_pages``
    more) to the last that a launched step writes. At a plan at most two steps of a request
    are not processed (the one in flight and the one planned): over every request at most
    two steps' tokens (``step_tokens`` each), a decoding row's writes reaching
    ``reservation`` past its start, and each request's run rounded out to two pages more."""
    per_request = -(-(window - 1) // page_size) + 2 + margin_pages
    spread = -(-(2 * step_tokens + max_running * reservation) // page_size)
    return 1 + max_running * per_request + spread


def _log_drafting_rows(drafting_rows: tuple[tuple[int, int], ...], max_running: int) -> None:
    """One line naming the drafting widths that take fewer than ``max_running`` rows."""
    limited = [(width, rows) for width, rows in drafting_rows if rows < max_running]
    if limited:
        log.info(
            "drafting steps run for at most %s (their working set at more would pass %g%% "
            "of the free memory); larger batches draft fewer tokens or take plain steps",
            ", ".join(f"{rows} rows at {width - 1} drafts" for width, rows in limited),
            100 * STEP_MEMORY_SHARE,
        )  # fmt: skip


def graph_pool_shortfall(plan: MemoryPlan, pool_bytes: int) -> int:
    """How much of a captured graph pool of ``pool_bytes`` neither the plan's estimate nor its
    headroom covers (0: none). Above 0 serving may run out of device memory: the user has to
    give the graphs or the KV pool less. An excess within the headroom is the estimate's error
    alone, nothing a user can act on.

    NOTE: a draft model's KV pool also comes out of the headroom (module docstring), so a
    speculative engine may run short before this says so."""
    return max(pool_bytes - plan.graph_estimate - plan.headroom_bytes, 0)


def _graph_kv_limit(
    steps: list[Step],
    model: ModelConfig,
    itemsize: int,
    max_positions: int,
    budget: int,
    tensor_parallel_size: int = 1,
) -> int:
    """The largest KV bound graphs of a backend whose work grows with it are captured for:
    the largest bucket at which every graphed step of ``steps`` stays within ``budget`` (the
    smallest bucket at least). Batches past it run eagerly."""
    buckets = kv_buckets(max_positions, bounded=True)
    fitting = [
        kv
        for kv in buckets
        if max(
            graph_pool_bytes(
                model, itemsize, bs, step.width, kv, tensor_parallel_size, step.draft_logits
            )
            for bs, step in steps
        )
        <= budget
    ]
    limit = fitting[-1] if fitting else buckets[0]
    if limit < max_positions:
        log.info(
            "decode graphs cover KV bounds up to %d of %d: the attention backend's graphs grow "
            "with the bound, and %d rows at the next bound would take over %d%% of the free "
            "memory; longer decode batches run eagerly",
            limit, max_positions, steps[0][0], round(100 * STEP_MEMORY_SHARE),
        )  # fmt: skip
    return limit


def _graph_pool_estimate(
    steps: list[Step],
    model: ModelConfig,
    itemsize: int,
    kv_bound: int | None,
    tensor_parallel_size: int,
) -> int:
    """The graph pool the fit check budgets: the largest graphed step of ``steps`` (at
    ``kv_bound`` where the attention's graphs grow with the bound, else None), the captures'
    workspaces and the pool's small-block segments (0 without graphs)."""
    if not steps:
        return 0
    step = max(
        graph_pool_bytes(
            model, itemsize, bs, s.width, kv_bound, tensor_parallel_size, s.draft_logits
        )
        for bs, s in steps
    )
    return step + CAPTURE_WORKSPACE_BYTES + SMALL_SEGMENTS_BYTES


def _pool_tokens(
    config: ServeConfig,
    kv_bytes_per_token: int,
    minimum: int,
    free: int,
    kept: int,
) -> int:
    """KV pool size in tokens. ``minimum``: one request at the full context plus one step's
    reservation; ``free``: as ``PlanInputs.free_bytes``; ``kept``: device memory kept out of
    the pool on CUDA (``_activation_bytes``, the window pages). The pool never exceeds
    ``max_running`` such requests: a small model on a large GPU would otherwise get tens of
    millions of pages that no request can use and that every walk over the page table pays
    for."""
    if config.kv_cache_tokens:
        return config.kv_cache_tokens // config.page_size * config.page_size
    # NOTE: whole pages, or the cap below rounds under one request's need.
    minimum = -(-minimum // config.page_size) * config.page_size
    per_token = kv_bytes_per_token
    if config.device == "cuda":
        budget = int(free * config.gpu_memory_fraction)
        budget -= kept
    else:
        budget = int(free * CPU_KV_FRACTION)
        # On CPU a pool of a few contexts is plenty.
        budget = min(budget, 4 * minimum * per_token)
    tokens = min(max(budget // per_token, 0), config.max_running * minimum)
    return tokens // config.page_size * config.page_size


def _experts_bytes(
    config: ServeConfig, model: ModelConfig, itemsize: int, steps: list[Step], tp: int
) -> int:
    """A mixture of experts' grouped path (``moe/memory.py``) at the largest eager step: an
    EXTEND chunk, or a decode step of ``steps`` at its most rows; 0 for a dense model."""
    if model.moe is None:
        return 0
    tokens = max(config.chunked_prefill_tokens, *(rows * step.width for rows, step in steps))
    inter = model.moe.intermediate_size // tp
    return grouped_bytes(tokens, model.moe.top_k, model.hidden_size, inter, itemsize)


def _activation_bytes(
    config: ServeConfig,
    model: ModelConfig,
    itemsize: int,
    steps: list[Step],
    tp: int,
    graph_estimate: int,
) -> int:
    """Device memory kept out of the KV pool for the steps: the CUDA graph pool, plus the
    working set of the eager steps, which cannot use it. Every graph's step first runs
    eagerly before its capture, so the eager share is at least the largest graphed step;
    otherwise a rough allowance (EXTEND chunks, plain decode batches past the graphs: logits
    and sampling of every running row) or the widest drafting step of ``steps`` at its most
    rows, whichever is larger, plus a mixture of experts' grouped path."""
    # NOTE: without the eager share, the warm-up run before the largest capture ran out of
    # memory on an H100 (Llama-3.1-8B, torch attention, 64 rows, KV bound 8208).
    drafting = max(
        (
            graph_pool_bytes(model, itemsize, rows, step.width, None, tp, step.draft_logits)
            for rows, step in steps
            if step.width > 1
        ),
        default=0,
    )
    eager = max(512 * MIB + config.max_running * model.vocab_size * 4 * 4, drafting)
    eager += _experts_bytes(config, model, itemsize, steps, tp)
    return max(eager, graph_estimate) + graph_estimate


def _fit_check(
    config: ServeConfig,
    pool_tokens: int,
    context_length: int,
    reservation: int,
    graph_estimate: int,
) -> int:
    """The context length served: the pool must hold one such request plus one step's
    reservation."""
    if pool_tokens >= context_length + reservation:
        return context_length
    lowered = pool_tokens - reservation
    if config.context_length or lowered < 2 * config.page_size:
        graphs = ""
        if graph_estimate:
            graphs = (
                f", or lower --cuda-graph-max-bs (the graph pool takes about "
                f"{graph_estimate // MIB} MiB, and as much again while capturing) or pass "
                "--disable-cuda-graph"
            )
        raise MemoryRefusal(
            f"the KV pool holds {pool_tokens} tokens, fewer than --context-length "
            f"{context_length} plus {reservation}: raise --kv-cache-tokens or "
            f"--gpu-memory-fraction, or lower --context-length{graphs}"
        )
    log.warning(
        "KV pool of %d tokens: context length lowered from %d to %d",
        pool_tokens,
        context_length,
        lowered,
    )
    return lowered
