"""gpt-oss's experts in mxfp4, in Triton: 4.25 bits a weight read, dequantized in registers
(plugins/models/mxfp4.py's format). Decode sizes (``MAX_PAIRS`` routed pairs at most) take GEMVs
that read only the chosen experts' rows; larger batches take grouped GEMMs over the pairs
grouped by expert (moe/align.py), each program reading one expert's weight tiles once for a
block of pairs.

``_gate_up_kernel``: a program per (routed pair, block of intermediate rows ``j``) reads rows
``2j`` (gate) and ``2j + 1`` (up) of its expert's interleaved projection, adds the biases and
applies the clamped SwiGLU (``ClampedSwiglu``); ``_down_kernel``: a program per (token, block
of hidden rows) runs each of the token's slots through its expert's down projection and bias,
weights it, and sums the slots in order. A pair whose expert this rank does not hold (expert
parallelism: ids outside ``[first, first + held)``) adds nothing.

Grouped: ``_gate_up_grouped_kernel`` (a program per (row block of one expert's pairs, block of
intermediate columns): the gate and up tiles of the interleaved projection dequantized and
multiplied in float32, biases and the clamped SwiGLU in the epilogue), ``_down_grouped_kernel``
(the down projection, bias and routing weight in the epilogue, float32 ``[T*k, H]``), then
moe/kernels.py's sum over each token's slots in order. The ids are aligned as the rank's
experts, another rank's as one more expert whose blocks exit at once (their rows stay zero).

Numerics: products accumulate in float32 (each e2m1 value and power-of-two scale exact,
assembled from their bits rather than computed: an exp2 a weight would bound the kernels by the
special-function units, not by memory; the GEMVs scale each block's sum of products, the
grouped GEMMs each weight); the grouped GEMMs of bfloat16
activations multiply on the tensor cores (the weights are bfloat16 exactly), other dtypes in
float32. The SwiGLU's output is rounded to x's dtype once, the weighted sum over slots is
float32 and the output is rounded once. No host synchronisation: a CUDA graph can capture both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from outrider.plugins.models.moe.align import align_pairs
from outrider.plugins.models.moe.kernels import sum_slots
from outrider.plugins.models.moe.tiles import GemvTiles
from outrider.plugins.models.mxfp4 import BLOCK, SCALE_BIAS
from outrider.plugins.triton_launch import batch_jit, pdl_options, wait_for_previous

# The GEMVs' tiles: output rows a program, input features a loop iteration (32 mxfp4 blocks),
# warps, pipeline stages: the fastest timed for one gpt-oss matrix at one token on the H200
# (BENCHMARKS.md).
DECODE_TILES = GemvTiles(block_n=4, block_k=1024, num_warps=4, num_stages=3)
# Routed pairs up to which a step takes the GEMVs; past it, the grouped GEMMs.
MAX_PAIRS = 64


@dataclass(frozen=True)
class GroupTiles:
    """The grouped GEMMs' launch: routed pairs a program (the alignment's block), output
    columns a program, input features a loop step, warps, pipeline stages."""

    rows: int
    cols: int
    step: int
    num_warps: int = 4
    num_stages: int = 3


# The grouped GEMMs' tiles: what they ran with untimed (benchmarks/mxfp4_grouped.py times a
# grid of them).
GROUP_TILES = GroupTiles(rows=16, cols=32, step=64)


@dataclass(frozen=True)
class Mxfp4ExpertWeights:
    """The experts a rank holds (``held`` of them from global id ``first``), as stored."""

    gate_up_blocks: torch.Tensor  # [held, 2I, H / 32, 16] uint8, gate and up rows interleaved
    gate_up_scales: torch.Tensor  # [held, 2I, H / 32] uint8
    gate_up_bias: torch.Tensor  # [held, 2I]
    down_blocks: torch.Tensor  # [held, H, I / 32, 16] uint8
    down_scales: torch.Tensor  # [held, H, I / 32] uint8
    down_bias: torch.Tensor  # [held, H]
    first: int
    held: int
    alpha: float  # the clamped SwiGLU's
    limit: float

    @property
    def width(self) -> int:
        """The intermediate size ``I``: the down projection's input features."""
        return self.down_blocks.shape[2] * BLOCK

    def row_bytes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate-up and down blocks as each row's bytes, ``[held, out, in / 2]``: the
        kernels' layout."""
        return self.gate_up_blocks.flatten(-2), self.down_blocks.flatten(-2)


