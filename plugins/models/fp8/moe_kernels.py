"""The fused mixture-of-experts layer of FP8 experts with block scales in Triton:
``fused_moe_fp8``, ``moe.kernels.fused_moe`` with ``fp8.reference.Fp8ExpertWeights`` and the
w8a8 arithmetic of ``fp8/reference.py``.

The same two paths as ``moe/kernels.py``, chosen by the same decode path (the shape's, as
timed for 16-bit experts); the GEMMs' reduction steps one activation group (``bk`` columns,
the block's width) at a time, the GEMVs' several (``fp8.kernels._group_dot``):

- decode: ``fp8.kernels.quantize_activations`` of x (per token and group), the gate/up GEMV
  (a program per pair and block of intermediate rows, SiLU-and-multiply), the intermediate
  quantized per pair and group, the down GEMV over each token's k slots, weighted, summed in
  order;
- grouped: the pairs aligned by expert (``moe/align.py``), x quantized, the grouped gate/up
  GEMM (``tl.dot`` of e4m3 tiles, each group's product times its token's and its block's
  scale), the intermediate quantized, the grouped down GEMM times the routing weight (float32
  per pair), ``moe/kernels.py``'s slot sum.

Numerics: every group's product accumulates in float32 times both scales; the intermediate
is rounded to x's dtype once, then quantized as the reference quantizes its down input; the
output is rounded once. No host synchronisation (CUDA-graph safe).

NOTE: Triton's interpreter rounds some float32 -> e4m3 casts wrong (``fp8/kernels.py``): on
CPU the GEMMs and GEMVs are checked from the reference's quantized activations; the whole
layer needs a GPU. A group that ``tl.dot`` cannot take (not a power of two of at least 32)
runs the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from outrider.plugins.device import in_graph_build
from outrider.plugins.models.fp8 import kernels as fp8_kernels
from outrider.plugins.models.fp8.kernels import _group_dot, groups_a_step
from outrider.plugins.models.fp8.reference import Fp8Activations, Fp8ExpertWeights, w8a8_moe
from outrider.plugins.models.moe.align import AlignedPairs, align_pairs
from outrider.plugins.models.moe.kernels import (
    _SUM_BLOCK,
    _sum_slots_kernel,
    _tile,
)
from outrider.plugins.models.moe.memory import MAX_CHUNK_PAIRS
from outrider.plugins.models.moe.tiles import (
    GemvTiles,
    MoeKernelConfig,
    MoeShape,
    config_for,
    decode_for,
)
from outrider.plugins.models.triton_kernels import _silu_mul
from outrider.plugins.triton_launch import batch_jit, pdl_options, wait_for_previous

# The GEMVs' tiles (block_k counts e4m3 bytes): the fastest at one token of Qwen3-30B-A3B's
# shape on an H200 (benchmarks/fp8_gemv.py; 18.3 us a layer against 19.9 at the 16-bit
# experts' tiles). The batch sizes they serve are the shape's 16-bit decode path's.
DECODE_TILES = GemvTiles(block_n=8, block_k=2048, num_warps=4, num_stages=2)


@batch_jit
def _gate_up_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, h_ptr, sorted_ptr, block_experts_ptr, num_pairs, num_blocks,
    width, hidden, stride_a, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_h,
    BLOCK_ROWS, TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    # a: [T, H] e4m3, as: [T, G]; w: [E, 2I, H] e4m3 (gate rows, then up), ws: [E, 2I/bn, G];
    # h: [T*k, I] (width = I).
    block, col_block = _tile(tl.program_id(0), num_blocks, tl.cdiv(width, BLOCK_N), GROUP_M)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:
        return
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    rows_ok = pairs < num_pairs
    tokens = (pairs // TOPK).to(tl.int64)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < width
    step = tl.arange(0, GROUP)
    a_at = a_ptr + tokens[:, None] * stride_a + step[None, :]
    gate_at = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + step[:, None]
    up_at = gate_at + width * stride_wn
    scales = ws_ptr + expert.to(tl.int64) * stride_wse
    gate_scale_at = scales + (cols // BLOCK_ROWS) * stride_wsn
    up_scale_at = scales + ((cols + width) // BLOCK_ROWS) * stride_wsn
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, tl.cdiv(hidden, GROUP)):
        k0 = g * GROUP
        k_ok = k0 + step < hidden
        a = tl.load(a_at + k0, mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
        a_scale = tl.load(as_ptr + tokens * stride_as + g, mask=rows_ok, other=0.0)[:, None]
        w_ok = k_ok[:, None] & cols_ok[None, :]
        gate_w = tl.load(gate_at + k0, mask=w_ok, other=0.0)
        up_w = tl.load(up_at + k0, mask=w_ok, other=0.0)
        gate_scale = tl.load(gate_scale_at + g, mask=cols_ok, other=0.0)[None, :]
        up_scale = tl.load(up_scale_at + g, mask=cols_ok, other=0.0)[None, :]
        gate += tl.dot(a, gate_w) * a_scale * gate_scale
        up += tl.dot(a, up_w) * a_scale * up_scale
    h_at = h_ptr + pairs.to(tl.int64)[:, None] * stride_h + cols[None, :]
    h = _silu_mul(gate, up, h_ptr.dtype.element_ty)
    tl.store(h_at, h, mask=rows_ok[:, None] & cols_ok[None, :])


@batch_jit
def _down_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, weights_ptr, parts_ptr, sorted_ptr, block_experts_ptr,
    num_pairs, num_blocks, hidden, width, stride_a, stride_as, stride_we, stride_wn, stride_wse,
    stride_wsn, stride_parts, BLOCK_ROWS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    # a: [T*k, I] e4m3, as: [T*k, G]; w: [E, H, I] e4m3, ws: [E, H/bn, G]; weights: [T*k]
    # float32; parts: [T*k, H] float32.
    block, col_block = _tile(tl.program_id(0), num_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:
        return
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    rows_ok = pairs < num_pairs
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < hidden
    step = tl.arange(0, GROUP)
    a_at = a_ptr + pairs.to(tl.int64)[:, None] * stride_a + step[None, :]
    w_at = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + step[:, None]
    scale_at = ws_ptr + expert.to(tl.int64) * stride_wse + (cols // BLOCK_ROWS) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, tl.cdiv(width, GROUP)):
        k0 = g * GROUP
        k_ok = k0 + step < width
        a = tl.load(a_at + k0, mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_at + k0, mask=k_ok[:, None] & cols_ok[None, :], other=0.0)
        a_scale = tl.load(as_ptr + pairs * stride_as + g, mask=rows_ok, other=0.0)[:, None]
        w_scale = tl.load(scale_at + g, mask=cols_ok, other=0.0)[None, :]
        acc += tl.dot(a, w) * a_scale * w_scale
    acc *= tl.load(weights_ptr + pairs, mask=rows_ok, other=0.0)[:, None]
    parts_at = parts_ptr + pairs.to(tl.int64)[:, None] * stride_parts + cols[None, :]
    tl.store(parts_at, acc, mask=rows_ok[:, None] & cols_ok[None, :])


@triton.jit
def _gate_up_gemv_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, ids_ptr, h_ptr, width, hidden, stride_a, stride_as,
    stride_we, stride_wn, stride_wse, stride_wsn, stride_h, BLOCK_ROWS,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    pair = tl.program_id(0)
    token = pair // TOPK
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < width
    gate_at = w_ptr + expert * stride_we + rows[:, None] * stride_wn
    up_at = gate_at + width * stride_wn
    scales_at = ws_ptr + expert * stride_wse
    gate_scale_at = scales_at + (rows // BLOCK_ROWS)[:, None] * stride_wsn
    up_scale_at = scales_at + ((rows + width) // BLOCK_ROWS)[:, None] * stride_wsn
    step = tl.arange(0, GROUPS * GROUP)
    group_step = tl.arange(0, GROUPS)
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, GROUPS * GROUP):
        cols = k0 + step
        cols_ok = cols < hidden
        w_ok = rows_ok[:, None] & cols_ok[None, :]
        groups = k0 // GROUP + group_step
        groups_ok = groups * GROUP < hidden
        scales_ok = rows_ok[:, None] & groups_ok[None, :]
        a = tl.load(a_ptr + token * stride_a + cols, mask=cols_ok, other=0.0).to(tl.float32)
        a_scale = tl.load(as_ptr + token * stride_as + groups, mask=groups_ok, other=0.0)
        gate_w = tl.load(gate_at + cols[None, :], mask=w_ok, other=0.0)
        up_w = tl.load(up_at + cols[None, :], mask=w_ok, other=0.0)
        gate_scale = tl.load(gate_scale_at + groups[None, :], mask=scales_ok, other=0.0)
        up_scale = tl.load(up_scale_at + groups[None, :], mask=scales_ok, other=0.0)
        gate += _group_dot(gate_w, a, gate_scale, a_scale, BLOCK_N, GROUPS, GROUP)
        up += _group_dot(up_w, a, up_scale, a_scale, BLOCK_N, GROUPS, GROUP)
    h = _silu_mul(gate, up, h_ptr.dtype.element_ty)
    tl.store(h_ptr + pair * stride_h + rows, h, mask=rows_ok)


@triton.jit
def _down_gemv_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, ids_ptr, weights_ptr, out_ptr, hidden, width,
    stride_a, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_out, BLOCK_ROWS,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < hidden
    step = tl.arange(0, GROUPS * GROUP)
    group_step = tl.arange(0, GROUPS)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for slot in tl.static_range(TOPK):
        pair = token * TOPK + slot
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        w_at = w_ptr + expert * stride_we + rows[:, None] * stride_wn
        scale_at = ws_ptr + expert * stride_wse + (rows // BLOCK_ROWS)[:, None] * stride_wsn
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, width, GROUPS * GROUP):
            cols = k0 + step
            cols_ok = cols < width
            groups = k0 // GROUP + group_step
            groups_ok = groups * GROUP < width
            a = tl.load(a_ptr + pair * stride_a + cols, mask=cols_ok, other=0.0).to(tl.float32)
            a_scale = tl.load(as_ptr + pair * stride_as + groups, mask=groups_ok, other=0.0)
            w = tl.load(w_at + cols[None, :], mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
            w_scale = tl.load(
                scale_at + groups[None, :], mask=rows_ok[:, None] & groups_ok[None, :], other=0.0
            )
            acc += _group_dot(w, a, w_scale, a_scale, BLOCK_N, GROUPS, GROUP)
        total += tl.load(weights_ptr + pair) * acc
    tl.store(out_ptr + token * stride_out + rows, total.to(out_ptr.dtype.element_ty), mask=rows_ok)


def kernels_serve(experts: Fp8ExpertWeights) -> bool:
    """Whether these kernels take ``experts``' blocks: a group ``tl.dot`` can reduce."""
    return fp8_kernels.dot_takes_group(experts.block[1])


