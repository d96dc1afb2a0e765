"""Whether decode batches replay CUDA graphs and how they are keyed (``GraphSettings``), from the
serve flags and what the routed attention backends declare, before the memory plan sizes them;
and the ``DecodeGraphs`` built from the settings and the plan."""

from __future__ import annotations

import logging

from outrider.daemon.config import ServeConfig
from outrider.daemon.engine.graphs import DecodeGraphs
from outrider.daemon.engine.memory_plan import GraphSettings, MemoryPlan
from outrider.daemon.engine.results import MAX_LOGPROBS
from outrider.plugins.api import AttentionCapabilities, Phase
from outrider.plugins.debug import debug_knob
from outrider.plugins.registry import ResolvedPlugins

log = logging.getLogger("outrider.engine")

# The phases a speculative decode step (its graph) runs.
CYCLE_PHASES: tuple[Phase, ...] = ("verify", "draft_decode", "draft_extend")


def attention_caps(plugins: ResolvedPlugins, phase: Phase) -> AttentionCapabilities:
    """What the backend routed to ``phase`` declares."""
    caps = plugins.attention[phase].spec.attention
    assert caps is not None, "the registry admits attention specs with capabilities"
    return caps


def graph_settings(config: ServeConfig, plugins: ResolvedPlugins) -> GraphSettings | None:
    """Whether decode batches replay CUDA graphs (the device, the flags and every backend a
    decode batch runs allow them) and how they are keyed; None: they run eagerly."""
    if config.device != "cuda" or config.disable_cuda_graph:
        return None
    if debug_knob("OUTRIDER_DEBUG_RELAY_CHECK"):
        return None  # the relay check syncs inside the step
    phases: tuple[Phase, ...] = ("decode",)
    if plugins.shape.speculative:
        phases = CYCLE_PHASES
    caps = [attention_caps(plugins, phase) for phase in phases]
    lacking = {
        plugins.attention[phase].spec.name
        for phase, cap in zip(phases, caps, strict=True)
        if not cap.cuda_graphs
    }
    if lacking:
        log.info("decode batches run eagerly: %s declares no CUDA graphs", ", ".join(lacking))
        return None
    return GraphSettings(
        max_bs=min(config.cuda_graph_max_bs, config.max_running),
        kv_bounded=any(cap.graph_kv_bound for cap in caps),
    )


def decode_graphs(
    settings: GraphSettings | None,
    plan: MemoryPlan,
    vocab_limit: int,
    max_running: int,
    widths: tuple[int, ...],
    catch_up_capacity: int,
    *,
    unfed_plain: bool,
    sampled_cuts: bool,
) -> DecodeGraphs | None:
    """CUDA graphs for decode batches (``max_running`` is the scratch slot) of each row width
    (and plain steps of unfed rows: ``unfed_plain``; sampled rows cutting by top-k or top-p at
    start: ``sampled_cuts``), and for catch-ups of ``catch_up_capacity`` positions a slot (0:
    none); None: eager."""
    if settings is None:
        return None
    return DecodeGraphs(
        plan.graph_max_bs,
        plan.graph_max_kv,
        min(MAX_LOGPROBS, vocab_limit),
        max_running,
        kv_bounded=settings.kv_bounded,
        widths=widths,
        catch_up_capacity=catch_up_capacity,
        unfed_plain=unfed_plain,
        drafting_rows=plan.drafting_rows,
        sampled_cuts=sampled_cuts,
    )
