"""The ``auto`` attention backend's spec: the decode-side phases (plain decode, verify, draft
steps and the draft's catch-up) routed per batch size between two backends that read every
length on the device.

FA4 has no split-KV on SM 9.0: one long sequence runs a few thread blocks and reads its KV at a
tenth of the bandwidth, while a split-KV kernel (the ``triton`` plugin) fills the GPU at any
batch size. From some batch size up FA4's kernel is the faster one, for one query a row as for
a verify block, and from a larger one the split-KV kernel is again, at every context
(BENCHMARKS.md, "The backend matrix" and "auto's route at large batches"). ``auto`` runs
batches of at least ``large_from_batch`` and fewer than ``small_from_batch`` rows with
``large``, the others with ``small``. The batch size is known on the host, and a decode graph
is captured per batch size, so each graph holds one backend's kernels: the route costs nothing
per step. Each phase routed to ``auto`` has its own pair of backends (and graph state); prompt
chunks are not routed (``--prefill-attention-backend``).

Both backends run with their default options, must read lengths on the device (no host plans,
one graph per batch size whatever the KV bound), and must draw tree masks and non-causal
blocks: ``auto`` declares what they share. It declares sliding windows and sinks too: each
backend is checked against the model as it would run in ``auto``'s place, so one that lacks
them is refused by name.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

import msgspec

from outrider.plugins.api import AttentionCapabilities, CheckContext, PluginSpec, Problem
from outrider.plugins.checks import attention_problems

OPTION = "--attention-config auto"


class AutoOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    small: str = "triton"  # split-KV: small batches, long contexts
    large: str = "fa4"
    # The smallest batch decoded by ``large``.
    large_from_batch: Annotated[int, msgspec.Meta(ge=1)] = 8
    # The smallest batch decoded by ``small`` again (0: none).
    small_from_batch: Annotated[int, msgspec.Meta(ge=0)] = 64


def _check(spec: PluginSpec, ctx: CheckContext) -> list[Problem]:
    from outrider.plugins.registry import PluginError, named_spec

    try:
        options = spec.parse_options(ctx.attention_config.get(spec.name))
    except (msgspec.ValidationError, msgspec.DecodeError):
        return []  # the registry reports the options themselves
    problems: list[Problem] = []
    assert isinstance(options, AutoOptions)
    if 0 < options.small_from_batch <= options.large_from_batch:
        problems.append(
            Problem(
                OPTION,
                f"small_from_batch ({options.small_from_batch}) must exceed large_from_batch "
                f"({options.large_from_batch}), or be 0: no batch would reach large",
            )
        )
    for role, name in (("small", options.small), ("large", options.large)):
        try:
            child = named_spec("attention", name)
        except PluginError as exc:
            problems.append(Problem(OPTION, f"{role}: {exc}"))
            continue
        caps = child.attention
        assert caps is not None, "the registry loads no attention spec without capabilities"
        if name == spec.name or caps.host_plans or caps.graph_kv_bound or not caps.cuda_graphs:
            problems.append(
                Problem(
                    OPTION,
                    f"{role}: {name} cannot be routed by auto, which takes backends that read "
                    "every length on the device (no host plans, one CUDA graph per batch size)",
                )
            )
            continue
        if not (caps.tree_mask and caps.non_causal):
            problems.append(
                Problem(
                    OPTION,
                    f"{role}: {name} cannot be routed by auto, which draws tree masks and "
                    "non-causal blocks",
                )
            )
            continue
        # The child as the configuration would run it in auto's place.
        routes = {p: name if r == spec.name else r for p, r in ctx.attention_routes.items()}
        child_ctx = dataclasses.replace(ctx, attention_routes=routes)
        found = attention_problems(child, caps, child_ctx) + list(child.check(child, child_ctx))
        problems += [Problem(OPTION, f"{role}: {p.option}: {p.message}") for p in found]
    return problems


SPEC = PluginSpec(
    name="auto",
    kind="attention",
    summary="decode, verify and draft routed by batch size: split-KV (triton) for small and "
    "large batches, FA4 between",
    implementation="outrider.plugins.attention.auto_impl:AutoAttention",
    options=AutoOptions,
    attention=AttentionCapabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({"float32", "bfloat16", "float16"}),
        page_sizes=None,
        cuda_graphs=True,
        graph_kv_bound=False,
        host_plans=False,
        non_causal=True,
        tree_mask=True,
        phases=frozenset({"decode", "verify", "draft_decode", "draft_extend"}),
        sliding_window=True,
        sinks=True,
    ),
    check=_check,
)
