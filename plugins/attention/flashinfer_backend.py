"""The ``flashinfer`` attention backend's spec: FlashInfer's paged prefill and decode kernels,
reading the cache in place (split-KV decode for small batches of long contexts).

FlashInfer schedules each forward on the host from every row's exact KV length. The host knows
those for prompt (extend) batches and for plain decode batches, also one step ahead under the
overlap loop. A speculative cycle's lengths follow the previous cycle's accepted counts, which
exist only on the device: routed to a phase of the cycle (the verify of chains, and of trees
under a custom mask; the draft's steps, DFlash's non-causal block, its catch-ups), the engine
waits for them before launching each cycle (``host_plans``), so that cycles run one after
another with the host's planning and launch between them. A draft whose batches sit at the
accepted lengths themselves (the standalone draft's catch-up) is refused
(``SpeculativeCapabilities.exact_draft_lengths``).
"""

from __future__ import annotations

import importlib.util

from outrider.plugins.api import AttentionCapabilities, CheckContext, PluginSpec, Problem
from outrider.plugins.checks import attention_option, head_dim_problems

# Ampere and newer: FlashInfer's prefill and decode kernels need SM 8.0.
MIN_CAPABILITY = (8, 0)
# The head dims its paged prefill and decode kernels are built for (FlashInfer's dispatch).
HEAD_DIMS = (64, 128, 256)


def head_dim_problem(head_dim: int) -> str | None:
    if head_dim in HEAD_DIMS:
        return None
    return f"takes head dims {', '.join(map(str, HEAD_DIMS))}, not {head_dim}"


def _check(spec: PluginSpec, ctx: CheckContext) -> list[Problem]:
    option = f"{attention_option(ctx, spec.name)} {spec.name}"
    if importlib.util.find_spec("flashinfer") is None:
        return [Problem(option, "FlashInfer is not installed (pip install 'outrider[flashinfer]')")]
    capability = ctx.cuda_capability
    if capability is not None and capability < MIN_CAPABILITY:
        major, minor = capability
        return [
            Problem(
                option, f"{spec.name} needs compute capability 8.0 or newer, not {major}.{minor}"
            )
        ]
    return head_dim_problems(spec, ctx, head_dim_problem)


SPEC = PluginSpec(
    name="flashinfer",
    kind="attention",
    summary="FlashInfer paged prefill, split-KV decode, trees and DFlash blocks (CUDA)",
    implementation="outrider.plugins.attention.flashinfer_impl:FlashInferAttention",
    attention=AttentionCapabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({"bfloat16", "float16"}),
        page_sizes=None,
        non_causal=True,
        tree_mask=True,
        cuda_graphs=True,
        graph_kv_bound=False,  # lengths come from the plan and the device, not max_kv
        host_plans=True,
    ),
    check=_check,
)
