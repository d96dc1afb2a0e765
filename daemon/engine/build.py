"""Builds the in-process engine from a ``ServeConfig``: plugin checks, model, KV pool (with
the start-up fit check), attention backends per phase, runner, scheduler, loop, warm-up."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch

from outrider.daemon.config import ConfigError, ServeConfig, debug_knob
from outrider.daemon.engine.accept import step_reservation
from outrider.daemon.engine.forward import KVCache
from outrider.daemon.engine.runner import ModelRunner, RunnerLimits
from outrider.daemon.internal import ModelFacts, SamplingSpec, TokenizedRequest
from outrider.daemon.models.config import ModelConfig, load_eos_ids, model_dir
from outrider.daemon.models.loader import LoadProgress, load_model
from outrider.daemon.scheduler.finish import FinishChecker, TextDecoder
from outrider.daemon.scheduler.loop import EngineLoop
from outrider.daemon.scheduler.radix import PrefixCache
from outrider.daemon.scheduler.scheduler import Scheduler, SchedulerLimits
from outrider.daemon.tokenizer import load_tokenizer
from outrider.plugins.api import NO_DRAFT, Phase, SpeculativeCapabilities, StepShape, verify_width
from outrider.plugins.attention.base import AttentionBackend, AttentionShape
from outrider.plugins.registry import SPECULATIVE_FLAG, discover
from outrider.plugins.speculative.base import SpeculativeWorker, WorkerContext
from outrider.plugins.speculative.draft_config import read_config

log = logging.getLogger("outrider.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Host memory the CPU KV pool may take by default.
_CPU_KV_FRACTION = 0.25


@dataclass
class Engine:
    config: ServeConfig
    model_config: ModelConfig
    facts: ModelFacts
    loop: EngineLoop
    context_length: int

    @property
    def scheduler(self) -> Scheduler:
        return self.loop.scheduler


def resolve_dtype(config: ServeConfig, model_config: ModelConfig) -> str:
    if config.dtype != "auto":
        return config.dtype
    if config.device == "cpu":
        return "float32"
    return model_config.dtype if model_config.dtype in _DTYPES else "bfloat16"


def check_plugins(config: ServeConfig, dtype: str) -> None:
    capability = torch.cuda.get_device_capability() if config.device == "cuda" else None
    ctx = config.check_context(dtype, capability)
    problems = discover().check(ctx)
    if problems:
        raise ConfigError("the configuration cannot run:\n  " + "\n  ".join(map(str, problems)))


def build_engine(config: ServeConfig, progress: LoadProgress | None = None) -> Engine:
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    model_config = ModelConfig.from_pretrained(config.model)
    dtype_name = resolve_dtype(config, model_config)
    check_plugins(config, dtype_name)
    device = torch.device(config.device)
    context_length = config.context_length or model_config.max_position_embeddings
    speculative = _speculative_plugin(config)
    shape = speculative.shape if speculative is not None else NO_DRAFT
    width = shape.width
    reservation = step_reservation(shape.kv_span, shape.max_commit, config.page_size)
    model, model_config = load_model(
        config.model,
        dtype=_DTYPES[dtype_name],
        device=device,
        load_format=config.load_format,
        max_positions=context_length + reservation,
        progress=progress,
    )
    pool_tokens = _pool_tokens(config, model_config, dtype_name, context_length + reservation)
    context_length = _fit_check(config, pool_tokens, context_length, reservation)
    page_size = config.page_size
    num_pages = pool_tokens // page_size + 1  # + the scratch page
    kv = KVCache.allocate(
        model_config.num_layers,
        num_pages,
        page_size,
        model_config.num_kv_heads,
        model_config.head_dim,
        _DTYPES[dtype_name],
        device,
    )
    tokenizer = load_tokenizer(model_dir(config.model))
    vocab_limit = model_config.vocab_size
    if tokenizer is not None:
        vocab_limit = min(vocab_limit, len(tokenizer))
    max_pages = (context_length + reservation + page_size - 1) // page_size
    limits = RunnerLimits(
        max_slots=config.max_running,
        max_pages=max_pages,
        max_tokens=max(config.chunked_prefill_tokens, config.max_running * width),
        vocab_limit=vocab_limit,
    )
    runner = ModelRunner(model, kv, _backends(config, model_config, device), limits, device)
    if speculative is not None:
        worker_context = WorkerContext(
            device=device,
            dtype=_DTYPES[dtype_name],
            shape=shape,
            max_slots=config.max_running,
            page_table=runner.page_table,
            page_size=page_size,
            num_pages=num_pages,
            context_length=context_length,
            vocab_limit=vocab_limit,
            logits_width=model_config.vocab_size,
            max_positions=context_length + reservation,
            target_layers=model_config.num_layers,
            embed=model.model.embed_tokens,
            lm_head=model.compute_logits,
            model=config.model,
            draft_model=config.draft_model,
            load_format=config.load_format,
            make_backend=lambda phase, shape: _backend(config, phase, shape, device),
        )
        runner.attach_worker(speculative.worker_class(worker_context, speculative.options))
    eos = load_eos_ids(config.model, model_config)
    decoder_factory: Callable[[], TextDecoder] | None = (
        tokenizer.decoder if tokenizer is not None else None
    )

    def new_scheduler() -> Scheduler:
        return Scheduler(
            SchedulerLimits(
                max_running=config.max_running,
                max_pages_per_request=max_pages,
                chunked_prefill_tokens=config.chunked_prefill_tokens,
                context_length=context_length,
                retract_every=debug_knob("OUTRIDER_DEBUG_RETRACT_EVERY"),
                step_width=width,
                step_span=runner.kv_span,
                max_commit=runner.max_commit,
                prefix_margin_pages=runner.worker.prefix_margin_pages if runner.worker else 0,
            ),
            PrefixCache(num_pages, page_size),
            FinishChecker(eos, context_length, decoder_factory),
        )

    loop = EngineLoop(
        new_scheduler(),
        runner,
        overlap=config.overlap,
        check_kv=bool(debug_knob("OUTRIDER_DEBUG_KV_CHECK")),
    )
    # NOTE: warm-up compiles kernels (JIT backends, later CUDA graphs), and compilers synchronise:
    # the sync check starts after it.
    _warm_up(loop)
    runner.enable_sync_check(bool(debug_knob("OUTRIDER_DEBUG_SYNC_CHECK")))
    if debug_knob("OUTRIDER_DEBUG_RELAY_CHECK"):
        runner.enable_relay_check()
    loop.scheduler = new_scheduler()  # forget the warm-up's cache entries and counters
    facts = ModelFacts(
        model=config.model,
        vocab_size=model_config.vocab_size,
        context_length=context_length,
        kv_total_tokens=(num_pages - 1) * page_size,
        eos_token_ids=sorted(eos),
        tokenizer_dir=str(model_dir(config.model)) if tokenizer is not None else None,
        max_new_tokens_default=None,
        configuration={
            "device": config.device,
            "dtype": dtype_name,
            "page_size": page_size,
            "max_running": config.max_running,
            "context_length": context_length,
            "overlap": config.overlap,
            "chunked_prefill_tokens": config.chunked_prefill_tokens,
            "load_format": config.load_format,
            "speculative_num_draft_tokens": width if speculative is not None else 0,
        },
        plugins={f"attention.{phase}": name for phase, name in config.attention_routes.items()}
        | {"speculative": config.speculative_algorithm},
        speculative_algorithm=config.speculative_algorithm,
    )
    return Engine(config, model_config, facts, loop, context_length)


@dataclass(frozen=True)
class _Speculative:
    worker_class: type[SpeculativeWorker]
    options: msgspec.Struct
    shape: StepShape


def _speculative_plugin(config: ServeConfig) -> _Speculative | None:
    """The chosen speculative plugin (already checked), its options and verify width."""
    if config.speculative_algorithm == "none":
        return None
    spec = discover().get("speculative", config.speculative_algorithm)
    assert spec.speculative is not None, "the registry admits speculative specs with caps"
    options = spec.parse_options(config.speculative_config)
    worker_class = spec.load()
    if not (isinstance(worker_class, type) and issubclass(worker_class, SpeculativeWorker)):
        raise ConfigError(
            f"{SPECULATIVE_FLAG} {spec.name}: {spec.implementation} is not a SpeculativeWorker"
        )
    return _Speculative(worker_class, options, _step_shape(config, spec.speculative))


def _step_shape(config: ServeConfig, caps: SpeculativeCapabilities) -> StepShape:
    """N, S and K from the flags (already checked), the plugin's default width where they
    leave it open."""
    name = config.speculative_algorithm
    topk = max(config.speculative_topk, 1)
    given = config.speculative_num_draft_tokens
    width = verify_width(given, config.speculative_num_steps, topk)
    if not width:
        width = _default_width(caps, config.draft_model)
        log.info("speculative %s: %d tokens verified per row (its default)", name, width)
    if given and given != width:
        log.info(
            "speculative %s: a chain of %d steps verifies %d tokens, not "
            "--speculative-num-draft-tokens %d",
            name, width - 1, width, given,
        )  # fmt: skip
    depth = config.speculative_num_steps if topk > 1 else width - 1
    return StepShape(width, depth, topk)


def _default_width(caps: SpeculativeCapabilities, draft_model: str) -> int:
    if not caps.width_key:
        return caps.default_width
    config = read_config(draft_model)
    if config is None or not isinstance(config.get(caps.width_key), int):
        raise ConfigError(f"--draft-model: no {caps.width_key} in {draft_model}")
    return int(config[caps.width_key])


def _backends(
    config: ServeConfig, model_config: ModelConfig, device: torch.device
) -> dict[Phase, AttentionBackend]:
    """One backend instance per distinct name, shared by the phases routed to it."""
    shape = AttentionShape(
        num_q_heads=model_config.num_q_heads,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        scale=model_config.head_dim**-0.5,
    )
    instances: dict[str, AttentionBackend] = {}
    routes: dict[Phase, AttentionBackend] = {}
    for phase, name in config.attention_routes.items():
        if name not in instances:
            instances[name] = _backend(config, phase, shape, device)
        routes[phase] = instances[name]
    return routes


def _backend(
    config: ServeConfig, phase: Phase, shape: AttentionShape, device: torch.device
) -> AttentionBackend:
    """A new instance of the backend routed to ``phase``, with its options."""
    name = config.attention_routes[phase]
    spec = discover().get("attention", name)
    options_by_name = dict(item.split("=", 1) for item in config.attention_config)
    try:
        options = spec.parse_options(options_by_name.get(name))
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ConfigError(f"--attention-config {name}: {exc}") from None
    backend: AttentionBackend = spec.load()(shape, options, device)
    return backend


def _pool_tokens(
    config: ServeConfig, model_config: ModelConfig, dtype_name: str, minimum: int
) -> int:
    """KV pool size in tokens. ``minimum``: one request at the full context plus one step's
    reservation. The pool never exceeds ``max_running`` such requests: a small model on a
    large GPU would otherwise get tens of millions of pages that no request can use and
    that every walk over the page table pays for."""
    if config.kv_cache_tokens:
        return config.kv_cache_tokens // config.page_size * config.page_size
    per_token = (
        2
        * model_config.num_layers
        * model_config.num_kv_heads
        * model_config.head_dim
        * _DTYPES[dtype_name].itemsize
    )
    if config.device == "cuda":
        free, _total = torch.cuda.mem_get_info()
        activations = 512 * 2**20 + config.max_running * model_config.vocab_size * 4 * 4
        budget = int(free * config.gpu_memory_fraction) - activations
    else:
        budget = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * _CPU_KV_FRACTION)
        # On CPU a pool of a few contexts is plenty.
        budget = min(budget, 4 * minimum * per_token)
    tokens = min(max(budget // per_token, 0), config.max_running * minimum)
    return tokens // config.page_size * config.page_size


def _fit_check(config: ServeConfig, pool_tokens: int, context_length: int, reservation: int) -> int:
    """The pool must hold one context-length request plus one step's reservation."""
    if pool_tokens >= context_length + reservation:
        return context_length
    lowered = pool_tokens - reservation
    if config.context_length or lowered < 2 * config.page_size:
        raise ConfigError(
            f"the KV pool holds {pool_tokens} tokens, fewer than --context-length "
            f"{context_length} plus {reservation}: raise --kv-cache-tokens or "
            "--gpu-memory-fraction, or lower --context-length"
        )
    log.warning(
        "KV pool of %d tokens: context length lowered from %d to %d",
        pool_tokens,
        context_length,
        lowered,
    )
    return lowered


def _warm_up(loop: EngineLoop) -> None:
    """EXTEND and STEP batches of one and of two sampled rows through every routed phase
    before READY, so that no kernel compiles while serving."""
    started = time.monotonic()
    for rid in (-1, -2):
        loop.scheduler.add(
            TokenizedRequest(
                rid=rid,
                request_id="warm-up",
                input_ids=[0] * 4,
                sampling=SamplingSpec(temperature=1.0, top_k=4, top_p=0.9, seed=1, logprobs=2),
                max_new_tokens=2 - rid,
                stop=[],
                stop_token_ids=[],
                ignore_eos=True,
                stream=False,
                want_logprobs=True,
                arrival=time.time(),
            )
        )
    while loop.has_work:
        loop.iterate()
    loop.idle_check()
    log.info("warm-up done in %.2f s", time.monotonic() - started)
