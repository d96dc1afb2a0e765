"""Builds the in-process engine from a ``ServeConfig``: plugin checks, model, the start-up
memory plan and the KV pool it sizes, attention backends per phase, runner, scheduler, loop,
graph captures, warm-up. It wires; what is decided from the flags and the plugins is decided
beside it: the memory plan (memory_plan.py), whether and how decode batches replay graphs
(graph_settings.py), how the engine drafts (drafting_setup.py), which attention backend
instances it makes (attention_setup.py)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

import torch

from outrider.daemon.config import ConfigError, ServeConfig
from outrider.daemon.engine.accept import step_reservation
from outrider.daemon.engine.attention_setup import (
    log_choices,
    new_backend,
    remembered,
    target_backends,
)
from outrider.daemon.engine.drafting_setup import (
    adapts,
    cuts_steps,
    drafting_policy,
    drafting_widths,
    speculative_plugin,
    step_widths,
)
from outrider.daemon.engine.follower import Follower
from outrider.daemon.engine.graph_capture import capture_progress
from outrider.daemon.engine.graph_settings import (
    CYCLE_PHASES,
    attention_caps,
    decode_graphs,
    graph_settings,
)
from outrider.daemon.engine.memory_plan import MIB, MemoryPlan, PlanInputs, plan_memory
from outrider.daemon.engine.penalties import TokenHistory
from outrider.daemon.engine.ranks import RankChannel
from outrider.daemon.engine.runner import ModelRunner, RunnerLimits, target_phases
from outrider.daemon.engine.slots import SlotState
from outrider.daemon.engine.verify import SimulatedAcceptance, Verifier
from outrider.daemon.engine.warm_up import warm_up
from outrider.daemon.grammar.tool_calls import tool_call_format
from outrider.daemon.harmony import output_format
from outrider.daemon.internal import ModelFacts
from outrider.daemon.processes.preflight import resolve_plugins
from outrider.daemon.sampling_defaults import resolve_sampling_defaults
from outrider.daemon.scheduler.drafting import AlternateDrafting, DraftPolicy
from outrider.daemon.scheduler.drill import retract_drill
from outrider.daemon.scheduler.finish import FinishChecker, TextDecoder
from outrider.daemon.scheduler.limits import SchedulerLimits
from outrider.daemon.scheduler.loop import EngineLoop
from outrider.daemon.scheduler.radix import PrefixCache
from outrider.daemon.scheduler.scheduler import Scheduler
from outrider.daemon.scheduler.step_log import StepLog
from outrider.daemon.tokenizer import Tokenizer, load_tokenizer
from outrider.plugins.api import Phase
from outrider.plugins.attention.base import AttentionBackend
from outrider.plugins.debug import debug_knob
from outrider.plugins.device import KVCache
from outrider.plugins.models.config import ModelConfig, kv_bytes_per_token, load_eos_ids, model_dir
from outrider.plugins.models.loader import load_model
from outrider.plugins.models.parallel import SINGLE, TPGroup
from outrider.plugins.models.weights import LoadProgress
from outrider.plugins.speculative.base import NoDraft, WorkerContext

log = logging.getLogger("outrider.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Engine:
    config: ServeConfig
    model_config: ModelConfig
    facts: ModelFacts
    loop: EngineLoop
    context_length: int
    # Tensor parallelism: rank 0's channel to the other ranks (ranks.py); None: one rank.
    channel: RankChannel | None = None

    @property
    def scheduler(self) -> Scheduler:
        return self.loop.scheduler

    def stop_ranks(self) -> None:
        """Tensor parallelism: end the other ranks' ``Follower.run`` (nothing in flight)."""
        assert self.loop.in_flight is None, "the other ranks must run every launched step"
        if self.channel is not None:
            self.channel.stop()


@dataclass(frozen=True)
class _Built:
    """What every rank builds alike: the runner over its shard and the memory plan it was
    built with."""

    runner: ModelRunner
    model_config: ModelConfig
    dtype_name: str
    plan: MemoryPlan
    tokenizer: Tokenizer | None
    speculative: bool
    attention_routes: Mapping[Phase, str]  # as chosen (attention_choice.py)
    widths: tuple[int, ...]  # a decode batch's, widest first (``drafting_widths``)


