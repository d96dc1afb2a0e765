"""The fused mixture-of-experts layer in Triton: ``fused_moe``, every routed (token, slot) pair
through its expert's SwiGLU MLP, weighted and summed per token.

Two paths, chosen by the batch's tokens against the shape's decode path (``tiles.DecodePath``):

- decode (few pairs): GEMVs that read only the chosen experts' rows, as ``triton_kernels.gemv``
  does for dense projections. ``_gate_up_gemv_kernel``: a program per (pair, block of
  intermediate rows), gate and up then SiLU-and-multiply; ``_down_gemv_kernel``: a program per
  (token, block of hidden rows) over the token's k slots, each weighted, summed in order.
- grouped (more pairs): the pairs grouped by expert on the device (``moe/align.py``), padded
  per expert to the row block ``block_m``, so that each program of the two grouped GEMMs
  reads one expert's weights for a block of rows: gate/up with SiLU-and-multiply in the
  epilogue (``[T*k, I]``), down with the routing weight in the epilogue (float32
  ``[T*k, H]``), then ``_sum_slots_kernel`` adds each token's k rows in slot order (no
  atomics: deterministic).

Numerics (both paths, every dtype): products accumulate in float32; the SiLU-and-multiply
intermediate is rounded to x's dtype once, as the dense MLP rounds it; the weighted sum over
slots is float32 and the output is rounded once.

Neither path synchronises with the host; every size comes from T, k, E and the config, so a
CUDA graph can capture them. A call launches 2 kernels (decode) or 7 (grouped, in chunks of
``MAX_CHUNK_PAIRS``), each about 20 µs of host time from Python: graph replays pay none.

NOTE: the interpreter multiplies bfloat16 operands of ``tl.dot`` as their int16 bit patterns
(numpy has no bfloat16): on CPU tensors the operands go to the dot as float32, whose products
of bfloat16 values are exact, as on tensor cores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from outrider.plugins.models.moe.align import AlignedPairs, align_pairs
from outrider.plugins.models.moe.memory import MAX_CHUNK_PAIRS
from outrider.plugins.models.moe.tiles import (
    DEFAULT_DECODE_TILES,
    GemvTiles,
    MoeKernelConfig,
    MoeShape,
    config_for,
    decode_for,
)
from outrider.plugins.models.triton_kernels import _silu_mul
from outrider.plugins.triton_launch import batch_jit, pdl_options, wait_for_previous

_SUM_BLOCK = 1024


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    """``acc + a @ b`` in float32: exact float32 products where ``DOT_F32`` (float32 models,
    the interpreter), the operands' own tensor-core dot otherwise."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """A program's (row block, column block): GROUP_M row blocks share each column block in
    turn, so their weight tiles stay in L2."""
    per_group = GROUP_M * num_n
    first_m = pid // per_group * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + pid % per_group % group_rows, pid % per_group // group_rows


@batch_jit
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_ptr, block_experts_ptr, num_pairs, num_blocks, width, hidden,
    stride_x, stride_we, stride_wn, stride_h,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    # x: [T, H]; w: [E, 2I, H] (gate rows, then up rows); h: [T*k, I] (width = I).
    block, col_block = _tile(tl.program_id(0), num_blocks, tl.cdiv(width, BLOCK_N), GROUP_M)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:
        return
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    rows_ok = pairs < num_pairs
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < width
    step = tl.arange(0, BLOCK_K)
    x_at = x_ptr + (pairs // TOPK).to(tl.int64)[:, None] * stride_x + step[None, :]
    gate_at = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + step[:, None]
    up_at = gate_at + width * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = k0 + step < hidden
        a = tl.load(x_at + k0, mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & cols_ok[None, :]
        gate = _dot(a, tl.load(gate_at + k0, mask=w_ok, other=0.0), gate, DOT_F32)
        up = _dot(a, tl.load(up_at + k0, mask=w_ok, other=0.0), up, DOT_F32)
    h_at = h_ptr + pairs.to(tl.int64)[:, None] * stride_h + cols[None, :]
    h = _silu_mul(gate, up, h_ptr.dtype.element_ty)
    tl.store(h_at, h, mask=rows_ok[:, None] & cols_ok[None, :])


@batch_jit
def _down_kernel(
    h_ptr, w_ptr, weights_ptr, parts_ptr, sorted_ptr, block_experts_ptr, num_pairs, num_blocks,
    hidden, width, stride_h, stride_we, stride_wn, stride_parts,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    # h: [T*k, I] (width = I); w: [E, H, I]; weights: [T*k] float32; parts: [T*k, H] float32.
    block, col_block = _tile(tl.program_id(0), num_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:
        return
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    rows_ok = pairs < num_pairs
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < hidden
    step = tl.arange(0, BLOCK_K)
    h_at = h_ptr + pairs.to(tl.int64)[:, None] * stride_h + step[None, :]
    w_at = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + step[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, width, BLOCK_K):
        k_ok = k0 + step < width
        a = tl.load(h_at + k0, mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_at + k0, mask=k_ok[:, None] & cols_ok[None, :], other=0.0)
        acc = _dot(a, w, acc, DOT_F32)
    acc *= tl.load(weights_ptr + pairs, mask=rows_ok, other=0.0)[:, None]
    parts_at = parts_ptr + pairs.to(tl.int64)[:, None] * stride_parts + cols[None, :]
    tl.store(parts_at, acc, mask=rows_ok[:, None] & cols_ok[None, :])


@triton.jit
def _sum_slots_kernel(parts_ptr, out_ptr, hidden, stride_parts, stride_out, TOPK: tl.constexpr,
                      BLOCK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    wait_for_previous(PDL)
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for slot in tl.static_range(TOPK):
        total += tl.load(parts_ptr + (token * TOPK + slot).to(tl.int64) * stride_parts + cols,
                         mask=ok, other=0.0)  # fmt: skip
    tl.store(out_ptr + token.to(tl.int64) * stride_out + cols, total.to(out_ptr.dtype.element_ty),
             mask=ok)  # fmt: skip


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr, w_ptr, ids_ptr, h_ptr, width, hidden, stride_x, stride_we, stride_wn, stride_h,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < width
    gate_at = w_ptr + expert.to(tl.int64) * stride_we + rows[:, None] * stride_wn
    up_at = gate_at + width * stride_wn
    x_at = x_ptr + (pair // TOPK) * stride_x
    step = tl.arange(0, BLOCK_K)
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        cols = k0 + step
        cols_ok = cols < hidden
        w_ok = rows_ok[:, None] & cols_ok[None, :]
        x = tl.load(x_at + cols, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
        gate += tl.sum(tl.load(gate_at + cols[None, :], mask=w_ok, other=0.0).to(tl.float32) * x, 1)
        up += tl.sum(tl.load(up_at + cols[None, :], mask=w_ok, other=0.0).to(tl.float32) * x, 1)
    h = _silu_mul(gate, up, h_ptr.dtype.element_ty)
    tl.store(h_ptr + pair * stride_h + rows, h, mask=rows_ok)


@triton.jit
def _down_gemv_kernel(
    h_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, hidden, width,
    stride_h, stride_we, stride_wn, stride_out,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < hidden
    step = tl.arange(0, BLOCK_K)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for slot in tl.static_range(TOPK):
        pair = token * TOPK + slot
        w_at = w_ptr + tl.load(ids_ptr + pair).to(tl.int64) * stride_we + rows[:, None] * stride_wn
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, width, BLOCK_K):
            cols = k0 + step
            cols_ok = cols < width
            h = tl.load(h_ptr + pair * stride_h + cols, mask=cols_ok, other=0.0).to(tl.float32)
            w = tl.load(w_at + cols[None, :], mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * h[None, :], 1)
        total += tl.load(weights_ptr + pair) * acc
    tl.store(out_ptr + token * stride_out + rows, total.to(out_ptr.dtype.element_ty), mask=rows_ok)


def moe_shape(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> MoeShape:
    """The layer's shape, after checking the operands against ``fused_moe``'s contract."""
    experts, double_width, hidden = w13.shape
    shape = MoeShape(experts, hidden, double_width // 2, topk_ids.shape[-1])
    problems = []
    if x.dim() != 2 or x.shape[1] != hidden or x.stride(1) != 1:
        problems.append(f"x {tuple(x.shape)} is not [T, {hidden}] contiguous along H")
    if double_width % 2 or w13.stride(2) != 1:
        problems.append(f"w13 {tuple(w13.shape)} is not [E, 2I, H] contiguous along H")
    if tuple(w2.shape) != (experts, hidden, shape.intermediate) or w2.stride(2) != 1:
        problems.append(f"w2 {tuple(w2.shape)} is not [E, H, I] contiguous along I")
    if x.dtype != w13.dtype or x.dtype != w2.dtype:
        problems.append(f"dtypes differ: x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}")
    routing = (x.shape[0], shape.topk)
    if tuple(topk_ids.shape) != routing or topk_ids.dtype != torch.int32:
        problems.append(f"topk_ids {tuple(topk_ids.shape)} {topk_ids.dtype} is not int32 [T, k]")
    if tuple(topk_weights.shape) != routing or topk_weights.dtype != torch.float32:
        problems.append(f"topk_weights {tuple(topk_weights.shape)} is not float32 [T, k]")
    if problems:
        raise ValueError("fused_moe: " + "; ".join(problems))
    return shape


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``x: [T, H]`` through its routed experts -> ``[T, H]`` in x's dtype:
    ``out[t] = sum_j topk_weights[t, j] * W2_e @ (silu(G_e x_t) * (U_e x_t))``,
    ``e = topk_ids[t, j]``, with ``w13: [E, 2I, H]`` (G_e rows, then U_e) and ``w2: [E, H, I]``.
    No host synchronisation (CUDA-graph safe)."""
    shape = moe_shape(x, w13, w2, topk_weights, topk_ids)
    out = torch.empty_like(x)
    tokens = x.shape[0]
    decode = decode_for(shape, x.device)
    if tokens <= decode.max_tokens:
        return decode_moe(x, w13, w2, topk_weights, topk_ids, out, decode.tiles)
    chunk = max(1, MAX_CHUNK_PAIRS // shape.topk)
    for start in range(0, tokens, chunk):
        end = min(start + chunk, tokens)
        config = config_for(shape, end - start, x.device)
        grouped_moe(
            x[start:end], w13, w2, topk_weights[start:end], topk_ids[start:end], config,
            out[start:end],
        )  # fmt: skip
    return out


def decode_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    tiles: GemvTiles = DEFAULT_DECODE_TILES,
) -> torch.Tensor:
    """``fused_moe`` by the GEMV path with ``tiles``, into ``out: [T, H]``."""
    tokens, hidden = x.shape
    width, topk = w13.shape[1] // 2, topk_ids.shape[1]
    if tokens == 0:
        return out
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
    h = torch.empty((tokens * topk, width), dtype=x.dtype, device=x.device)
    launch = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages, **pdl_options(x.device)}
    _gate_up_gemv_kernel[(tokens * topk, triton.cdiv(width, tiles.block_n))](
        x, w13, ids, h, width, hidden, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOPK=topk, BLOCK_N=tiles.block_n, BLOCK_K=tiles.step(hidden), **launch,
    )  # fmt: skip
    _down_gemv_kernel[(tokens, triton.cdiv(hidden, tiles.block_n))](
        h, w2, ids, weights, out, hidden, width,
        h.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOPK=topk, BLOCK_N=tiles.block_n, BLOCK_K=tiles.step(width), **launch,
    )  # fmt: skip
    return out