@triton.jit
def _e2m1(nibble):
    """The float32 value of e2m1 codes (sign, 2 exponent bits ``e``, 1 mantissa bit ``m``),
    assembled from bits: ``(1 + m / 2) * 2^(e - 1)`` is float32 exponent ``e + 126`` with
    ``m`` as the mantissa's top bit; ``e = 0`` is 0 or 0.5 (exponent 126)."""
    exponent = (nibble >> 1) & 3
    mantissa = nibble & 1
    normal = ((exponent + 126) << 23) | (mantissa << 22)
    bits = tl.where(exponent == 0, mantissa * (126 << 23), normal) | ((nibble & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _power_of_two(scale, SCALE_BIAS: tl.constexpr):
    """``2^(scale - SCALE_BIAS)`` in float32 for E8M0 ``scale`` bytes, assembled from bits:
    the byte is float32's biased exponent (its bias is float32's, 127); 0 is the subnormal
    2^-127."""
    tl.static_assert(SCALE_BIAS == 127)
    scale = scale.to(tl.int32)
    return tl.where(scale == 0, 1 << 22, scale << 23).to(tl.float32, bitcast=True)


@triton.jit
def _tile_values(blocks_at, scales_at, k0, rows_ok, features,
                 STEP: tl.constexpr, BLOCK: tl.constexpr, SCALE_BIAS: tl.constexpr):  # fmt: skip
    """``[R, STEP]`` float32: input features ``k0 ..`` of the mxfp4 rows at ``blocks_at``
    (``[R, 1]`` pointers to each row's bytes; ``scales_at`` alike to its scales); zeros past
    ``features`` and in the rows not ``rows_ok``."""
    half = tl.arange(0, STEP // 2)
    ok = rows_ok[:, None] & (k0 + 2 * half < features)[None, :]
    packed = tl.load(blocks_at + k0 // 2 + half[None, :], mask=ok, other=0).to(tl.int32)
    values = tl.join(_e2m1(packed & 15), _e2m1(packed >> 4))  # [R, STEP / 2, 2]
    values = tl.reshape(values, (blocks_at.shape[0], STEP))  # even index: the low nibble
    features_at = k0 + tl.arange(0, STEP)
    # NOTE: past ``features`` the groups are another row's scales, or past the tensor's end
    # (any byte: 255 is infinity, and infinity times a masked zero is NaN).
    ok = rows_ok[:, None] & (features_at < features)[None, :]
    scale = tl.load(scales_at + (features_at // BLOCK)[None, :], mask=ok, other=SCALE_BIAS)
    return values * _power_of_two(scale, SCALE_BIAS)


@triton.jit
def _row_dot(blocks_at, scales_at, rows_ok, x_at, features,
             STEP: tl.constexpr, BLOCK: tl.constexpr, SCALE_BIAS: tl.constexpr):  # fmt: skip
    """``[ROWS]`` float32: each mxfp4 row (``[R, 1]`` pointers to its bytes at ``blocks_at``,
    to its scales at ``scales_at``) times the vector at ``x_at`` of ``features`` values (a
    multiple of ``BLOCK``), zeros in the rows not ``rows_ok``. A loop step reads ``STEP //
    BLOCK`` whole blocks as ``[R, blocks, BLOCK / 2]`` bytes: low nibbles times the vector's
    even features, high nibbles times its odd ones (the vector split in registers), and each
    block's scale multiplies its sum once. Masks change only from block to block, so that
    the bytes load as whole vectors."""
    tl.static_assert(STEP % BLOCK == 0)
    BLOCKS: tl.constexpr = STEP // BLOCK
    HALF: tl.constexpr = BLOCK // 2
    block = tl.arange(0, BLOCKS)
    byte = tl.arange(0, HALF)
    count = features // BLOCK
    acc = tl.zeros([blocks_at.shape[0]], dtype=tl.float32)
    for first in range(0, count, BLOCKS):
        block_ok = first + block < count
        ok = rows_ok[:, None] & block_ok[None, :]
        bytes_at = blocks_at[:, :, None] + ((first + block) * HALF)[None, :, None]
        packed = tl.load(bytes_at + byte[None, None, :], mask=ok[:, :, None], other=0)
        packed = packed.to(tl.int32)
        x_block = x_at + (first + block)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        x = tl.load(x_block, mask=block_ok[:, None], other=0.0).to(tl.float32)
        even, odd = tl.split(tl.reshape(x, (BLOCKS, HALF, 2)))
        sums = tl.sum(_e2m1(packed & 15) * even[None] + _e2m1(packed >> 4) * odd[None], 2)
        scale = tl.load(scales_at + (first + block)[None, :], mask=ok, other=SCALE_BIAS)
        acc += tl.sum(sums * _power_of_two(scale, SCALE_BIAS), 1)
    return acc


@triton.jit
def _exact_dot(a, w, acc, BF16_DOT: tl.constexpr):
    """``acc + a @ w`` for activations ``a`` in their own dtype and float32 weights ``w``,
    every product exact: in bfloat16 on the tensor cores where ``a`` is bfloat16 (an mxfp4
    weight, 2 significant bits times a power of two, is a bfloat16 exactly), else in float32
    (a float16 weight could leave float16's exponent range)."""
    if BF16_DOT:
        return tl.dot(a, w.to(tl.bfloat16), acc)
    return tl.dot(a.to(tl.float32), w, acc, input_precision="ieee")


@triton.jit
def _clamped_swiglu(gate, up, alpha, limit):
    """gpt-oss's activation (``ClampedSwiglu``) of float32 ``gate`` and ``up``."""
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return (up + 1.0) * (gate * tl.sigmoid(gate * alpha))


@triton.jit
def _held_expert(ids_ptr, pair, first, held):
    """The pair's expert among the rank's (0 where another rank holds it), and whether the
    rank holds it."""
    local = tl.load(ids_ptr + pair) - first
    mine = (local >= 0) & (local < held)
    return tl.where(mine, local, 0), mine


@triton.jit
def _gate_up_kernel(
    x_ptr, blocks_ptr, scales_ptr, bias_ptr, ids_ptr, h_ptr,
    width, hidden, first, held, alpha, limit,
    stride_x, stride_be, stride_br, stride_se, stride_sr, stride_bias, stride_h,
    TOPK: tl.constexpr, ROWS: tl.constexpr, STEP: tl.constexpr, BLOCK: tl.constexpr,
    SCALE_BIAS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    pair = tl.program_id(0)
    local, mine = _held_expert(ids_ptr, pair, first, held)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # intermediate rows j
    rows_ok = rows < tl.where(mine, width, 0)  # a pair of another rank's expert: none
    x_at = x_ptr + (pair // TOPK) * stride_x
    expert_blocks = blocks_ptr + local.to(tl.int64) * stride_be
    expert_scales = scales_ptr + local.to(tl.int64) * stride_se
    gate = _row_dot(expert_blocks + (2 * rows)[:, None] * stride_br,
                    expert_scales + (2 * rows)[:, None] * stride_sr, rows_ok, x_at, hidden,
                    STEP, BLOCK, SCALE_BIAS)  # fmt: skip
    up = _row_dot(expert_blocks + (2 * rows + 1)[:, None] * stride_br,
                  expert_scales + (2 * rows + 1)[:, None] * stride_sr, rows_ok, x_at, hidden,
                  STEP, BLOCK, SCALE_BIAS)  # fmt: skip
    bias_at = bias_ptr + local.to(tl.int64) * stride_bias
    gate += tl.load(bias_at + 2 * rows, mask=rows_ok, other=0.0).to(tl.float32)
    up += tl.load(bias_at + 2 * rows + 1, mask=rows_ok, other=0.0).to(tl.float32)
    h = _clamped_swiglu(gate, up, alpha, limit)
    tl.store(h_ptr + pair * stride_h + rows, h.to(h_ptr.dtype.element_ty), mask=rows < width)


@triton.jit
def _down_kernel(
    h_ptr, blocks_ptr, scales_ptr, bias_ptr, ids_ptr, weights_ptr, out_ptr,
    hidden, width, first, held,
    stride_h, stride_be, stride_br, stride_se, stride_sr, stride_bias, stride_out,
    TOPK: tl.constexpr, ROWS: tl.constexpr, STEP: tl.constexpr, BLOCK: tl.constexpr,
    SCALE_BIAS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    token = tl.program_id(0)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # hidden rows
    total = tl.zeros([ROWS], dtype=tl.float32)
    for slot in tl.static_range(TOPK):
        pair = token * TOPK + slot
        local, mine = _held_expert(ids_ptr, pair, first, held)
        rows_ok = rows < tl.where(mine, hidden, 0)
        blocks_at = blocks_ptr + local.to(tl.int64) * stride_be + rows[:, None] * stride_br
        scales_at = scales_ptr + local.to(tl.int64) * stride_se + rows[:, None] * stride_sr
        h_at = h_ptr + pair * stride_h
        acc = _row_dot(blocks_at, scales_at, rows_ok, h_at, width, STEP, BLOCK, SCALE_BIAS)
        bias_at = bias_ptr + local.to(tl.int64) * stride_bias
        acc += tl.load(bias_at + rows, mask=rows_ok, other=0.0).to(tl.float32)
        total += tl.where(mine, tl.load(weights_ptr + pair), 0.0) * acc
    tl.store(out_ptr + token * stride_out + rows, total.to(out_ptr.dtype.element_ty),
             mask=rows < hidden)  # fmt: skip


@batch_jit
def _gate_up_grouped_kernel(
    x_ptr, blocks_ptr, scales_ptr, bias_ptr, h_ptr, sorted_ptr, block_experts_ptr,
    num_pairs, width, hidden, held, alpha, limit,
    stride_x, stride_be, stride_br, stride_se, stride_sr, stride_bias, stride_h,
    TOPK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, STEP: tl.constexpr,
    BLOCK: tl.constexpr, SCALE_BIAS: tl.constexpr, BF16_DOT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if (expert < 0) | (expert >= held):  # past the used blocks, or another rank's experts
        return
    pairs = tl.load(sorted_ptr + block * ROWS + tl.arange(0, ROWS))
    rows_ok = pairs < num_pairs
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)  # intermediate rows j
    cols_ok = cols < width
    step = tl.arange(0, STEP)
    x_at = x_ptr + (pairs // TOPK).to(tl.int64)[:, None] * stride_x + step[None, :]
    expert_blocks = blocks_ptr + expert.to(tl.int64) * stride_be
    expert_scales = scales_ptr + expert.to(tl.int64) * stride_se
    gate = tl.zeros([ROWS, COLS], dtype=tl.float32)
    up = tl.zeros([ROWS, COLS], dtype=tl.float32)
    for k0 in range(0, hidden, STEP):
        a = tl.load(x_at + k0, mask=rows_ok[:, None] & (k0 + step < hidden)[None, :], other=0.0)
        w_gate = tl.trans(_tile_values(expert_blocks + (2 * cols)[:, None] * stride_br,
                                       expert_scales + (2 * cols)[:, None] * stride_sr, k0,
                                       cols_ok, hidden, STEP, BLOCK, SCALE_BIAS))  # fmt: skip
        w_up = tl.trans(_tile_values(expert_blocks + (2 * cols + 1)[:, None] * stride_br,
                                     expert_scales + (2 * cols + 1)[:, None] * stride_sr, k0,
                                     cols_ok, hidden, STEP, BLOCK, SCALE_BIAS))  # fmt: skip
        gate = _exact_dot(a, w_gate, gate, BF16_DOT)
        up = _exact_dot(a, w_up, up, BF16_DOT)
    bias_at = bias_ptr + expert.to(tl.int64) * stride_bias
    gate += tl.load(bias_at + 2 * cols, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
    up += tl.load(bias_at + 2 * cols + 1, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
    h = _clamped_swiglu(gate, up, alpha, limit)
    h_at = h_ptr + pairs.to(tl.int64)[:, None] * stride_h + cols[None, :]
    tl.store(h_at, h.to(h_ptr.dtype.element_ty), mask=rows_ok[:, None] & cols_ok[None, :])


@batch_jit
def _down_grouped_kernel(
    h_ptr, blocks_ptr, scales_ptr, bias_ptr, weights_ptr, parts_ptr, sorted_ptr,
    block_experts_ptr, num_pairs, hidden, width, held,
    stride_h, stride_be, stride_br, stride_se, stride_sr, stride_bias, stride_parts,
    ROWS: tl.constexpr, COLS: tl.constexpr, STEP: tl.constexpr, BLOCK: tl.constexpr,
    SCALE_BIAS: tl.constexpr, BF16_DOT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if (expert < 0) | (expert >= held):
        return
    pairs = tl.load(sorted_ptr + block * ROWS + tl.arange(0, ROWS))
    rows_ok = pairs < num_pairs
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)  # hidden rows
    cols_ok = cols < hidden
    step = tl.arange(0, STEP)
    h_at = h_ptr + pairs.to(tl.int64)[:, None] * stride_h + step[None, :]
    expert_blocks = blocks_ptr + expert.to(tl.int64) * stride_be + cols[:, None] * stride_br
    expert_scales = scales_ptr + expert.to(tl.int64) * stride_se + cols[:, None] * stride_sr
    acc = tl.zeros([ROWS, COLS], dtype=tl.float32)
    for k0 in range(0, width, STEP):
        a = tl.load(h_at + k0, mask=rows_ok[:, None] & (k0 + step < width)[None, :], other=0.0)
        w = tl.trans(_tile_values(expert_blocks, expert_scales, k0, cols_ok, width, STEP,
                                  BLOCK, SCALE_BIAS))  # fmt: skip
        acc = _exact_dot(a, w, acc, BF16_DOT)
    bias_at = bias_ptr + expert.to(tl.int64) * stride_bias
    acc += tl.load(bias_at + cols, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(weights_ptr + pairs, mask=rows_ok, other=0.0)[:, None]
    parts_at = parts_ptr + pairs.to(tl.int64)[:, None] * stride_parts + cols[None, :]
    tl.store(parts_at, acc, mask=rows_ok[:, None] & cols_ok[None, :])


def mxfp4_grouped_moe(
    x: torch.Tensor,
    experts: Mxfp4ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tiles: GroupTiles = GROUP_TILES,
) -> torch.Tensor:
    """``mxfp4_decode_moe`` by the grouped GEMMs (any batch size), with ``tiles``."""
    tokens, hidden = x.shape
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    topk, width = topk_ids.shape[1], experts.width
    local = topk_ids.to(torch.int32) - experts.first
    # Another rank's experts: one more expert, ``held``, whose blocks exit at once.
    local = torch.where((local >= 0) & (local < experts.held), local, experts.held)
    aligned = align_pairs(local, experts.held + 1, tiles.rows)
    # Rows of another rank's pairs: never written nor read in h, zeros in parts (summed).
    h = torch.empty((tokens * topk, width), dtype=x.dtype, device=x.device)
    parts = torch.zeros((tokens * topk, hidden), dtype=torch.float32, device=x.device)
    gate_up_blocks, down_blocks = experts.row_bytes()
    consts = {"ROWS": tiles.rows, "COLS": tiles.cols, "STEP": tiles.step, "BLOCK": BLOCK,
              "SCALE_BIAS": SCALE_BIAS, "BF16_DOT": x.dtype == torch.bfloat16,
              "num_warps": tiles.num_warps, "num_stages": tiles.num_stages}  # fmt: skip
    _gate_up_grouped_kernel[(aligned.max_blocks, triton.cdiv(width, tiles.cols))](
        x, gate_up_blocks, experts.gate_up_scales, experts.gate_up_bias, h,
        aligned.sorted_pairs, aligned.block_experts, aligned.num_pairs, width, hidden,
        experts.held, experts.alpha, experts.limit,
        x.stride(0), gate_up_blocks.stride(0), gate_up_blocks.stride(1),
        experts.gate_up_scales.stride(0), experts.gate_up_scales.stride(1),
        experts.gate_up_bias.stride(0), h.stride(0),
        TOPK=topk, **consts, **pdl_options(x.device),
    )  # fmt: skip
    _down_grouped_kernel[(aligned.max_blocks, triton.cdiv(hidden, tiles.cols))](
        h, down_blocks, experts.down_scales, experts.down_bias, topk_weights.contiguous(),
        parts, aligned.sorted_pairs, aligned.block_experts, aligned.num_pairs, hidden, width,
        experts.held,
        h.stride(0), down_blocks.stride(0), down_blocks.stride(1),
        experts.down_scales.stride(0), experts.down_scales.stride(1),
        experts.down_bias.stride(0), parts.stride(0),
        **consts, **pdl_options(x.device),
    )  # fmt: skip
    return sum_slots(parts, out, topk)


def mxfp4_decode_moe(
    x: torch.Tensor,
    experts: Mxfp4ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tiles: GemvTiles = DECODE_TILES,
) -> torch.Tensor:
    """The held experts' share of the routed sum for ``x: [T, H]`` (``topk_weights: [T, k]``
    float32, ``topk_ids: [T, k]`` global expert ids): ``[T, H]`` in x's dtype, by the GEMVs
    with ``tiles`` (its step at most the reduced length's power of two)."""
    tokens, hidden = x.shape
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    topk, width = topk_ids.shape[1], experts.width
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
    h = torch.empty((tokens * topk, width), dtype=x.dtype, device=x.device)
    gate_up_blocks, down_blocks = experts.row_bytes()
    rows = tiles.block_n
    consts = {"TOPK": topk, "ROWS": rows, "BLOCK": BLOCK, "SCALE_BIAS": SCALE_BIAS,
              "num_warps": tiles.num_warps, "num_stages": tiles.num_stages}  # fmt: skip
    _gate_up_kernel[(tokens * topk, triton.cdiv(width, rows))](
        x, gate_up_blocks, experts.gate_up_scales, experts.gate_up_bias, ids, h,
        width, hidden, experts.first, experts.held, experts.alpha, experts.limit,
        x.stride(0), gate_up_blocks.stride(0), gate_up_blocks.stride(1),
        experts.gate_up_scales.stride(0), experts.gate_up_scales.stride(1),
        experts.gate_up_bias.stride(0), h.stride(0),
        STEP=tiles.step(hidden), **consts, **pdl_options(x.device),
    )  # fmt: skip
    _down_kernel[(tokens, triton.cdiv(hidden, rows))](
        h, down_blocks, experts.down_scales, experts.down_bias, ids, weights, out,
        hidden, width, experts.first, experts.held,
        h.stride(0), down_blocks.stride(0), down_blocks.stride(1),
        experts.down_scales.stride(0), experts.down_scales.stride(1),
        experts.down_bias.stride(0), out.stride(0),
        STEP=tiles.step(width), **consts, **pdl_options(x.device),
    )  # fmt: skip
    return out