def build_engine(
    config: ServeConfig, progress: LoadProgress | None = None, tp: TPGroup = SINGLE
) -> Engine:
    """The engine of rank 0 (of the only rank in a world of one): runner, scheduler, loop,
    warmed up. Under tensor parallelism (``tp``) every other rank calls ``build_follower``
    at the same time, and rank 0 ends them with ``Engine.stop_ranks``."""
    assert tp.rank == 0, "the other ranks build followers"
    channel = RankChannel(tp) if tp.size > 1 else None
    built = _build_runner(config, progress, tp, channel)
    runner, model_config, shape = built.runner, built.model_config, built.runner.shape
    if channel is not None:
        runner.lead(channel)
    plan = built.plan
    context_length, page_size = plan.context_length, plan.page_size
    tokenizer = built.tokenizer
    eos = load_eos_ids(config.model, model_config)
    decoder_factory: Callable[[], TextDecoder] | None = (
        tokenizer.decoder if tokenizer is not None else None
    )

    one_rank = runner.channel is None

    def new_scheduler(policy: DraftPolicy | None = None) -> Scheduler:
        return Scheduler(
            SchedulerLimits(
                max_running=config.max_running,
                max_pages_per_request=plan.max_pages,
                chunked_prefill_tokens=config.chunked_prefill_tokens,
                context_length=context_length,
                prefix_margin_pages=runner.worker.prefix_margin_pages,
                draft_state=shape.speculative and runner.worker.draft_state,
                grammar_drafts=one_rank,
                late_masks=one_rank,
                mixed_batches=config.mixed_batches,
                max_prompt_run=config.max_prompt_run,
                shorter_chains=cuts_steps(shape, runner.worker) and not shape.tree,
                drafting_rows=tuple(
                    (width, plan.rows_at(width, config.max_running))
                    for width in built.widths
                    if width > 1
                ),
                window_pages=plan.window_pages,
                window=plan.window,
            ),
            shape,
            PrefixCache(plan.num_pages, page_size),
            FinishChecker(eos, context_length, decoder_factory),
            policy,
            retract_drill(),
        )

    loop = EngineLoop(
        new_scheduler(),
        runner,
        overlap=config.overlap,
        check_kv=bool(debug_knob("OUTRIDER_DEBUG_KV_CHECK")),
    )
    widths = built.widths
    if adapts(config, shape):  # plain steps and every chain depth too, before READY
        loop.scheduler.use_policy(AlternateDrafting(widths[:-1]))
    warm_up(loop, ladder=runner.device.type == "cuda")  # JIT kernels compile there
    policy = drafting_policy(config, shape, widths, loop, plan.pool_tokens)
    _enable_debug_checks(runner)
    # Forget the warm-up's cache entries and counters.
    loop.scheduler = new_scheduler(policy)
    if config.step_log:  # serving turns only
        counts = partial(_allocator_calls, runner.device) if runner.device.type == "cuda" else None
        loop.step_log = StepLog.open(config.step_log, counts)
    dtype_name = built.dtype_name
    facts = ModelFacts(
        model=config.model,
        vocab_size=model_config.vocab_size,
        context_length=context_length,
        kv_total_tokens=plan.pool_tokens,
        eos_token_ids=sorted(eos),
        tokenizer_dir=str(model_dir(config.model)) if tokenizer is not None else None,
        max_new_tokens_default=None,
        configuration={
            "device": config.device,
            "dtype": dtype_name,
            "tensor_parallel_size": tp.size,
            "page_size": page_size,
            "max_running": config.max_running,
            "context_length": context_length,
            "overlap": config.overlap,
            "chunked_prefill_tokens": config.chunked_prefill_tokens,
            "load_format": config.load_format,
            "speculative_num_draft_tokens": shape.width if built.speculative else 0,
            # The format a request's tools are called in (daemon/grammar/tool_calls.py); None: none.
            "tool_call_format": tool_call_format(tokenizer.chat_template if tokenizer else None),
            # "harmony": chat outputs split into answer, reasoning and calls (daemon/harmony.py).
            "output_format": output_format(model_config.model_type, tokenizer),
        },
        plugins={f"attention.{phase}": name for phase, name in built.attention_routes.items()}
        | {"speculative": config.speculative_algorithm},
        speculative_algorithm=config.speculative_algorithm,
    )
    return Engine(config, model_config, facts, loop, context_length, channel)


