"""The ``triton`` attention backend's spec: our own Triton kernels over the paged cache, reading
every length on the device (no host plan, no host sync).

Split-KV decode and verify (chains, tree masks, non-causal DFlash blocks) and prompt chunks
over a cached prefix, in every phase. Its launches depend on the batch size and the query
width only, so one decode graph per batch size serves every KV length: the graph- and
overlap-friendly partner for small batches of long contexts. Runs wherever Triton runs on a
GPU; on CPU only under Triton's interpreter (tests).
"""

from __future__ import annotations

import importlib.util
from typing import Annotated

import msgspec

from outrider.plugins.api import AttentionCapabilities, CheckContext, PluginSpec, Problem
from outrider.plugins.attention.triton_plan import MAX_HEAD_DIM, MIN_BLOCK
from outrider.plugins.checks import attention_option, head_dim_problems


class TritonOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Launch settings; 0 leaves each to the plan (triton_plan.py) or to Triton."""

    # KV splits per (row, kv head, query tile); 0: enough to fill the GPU at the batch size.
    kv_splits: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    # KV positions a program reads per loop step (a power of two from 16 to 256).
    block_n: Annotated[int, msgspec.Meta(ge=0, le=256)] = 0
    num_warps: Annotated[int, msgspec.Meta(ge=0, le=16)] = 0  # a power of two
    num_stages: Annotated[int, msgspec.Meta(ge=0, le=8)] = 0  # the KV loop's pipeline depth
    # Programs per SM the split count aims at (``PROGRAMS_PER_SM``).
    programs_per_sm: Annotated[int, msgspec.Meta(ge=0, le=16)] = 0

    def __post_init__(self) -> None:
        if self.block_n and (self.block_n < MIN_BLOCK or self.block_n & (self.block_n - 1)):
            raise ValueError(f"block_n is a power of two from {MIN_BLOCK}, not {self.block_n}")
        if self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps is a power of two, not {self.num_warps}")


def head_dim_problem(head_dim: int) -> str | None:
    """Why the kernels cannot attend with ``head_dim`` (a power of two from one block of 16 to
    256), or None."""
    if MIN_BLOCK <= head_dim <= MAX_HEAD_DIM and not head_dim & (head_dim - 1):
        return None
    return f"takes head dims {MIN_BLOCK}, {2 * MIN_BLOCK}, ..., {MAX_HEAD_DIM}, not {head_dim}"


def _check(spec: PluginSpec, ctx: CheckContext) -> list[Problem]:
    if importlib.util.find_spec("triton") is None:
        return [
            Problem(
                f"{attention_option(ctx, spec.name)} {spec.name}",
                "Triton is not installed (pip install 'outrider[triton]')",
            )
        ]
    return head_dim_problems(spec, ctx, head_dim_problem)


SPEC = PluginSpec(
    name="triton",
    kind="attention",
    summary="Triton split-KV decode, verify (chains, trees, non-causal) and extend (CUDA)",
    implementation="outrider.plugins.attention.triton_impl:TritonAttention",
    options=TritonOptions,
    attention=AttentionCapabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({"float32", "bfloat16", "float16"}),
        page_sizes=None,
        non_causal=True,
        tree_mask=True,
        sliding_window=True,
        sinks=True,
        cuda_graphs=True,
        graph_kv_bound=False,  # launches depend on bs and max_q only
        host_plans=False,
    ),
    check=_check,
)