def fused_moe_fp8(
    x: torch.Tensor,
    experts: Fp8ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``TorchKernels.fused_moe_fp8`` on a GPU: ``x: [T, H]`` through its routed FP8 experts
    -> ``[T, H]`` in x's dtype, by the decode or the grouped path (the reference for blocks
    these kernels do not take)."""
    if not kernels_serve(experts) or x.stride(1) != 1:
        return w8a8_moe(x, experts, topk_weights, topk_ids, every_expert=in_graph_build())
    tokens, topk = topk_ids.shape
    out = torch.empty_like(x)
    shape = MoeShape(experts.num_experts, x.shape[1], experts.w13.shape[1] // 2, topk)
    if tokens <= decode_for(shape, x.device).max_tokens:
        return decode_moe_fp8(x, experts, topk_weights, topk_ids, out)
    chunk = max(1, MAX_CHUNK_PAIRS // topk)
    for start in range(0, tokens, chunk):
        end = min(start + chunk, tokens)
        config = config_for(shape, end - start, x.device)
        grouped_moe_fp8(
            x[start:end], experts, topk_weights[start:end], topk_ids[start:end], config,
            out[start:end],
        )  # fmt: skip
    return out


def decode_moe_fp8(
    x: torch.Tensor,
    experts: Fp8ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    tiles: GemvTiles = DECODE_TILES,
) -> torch.Tensor:
    """``fused_moe_fp8`` by the GEMV path, into ``out: [T, H]``."""
    if x.shape[0] == 0:
        return out
    group = experts.block[1]
    ids = topk_ids.contiguous()
    h = gate_up_gemv(fp8_kernels.quantize_activations(x, group), experts, ids, x.dtype, tiles)
    h_acts = fp8_kernels.quantize_activations(h, group)
    return down_gemv(h_acts, experts, ids, topk_weights.contiguous(), out, tiles)


def gate_up_gemv(
    acts: Fp8Activations,
    experts: Fp8ExpertWeights,
    topk_ids: torch.Tensor,
    dtype: torch.dtype,
    tiles: GemvTiles = DECODE_TILES,
) -> torch.Tensor:
    """The gate/up GEMVs with SiLU-and-multiply of quantized ``acts`` (``[T, H]``) ->
    ``[T*k, I]`` in ``dtype``, row ``t*k + j`` for pair (t, j)."""
    tokens, topk = topk_ids.shape
    width, hidden = experts.w13.shape[1] // 2, experts.w13.shape[2]
    h = torch.empty((tokens * topk, width), dtype=dtype, device=acts.data.device)
    w, ws = experts.w13, experts.w13_scale
    _gate_up_gemv_kernel[(tokens * topk, triton.cdiv(width, tiles.block_n))](
        acts.data, acts.scale, w, ws, topk_ids, h, width, hidden, acts.data.stride(0),
        acts.scale.stride(0), w.stride(0), w.stride(1), ws.stride(0), ws.stride(1), h.stride(0),
        experts.block[0], TOPK=topk, BLOCK_N=tiles.block_n, GROUP=experts.block[1],
        GROUPS=groups_a_step(experts.block[1], hidden, tiles), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **pdl_options(h.device),
    )  # fmt: skip
    return h


def down_gemv(
    h_acts: Fp8Activations,
    experts: Fp8ExpertWeights,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor,
    tiles: GemvTiles = DECODE_TILES,
) -> torch.Tensor:
    """The down GEMVs of the quantized intermediate ``h_acts`` (``[T*k, I]``), each token's
    slots weighted and summed in order, into ``out: [T, H]``."""
    tokens, topk = topk_ids.shape
    hidden, width = experts.w2.shape[1], experts.w2.shape[2]
    w, ws = experts.w2, experts.w2_scale
    _down_gemv_kernel[(tokens, triton.cdiv(hidden, tiles.block_n))](
        h_acts.data, h_acts.scale, w, ws, topk_ids, topk_weights, out, hidden, width,
        h_acts.data.stride(0), h_acts.scale.stride(0), w.stride(0), w.stride(1), ws.stride(0),
        ws.stride(1), out.stride(0), experts.block[0], TOPK=topk, BLOCK_N=tiles.block_n,
        GROUP=experts.block[1], GROUPS=groups_a_step(experts.block[1], width, tiles),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_options(out.device),
    )  # fmt: skip
    return out


def grouped_moe_fp8(
    x: torch.Tensor,
    experts: Fp8ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeKernelConfig,
    out: torch.Tensor,
) -> torch.Tensor:
    """``fused_moe_fp8`` by the grouped-GEMM path with ``config`` (its ``block_k`` unused:
    the reduction steps one group), into ``out: [T, H]``."""
    tokens, hidden = x.shape
    if tokens == 0:
        return out
    group = experts.block[1]
    aligned = align_pairs(topk_ids, experts.num_experts, config.block_m)
    acts = fp8_kernels.quantize_activations(x, group)
    h = gate_up_gemm(acts, experts, aligned, config, x.dtype)
    parts = down_gemm(fp8_kernels.quantize_activations(h, group), experts, topk_weights, aligned,
                      config)  # fmt: skip
    _sum_slots_kernel[(tokens, triton.cdiv(hidden, _SUM_BLOCK))](
        parts, out, hidden, parts.stride(0), out.stride(0), TOPK=aligned.topk, BLOCK=_SUM_BLOCK,
        num_warps=4, **pdl_options(x.device),
    )  # fmt: skip
    return out


def gate_up_gemm(
    acts: Fp8Activations,
    experts: Fp8ExpertWeights,
    aligned: AlignedPairs,
    config: MoeKernelConfig,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The grouped gate/up GEMM with SiLU-and-multiply of quantized ``acts`` (``[T, H]``) ->
    ``[T*k, I]`` in ``dtype``, row ``t*k + j`` for pair (t, j)."""
    w, ws = experts.w13, experts.w13_scale
    width, hidden = w.shape[1] // 2, w.shape[2]
    h = torch.empty((aligned.num_pairs, width), dtype=dtype, device=w.device)
    tiles = config.gate_up
    grid = (aligned.max_blocks * triton.cdiv(width, tiles.block_n),)
    _gate_up_kernel[grid](
        acts.data, acts.scale, w, ws, h, aligned.sorted_pairs, aligned.block_experts,
        aligned.num_pairs, aligned.max_blocks, width, hidden, acts.data.stride(0),
        acts.scale.stride(0), w.stride(0), w.stride(1), ws.stride(0), ws.stride(1), h.stride(0),
        experts.block[0], TOPK=aligned.topk, BLOCK_M=config.block_m, BLOCK_N=tiles.block_n,
        GROUP=experts.block[1], GROUP_M=tiles.group_m, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **pdl_options(w.device),
    )  # fmt: skip
    return h