def build_follower(
    config: ServeConfig, tp: TPGroup, progress: LoadProgress | None = None
) -> Follower:
    """Rank ``tp.rank`` > 0 of tensor-parallel ranks: the runner over its shard, built as
    rank 0's ``build_engine`` builds its own (the same collectives in the same order); its
    ``run`` then runs rank 0's plans, warm-up included, until ``Engine.stop_ranks``."""
    assert tp.rank > 0, "rank 0 builds the engine"
    channel = RankChannel(tp)
    built = _build_runner(config, progress, tp, channel)
    _enable_debug_checks(built.runner)
    return Follower(built.runner, channel, overlap=config.overlap)


def _build_runner(
    config: ServeConfig,
    progress: LoadProgress | None,
    tp: TPGroup,
    channel: RankChannel | None,
) -> _Built:
    """Plugins, the model's shard, the memory plan (its sizes agreed over the ranks) and the
    KV pool it sizes, backends, the speculative worker, the runner and its CUDA graphs."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    if config.tensor_parallel_size != tp.size:
        raise ConfigError(
            f"--tensor-parallel-size {config.tensor_parallel_size}: this process is one of "
            f"{tp.size} ranks"
        )
    model_config = ModelConfig.from_pretrained(config.model)
    dtype_name = config.serving_dtype(model_config.dtype)
    dtype = _DTYPES[dtype_name]
    window_bytes = _window_bytes_per_token(config, model_config, dtype_name, tp.size)
    capability = torch.cuda.get_device_capability() if config.device == "cuda" else None
    served = resolve_plugins(config, dtype_name, capability)  # what plugins --check resolves
    if tp.rank == 0:
        log_choices(config, model_config.dtype, dtype_name, capability, served.attention)
    plugins = served.plugins
    device = torch.device(config.device)
    context_length = config.context_length or model_config.max_position_embeddings
    speculative = speculative_plugin(plugins)
    shape = plugins.shape
    reservation = step_reservation(shape.kv_span, shape.max_commit, config.page_size)
    model, model_config = load_model(
        config.model,
        dtype=dtype,
        device=device,
        load_format=config.load_format,
        max_positions=context_length + reservation,
        progress=progress,
        tp=tp,
    )

    def agreed(value: int) -> int:  # sizes from each rank's free memory: the smallest
        return value if channel is None else channel.agree_min(value)

    graphing = graph_settings(config, plugins)
    inputs = PlanInputs(
        config=config,
        model=model_config,
        itemsize=dtype.itemsize,
        kv_bytes_per_token=kv_bytes_per_token(model_config, dtype_name, tp.size)
        - window_bytes
        + TokenHistory.BYTES_PER_TOKEN,
        tensor_parallel_size=tp.size,
        context_length=context_length,
        reservation=reservation,
        widths=step_widths(shape, speculative, config, model_config.vocab_size),
        graphs=graphing,
        free_bytes=_free_bytes(config.device),
        window_bytes_per_token=window_bytes,
        window=max(model_config.windows, default=0),
        margin_pages=speculative.worker_class.prefix_margin_pages if speculative else 0,
    )
    plan = plan_memory(inputs, agreed)
    context_length, page_size, num_pages = plan.context_length, plan.page_size, plan.num_pages
    attention_shape = model.attention_shape  # the rank's heads
    kv = KVCache.allocate(
        model_config.num_layers, num_pages, page_size, attention_shape, dtype, device,
        window_pages=plan.window_pages or None,
    )  # fmt: skip
    if tp.rank == 0:
        _log_pools(plan, window_bytes)
    tokenizer = load_tokenizer(model_dir(config.model))
    vocab_limit = model_config.vocab_size
    if tokenizer is not None:
        vocab_limit = min(vocab_limit, len(tokenizer))
    limits = RunnerLimits(
        max_slots=config.max_running,
        max_pages=plan.max_pages,
        max_tokens=plan.max_step_tokens,
        vocab_limit=vocab_limit,
        vocab_size=model_config.vocab_size,
    )
    slots = SlotState(config.max_running, plan.max_pages, device, kv)
    # NOTE: a draft model is sharded as the target is (its worker gets the rank's tp); it
    # shares the target's vocabulary-parallel embedding and head, whose collectives every
    # rank runs alike: greedy drafts from the head's local slice, sampled ones gathered.
    draft_backends: list[AttentionBackend] = []
    worker_context = WorkerContext(
        device=device,
        dtype=dtype,
        shape=shape,
        max_slots=config.max_running,
        page_table=slots.page_table,
        page_size=page_size,
        num_pages=num_pages,
        context_length=context_length,
        vocab_limit=vocab_limit,
        logits_width=model_config.vocab_size,
        max_positions=plan.max_positions,
        target_layers=model_config.num_layers,
        embed=model.model.embed_tokens,
        lm_head=model.compute_logits,
        local_lm_head=model.local_logits,
        model=config.model,
        draft_model=config.draft_model,
        load_format=config.load_format,
        make_backend=lambda phase, shape: remembered(
            draft_backends, new_backend(plugins, phase, shape, device)
        ),
        tp=tp,
    )
    worker = (
        speculative.worker_class(worker_context, speculative.options)
        if speculative is not None
        else NoDraft(worker_context)
    )
    backends = target_backends(plugins, target_phases(shape), attention_shape, device)
    adaptive = adapts(config, shape)
    widths = drafting_widths(config, shape, worker)
    graphs = decode_graphs(
        graphing,
        plan,
        vocab_limit,
        config.max_running,
        widths,
        worker.deferred_positions,
        unfed_plain=adaptive and worker.draft_state,
        sampled_cuts=resolve_sampling_defaults(config).sampling.cuts,
    )
    mean = config.speculative_simulate_acceptance  # benchmarks: dummy weights
    simulated = SimulatedAcceptance(mean, shape, device) if mean else None
    verifier = Verifier(shape, kv, slots, vocab_limit, device, simulated)
    runner = ModelRunner(
        model, kv, backends, slots, worker, shape, limits, verifier, device, graphs=graphs,
        exact_cycle_lengths=any(attention_caps(plugins, p).host_plans for p in CYCLE_PHASES),
        draft_backends=draft_backends,
    )  # fmt: skip
    # NOTE: captures and warm-up compile kernels (JIT backends, CUDA graphs), and compilers
    # synchronise: the sync check starts after them. Every rank captures the same keys in
    # the same order (their forwards' collectives pair up).
    if graphs is not None:
        catch_ups = runner.catch_ups
        graphs.capture_all(
            partial(runner.graph_steps.capture, graphs=graphs),
            plan,
            capture_progress(),
            partial(catch_ups.capture, graphs=graphs) if catch_ups is not None else None,
        )
    return _Built(
        runner=runner,
        model_config=model_config,
        dtype_name=dtype_name,
        plan=plan,
        tokenizer=tokenizer,
        speculative=speculative is not None,
        attention_routes=served.attention.phase_routes,
        widths=widths,
    )


def _enable_debug_checks(runner: ModelRunner) -> None:
    """The debug knobs' checks, from the first served step on."""
    runner.enable_sync_check(bool(debug_knob("OUTRIDER_DEBUG_SYNC_CHECK")))
    if debug_knob("OUTRIDER_DEBUG_RELAY_CHECK"):
        runner.slots.enable_relay_check()