def grouped_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeKernelConfig,
    out: torch.Tensor,
) -> torch.Tensor:
    """``fused_moe`` by the grouped-GEMM path with ``config``, into ``out: [T, H]``."""
    if x.shape[0] == 0:
        return out
    aligned = align_pairs(topk_ids, w13.shape[0], config.block_m)
    h = gate_up(x, w13, aligned, config)
    parts = down(h, w2, topk_weights, aligned, config)
    return sum_slots(parts, out, aligned.topk)


def sum_slots(parts: torch.Tensor, out: torch.Tensor, topk: int) -> torch.Tensor:
    """Each token's ``topk`` rows of ``parts`` (float32 ``[T*k, H]``, row ``t*k + j``) added in
    slot order into ``out: [T, H]``, rounded once."""
    tokens, hidden = out.shape
    _sum_slots_kernel[(tokens, triton.cdiv(hidden, _SUM_BLOCK))](
        parts, out, hidden, parts.stride(0), out.stride(0), TOPK=topk, BLOCK=_SUM_BLOCK,
        num_warps=4, **pdl_options(out.device),
    )  # fmt: skip
    return out


def _dot_in_float32(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 or not x.is_cuda


def gate_up(
    x: torch.Tensor, w13: torch.Tensor, aligned: AlignedPairs, config: MoeKernelConfig
) -> torch.Tensor:
    """The grouped gate/up GEMM with SiLU-and-multiply: ``[T*k, I]`` in x's dtype, row
    ``t*k + j`` for pair (t, j)."""
    width, hidden = w13.shape[1] // 2, w13.shape[2]
    h = torch.empty((aligned.num_pairs, width), dtype=x.dtype, device=x.device)
    tiles = config.gate_up
    grid = (aligned.max_blocks * triton.cdiv(width, tiles.block_n),)
    _gate_up_kernel[grid](
        x, w13, h, aligned.sorted_pairs, aligned.block_experts, aligned.num_pairs,
        aligned.max_blocks, width, hidden, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOPK=aligned.topk, BLOCK_M=config.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m, DOT_F32=_dot_in_float32(x), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **pdl_options(x.device),
    )  # fmt: skip
    return h


def down(
    h: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    aligned: AlignedPairs,
    config: MoeKernelConfig,
) -> torch.Tensor:
    """The grouped down GEMM, each row times its routing weight: float32 ``[T*k, H]``."""
    hidden, width = w2.shape[1], w2.shape[2]
    weights = topk_weights.contiguous()
    parts = torch.empty((aligned.num_pairs, hidden), dtype=torch.float32, device=h.device)
    tiles = config.down
    grid = (aligned.max_blocks * triton.cdiv(hidden, tiles.block_n),)
    _down_kernel[grid](
        h, w2, weights, parts, aligned.sorted_pairs, aligned.block_experts, aligned.num_pairs,
        aligned.max_blocks, hidden, width, h.stride(0), w2.stride(0), w2.stride(1), parts.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m, DOT_F32=_dot_in_float32(h), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **pdl_options(h.device),
    )  # fmt: skip
    return parts