def down_gemm(
    h_acts: Fp8Activations,
    experts: Fp8ExpertWeights,
    topk_weights: torch.Tensor,
    aligned: AlignedPairs,
    config: MoeKernelConfig,
) -> torch.Tensor:
    """The grouped down GEMM of the quantized intermediate ``h_acts`` (``[T*k, I]``), each
    row times its routing weight: float32 ``[T*k, H]``."""
    w, ws = experts.w2, experts.w2_scale
    hidden, width = w.shape[1], w.shape[2]
    weights = topk_weights.contiguous()
    parts = torch.empty((aligned.num_pairs, hidden), dtype=torch.float32, device=w.device)
    tiles = config.down
    grid = (aligned.max_blocks * triton.cdiv(hidden, tiles.block_n),)
    _down_kernel[grid](
        h_acts.data, h_acts.scale, w, ws, weights, parts, aligned.sorted_pairs,
        aligned.block_experts, aligned.num_pairs, aligned.max_blocks, hidden, width,
        h_acts.data.stride(0), h_acts.scale.stride(0), w.stride(0), w.stride(1), ws.stride(0),
        ws.stride(1), parts.stride(0), experts.block[0], BLOCK_M=config.block_m,
        BLOCK_N=tiles.block_n, GROUP=experts.block[1], GROUP_M=tiles.group_m,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_options(w.device),
    )  # fmt: skip
    return parts