def _allocator_calls(device: torch.device) -> int:
    """The caching allocator's calls to the driver on ``device`` so far: memory mapped,
    unmapped and allocations retried after a flush (the step log's ``allocator_calls``)."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    return sum(
        stats.get(key, 0) for key in ("num_device_alloc", "num_device_free", "num_alloc_retries")
    )


def _free_bytes(device: str) -> int:
    """The memory the KV pool is sized from (``PlanInputs.free_bytes``): the device's free
    bytes now, or the host's physical memory."""
    if device == "cuda":
        free, _total = torch.cuda.mem_get_info()
        return free
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _window_bytes_per_token(
    config: ServeConfig, model: ModelConfig, dtype_name: str, tp_size: int
) -> int:
    """The K/V bytes a token takes in the model's sliding layers on one rank, kept in
    window pages; 0 where they are kept whole (--whole-sliding-kv) or there are none."""
    sliding = sum(window > 0 for window in model.windows)
    if config.whole_sliding_kv or not sliding:
        return 0
    return kv_bytes_per_token(model, dtype_name, tp_size) // model.num_layers * sliding


def _log_pools(plan: MemoryPlan, window_bytes_per_token: int) -> None:
    """One line with the KV pool's tokens, and the window pages' beside where there are."""
    windows = ""
    if plan.window_pages:
        mib = plan.window_pages * plan.page_size * window_bytes_per_token // MIB
        windows = (
            f"; the sliding layers' window pages: {plan.window_pages - 1} of {plan.page_size} "
            f"positions ({mib} MiB a rank)"
        )
    log.info(
        "KV pool: %d tokens in pages of %d (context %d)%s",
        plan.pool_tokens, plan.page_size, plan.context_length, windows,
    )  # fmt: skip
