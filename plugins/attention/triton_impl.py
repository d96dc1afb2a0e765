"""``triton`` attention: our own paged kernels (``triton_kernels``) over the cache in place,
reading every length, position and page on the device; launches from host bounds only
(``triton_plan``).

``build`` does no device work besides allocating the split-KV scratch, shared by every layer
of the forward (layers run one after another on one stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from outrider.plugins.attention import triton_kernels as kernels
from outrider.plugins.attention.base import AttentionBackend
from outrider.plugins.attention.triton_backend import TritonOptions, head_dim_problem
from outrider.plugins.attention.triton_plan import (
    LOG2_E,
    MODE_CAUSAL,
    MODE_NON_CAUSAL,
    MODE_TREE,
    PROGRAMS_PER_SM,
    LaunchPlan,
    launch_plan,
)
from outrider.plugins.device import AttentionShape, BatchLayout, ForwardBatch
from outrider.plugins.triton_launch import pdl_options


@dataclass(frozen=True)
class TritonMetadata:
    plan: LaunchPlan
    tree: torch.Tensor | None  # [bs, max_q, block] uint8: layout.tree_mask's bytes
    partial_out: torch.Tensor | None  # [T, Hq, splits, D] float32 when the plan merges
    partial_lse: torch.Tensor | None  # [T, Hq, splits] float32, base 2


def _stages(depth: int) -> dict[str, int]:
    """The launch option of a pipeline ``depth`` (0: none, Triton's own)."""
    return {"num_stages": depth} if depth else {}


def _mode(layout: BatchLayout) -> int:
    if layout.tree_mask is not None:
        return MODE_TREE
    return MODE_CAUSAL if layout.causal else MODE_NON_CAUSAL


class TritonAttention(AttentionBackend):
    windows_and_sinks = True

    def __init__(self, shape: AttentionShape, options: Any, device: torch.device) -> None:
        super().__init__(shape, options, device)
        assert isinstance(options, TritonOptions)
        why = head_dim_problem(shape.head_dim)
        if why is not None:
            raise ValueError(f"triton attention {why}")
        if shape.num_q_heads % shape.num_kv_heads:
            raise ValueError("triton attention needs q heads a multiple of kv heads")
        sms = 1  # the CPU interpreter
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.programs_wanted = (options.programs_per_sm or PROGRAMS_PER_SM) * sms

    def build(self, layout: BatchLayout) -> TritonMetadata:
        plan = launch_plan(
            num_q_heads=self.shape.num_q_heads,
            num_kv_heads=self.shape.num_kv_heads,
            head_dim=self.shape.head_dim,
            bs=layout.bs,
            max_q=layout.max_q,
            mode=_mode(layout),
            programs_wanted=self.programs_wanted,
            kv_splits=self.options.kv_splits,
            block_n=self.options.block_n,
        )
        tree = layout.tree_mask.view(torch.uint8) if layout.tree_mask is not None else None
        if not plan.merged:
            return TritonMetadata(plan, tree, None, None)
        device, heads = layout.positions.device, self.shape.num_q_heads
        size = (layout.num_tokens, heads, plan.splits)
        return TritonMetadata(
            plan,
            tree,
            partial_out=torch.empty(
                (*size, self.shape.head_dim), dtype=torch.float32, device=device
            ),
            partial_lse=torch.empty(size, dtype=torch.float32, device=device),
        )

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fb: ForwardBatch,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        meta = fb.metadata
        assert isinstance(meta, TritonMetadata), "metadata built by another backend"
        fb.kv.store(layer, fb.layout.out_loc, k, v)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [T, Hq, D]
        if q.shape[0] == 0:
            return out
        window = self.shape.window(layer)
        assert not window or meta.plan.mode != MODE_NON_CAUSAL, "sliding windows are causal"
        # Without sinks the kernels read none: any tensor stands in for the pointer.
        sink_logits = sinks if sinks is not None else fb.layout.seq_lens
        extras = (window, sinks is not None, sink_logits)
        if meta.partial_out is None or meta.partial_lse is None:
            self._attend(q, fb.kv.k[layer], fb.kv.v[layer], fb.layout, meta, out, out, extras)
            return out
        parts, lse = meta.partial_out, meta.partial_lse
        self._attend(q, fb.kv.k[layer], fb.kv.v[layer], fb.layout, meta, parts, lse, extras)
        kernels.merge_kernel[(q.shape[0], self.shape.num_q_heads)](
            parts, lse, out, sink_logits,
            parts.stride(0), parts.stride(1), parts.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            meta.plan.splits,
            HEAD_DIM=self.shape.head_dim,
            SINKS=sinks is not None,
            **pdl_options(q.device),
        )  # fmt: skip
        return out

    def _attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layout: BatchLayout,
        meta: TritonMetadata,
        target: torch.Tensor,
        lse: torch.Tensor,
        extras: tuple[int, bool, torch.Tensor],
    ) -> None:
        """Attend into ``target``: the output ``[T, Hq, D]``, or with several splits the
        partials ``[T, Hq, S, D]`` and their log-sum-exps ``lse`` (``[T, Hq, S]``).
        ``extras``: the layer's sliding window (0: none), whether it has sinks, and their
        logits (a stand-in tensor without)."""
        plan, shape = meta.plan, self.shape
        window, has_sinks, sink_logits = extras
        target_strides = target.stride()[:3] if plan.merged else (*target.stride()[:2], 0)
        lse_strides = lse.stride()[:2] if plan.merged else (0, 0)
        # Without a tree the kernel reads no tree: any tensor stands in for the pointer.
        tree = meta.tree if meta.tree is not None else layout.seq_lens
        tree_strides = tree.stride() if meta.tree is not None else (0, 0, 0)
        tree_block = meta.tree.shape[-1] if meta.tree is not None else 0
        grid = (layout.bs * shape.num_kv_heads, plan.query_tiles, plan.splits)
        kernels.attend_kernel[grid](
            q, k_cache, v_cache, target, lse,
            layout.page_table, layout.slots, layout.seq_lens, layout.q_start, layout.positions,
            tree, sink_logits,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            *target_strides, *lse_strides,
            layout.page_table.stride(0),
            *tree_strides,
            shape.num_kv_heads, layout.page_size, tree_block, shape.scale * LOG2_E, plan.splits,
            window,
            GROUP=shape.num_q_heads // shape.num_kv_heads,
            HEAD_DIM=shape.head_dim,
            BLOCK_M=plan.block_m,
            BLOCK_N=plan.block_n,
            MERGED=plan.merged,
            MODE=plan.mode,
            SINKS=has_sinks,
            # fp32 as fp32 (no TF32 rounding); the default for half types.
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
            num_warps=self.options.num_warps or (4 if shape.head_dim <= 128 else 8),
            **_stages(plan.stages(self.options.num_stages)),
            **pdl_options(q.device),
        )  # fmt: skip
