"""The ``fa4`` attention backend's spec: FlashAttention-4's CuTe DSL kernels over the paged cache
(``flash_attn.cute.flash_attn_varlen_func`` with a page table), on Hopper and Blackwell.

Every length comes from the device (``cu_seqlens_q`` and ``seqused_k`` built from the layout's
tensors), so there is no host plan and one decode graph per batch size serves every KV length.
Every phase: prompt chunks over a cached prefix, decode, verify (causal chains aligned to the
end of each row, trees through a ``mask_mod``), DFlash's non-causal block, and EAGLE-3's draft
steps. Each eager call costs 0.1 to 0.2 ms of host time (the CuTe launch path), so FA4 pays inside
decode graphs; its first call per kernel variant JIT-compiles for seconds. SM90 has no split-KV:
a few long rows under-fill the GPU (pair it with a split-KV decode backend there). Sliding
windows and attention sinks (gpt-oss) in every phase (fa4_impl.py).
"""

from __future__ import annotations

import importlib.util

from outrider.plugins.api import (
    AttentionCapabilities,
    CheckContext,
    PluginSpec,
    Problem,
)
from outrider.plugins.checks import attention_option, head_dim_problems

# Hopper (9.x) and Blackwell data-centre parts (10.x, 11.x): FA4 has no paged KV before SM 9.0
# and none on SM 12.x.
MIN_CAPABILITY = (9, 0)
MAX_MAJOR = 11
# The page-table path takes any page size (TMA when a page is one key tile, 128 positions at
# head dim 128, else per-row copies); measured on SM90 at 1, 4, 16, 64 and 128.
PAGE_SIZES = frozenset({1, 2, 4, 8, 16, 32, 64, 128})
# Head dims are multiples of 16 bytes: 8 elements in 16-bit types.
HEAD_DIM_ALIGN = 8


def head_dim_problem(head_dim: int, capability: tuple[int, int] | None) -> str | None:
    """Why FA4 cannot attend with ``head_dim`` on ``capability`` (None: unknown, checked as
    SM90, the widest range); None when it can."""
    aligned = head_dim % HEAD_DIM_ALIGN == 0
    if capability is not None and capability[0] >= 10:
        if aligned and (8 <= head_dim <= 128 or head_dim == 256):
            return None
        return f"takes head dims 8 to 128 in steps of 8, or 256, on SM 10.x, not {head_dim}"
    if aligned and 8 <= head_dim <= 256:
        return None
    return f"takes head dims 8 to 256 in steps of 8 on SM 9.x, not {head_dim}"


def _installed() -> bool:
    """FA4 and the CuTe DSL it compiles with, without importing either (both import torch)."""
    try:
        return all(importlib.util.find_spec(name) for name in ("flash_attn.cute", "cutlass"))
    except (ImportError, ValueError):  # a broken flash_attn package
        return False


def _check(spec: PluginSpec, ctx: CheckContext) -> list[Problem]:
    option = f"{attention_option(ctx, spec.name)} {spec.name}"
    if not _installed():
        return [Problem(option, "FlashAttention-4 is not installed (pip install 'outrider[fa4]')")]
    capability = ctx.cuda_capability
    if capability is not None and not MIN_CAPABILITY <= capability < (MAX_MAJOR + 1, 0):
        major, minor = capability
        return [
            Problem(
                option,
                f"{spec.name} needs compute capability 9.0 to 11.x (paged KV), not {major}.{minor}",
            )
        ]
    return head_dim_problems(spec, ctx, lambda dim: head_dim_problem(dim, capability))


SPEC = PluginSpec(
    name="fa4",
    kind="attention",
    summary="FlashAttention-4 paged prefill, decode, verify (chains, trees, non-causal) on SM90+",
    implementation="outrider.plugins.attention.fa4_impl:FA4Attention",
    attention=AttentionCapabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({"bfloat16", "float16"}),
        page_sizes=PAGE_SIZES,
        non_causal=True,
        tree_mask=True,
        cuda_graphs=True,
        graph_kv_bound=False,  # lengths come from the device: one graph serves every length
        host_plans=False,
        sliding_window=True,
        sinks=True,
    ),
    check=_check,
)
