"""How an engine drafts, from the serve flags and the resolved speculative plugin: the worker
class the plugin loads, whether the drafting policy chooses per batch (plain steps run too),
and the policy the scheduler serves with (scheduler/drafting.py), whose break-even may be
measured on the warmed-up loop (cycle_cost.py)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from outrider.daemon.config import ConfigError, ServeConfig
from outrider.daemon.engine.cycle_cost import measure_break_even
from outrider.daemon.engine.step_memory import StepWidth
from outrider.daemon.scheduler.acceptance import BreakEven
from outrider.daemon.scheduler.drafting import (
    AdaptiveDrafting,
    AdaptiveSettings,
    DraftPolicy,
    FixedDrafting,
)
from outrider.daemon.scheduler.loop import EngineLoop
from outrider.plugins.api import StepShape
from outrider.plugins.checks import SPECULATIVE_FLAG
from outrider.plugins.registry import ResolvedPlugins
from outrider.plugins.speculative.base import SpeculativeWorker


@dataclass(frozen=True)
class SpeculativePlugin:
    """The resolved speculative plugin, loaded: its worker class and options."""

    worker_class: type[SpeculativeWorker]
    options: msgspec.Struct


def speculative_plugin(plugins: ResolvedPlugins) -> SpeculativePlugin | None:
    """The resolved speculative plugin's worker class and options; None: no speculation."""
    if plugins.speculative is None:
        return None
    spec = plugins.speculative.spec
    worker_class = spec.load()
    if not (isinstance(worker_class, type) and issubclass(worker_class, SpeculativeWorker)):
        raise ConfigError(
            f"{SPECULATIVE_FLAG} {spec.name}: {spec.implementation} is not a SpeculativeWorker"
        )
    return SpeculativePlugin(worker_class, plugins.speculative.options)


def step_widths(
    shape: StepShape, speculative: SpeculativePlugin | None, config: ServeConfig, vocab: int
) -> tuple[StepWidth, ...]:
    """Every width a drafting step of ``shape`` may take, widest first (its own, then its cuts,
    ``StepShape.cuts``), with the vocabulary logits its drafting scores a batch row (the
    draft's own vocabulary, or the target's ``vocab``); none without speculation."""
    if speculative is None:
        return ()
    worker = speculative.worker_class
    draft_vocab = worker.draft_vocab_size(config.draft_model) or vocab
    return tuple(
        StepWidth(cut.width, worker.draft_logit_rows(cut) * draft_vocab) for cut in shape.cuts()
    )


def cuts_steps(shape: StepShape, worker: SpeculativeWorker) -> bool:
    """Whether a drafting batch may run ``shape`` cut short (``StepShape.cut``): its worker
    drafts fewer tokens as a step asks (``SpeculativeWorker.cut_steps``)."""
    return shape.speculative and worker.cut_steps


def adapts(config: ServeConfig, shape: StepShape) -> bool:
    """Whether the drafting policy chooses per batch (``--speculative-min-acceptance`` not 0
    on a speculative engine): decode batches then run plain steps too."""
    return shape.speculative and config.speculative_min_acceptance != 0


def drafting_widths(
    config: ServeConfig, shape: StepShape, worker: SpeculativeWorker
) -> tuple[int, ...]:
    """The widths the drafting policy may give a decode batch, widest first: the engine's;
    where the policy measures the break-even (``--speculative-min-acceptance`` below 0) and
    the engine cuts its steps, its shape at halved sizes (``StepShape.cuts``); and 1 (plain
    steps) where the policy chooses at all."""
    if not adapts(config, shape):
        return (shape.width,)
    measured = config.speculative_min_acceptance < 0 and cuts_steps(shape, worker)
    shapes = shape.cuts() if measured else (shape,)
    return (*(cut.width for cut in shapes), 1)


def drafting_policy(
    config: ServeConfig,
    shape: StepShape,
    widths: tuple[int, ...],
    loop: EngineLoop,
    pool_tokens: int,
) -> DraftPolicy:
    """Whether decode batches draft, and how deep (``--speculative-min-acceptance``;
    scheduler/drafting.py; ``widths``: ``drafting_widths``); a negative value measures the
    break-even with ``loop`` at each drafting width (cycle_cost.py)."""
    if not adapts(config, shape):
        return FixedDrafting(shape.width)
    tau = config.speculative_min_acceptance
    break_even = (
        BreakEven.fixed(tau)
        if tau > 0
        else measure_break_even(loop, shape, widths[:-1], pool_tokens)
    )
    return AdaptiveDrafting(AdaptiveSettings(break_even), shape.width, tree=shape.tree)
