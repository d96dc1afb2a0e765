"""Triton kernels for the decoder's graph-captured batches, where the library kernels leave
device time on the table (measured on an H100: BENCHMARKS.md, "Triton kernels inside the
decode graphs"):

- ``gemv``: a one-token projection ``x W^T (+ b)``. cuBLAS serves a single row with split-K
  kernels and their reduces (the o and down projections) or under the read bandwidth (q/k/v,
  the LM head); this kernel gives each program ``BLOCK_N`` whole output rows, so each weight
  byte is read once with no reduce step, and accumulates in float32.
- ``silu_and_mul``: FlashInfer's runs one block per token, a single SM at batch 1; this grid is
  tokens x blocks of the intermediate size. Same arithmetic (float32, one rounding).
- ``silu_mul_gemv``: the MLP's down projection of one token with SiLU-and-multiply computed as
  the GEMV loads its input (the same arithmetic and rounding as ``silu_and_mul``, so the result
  is bit for bit the two kernels'), one launch a layer fewer.
- ``qk_norm_rope``: Qwen3's per-head RMSNorm of q and k and the rotary embedding in one kernel
  (three FlashInfer launches a layer otherwise), rounding where those do: after the norm and
  after the rotation.

A Triton launch from Python costs about 20 µs of host time, several library launches' worth,
so the layer kernels run these only while a CUDA graph is built (``in_graph_build``): replays
pay no launch cost at all. Eager batches keep the library kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from outrider.plugins.models.moe.tiles import GemvTiles
from outrider.plugins.triton_launch import pdl_options, wait_for_previous

# Measured on an H100 over Llama-3.1-8B's and Qwen3-8B's projections (N x K from 4,096 x
# 4,096 to 151,936 x 4,096, weights read from memory, not L2), 72 configs each: 8 output rows
# a program, a K step of 1,024, 8 warps and 3 pipeline stages is the best for the o projection
# and Qwen3's q/k/v and within 1 % of it for gate/up and down; every shape's best has the
# 1,024 step and 8 warps (on an H200 other tiles gain 1.2-1.5 % of a step: BENCHMARKS.md).
GEMV_TILES = GemvTiles(block_n=8, block_k=1024, num_warps=8, num_stages=3)
_SILU_BLOCK = 512


@triton.jit
def _silu_mul(gate, up, dtype: tl.constexpr):
    """``silu(gate) * up`` in float32 from float32 inputs, rounded to ``dtype`` once."""
    return (gate / (1.0 + tl.exp(-gate)) * up).to(dtype)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_w,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    # GATED: x holds 2K values (gate, then up) and the input is their silu_and_mul.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < N
    # NOTE: a large LM head has more than 2^31 weights: row offsets in int64.
    row_at = rows.to(tl.int64)[:, None] * stride_w
    step = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + step
        cols_ok = cols < K
        w = tl.load(
            w_ptr + row_at + cols[None, :],
            mask=rows_ok[:, None] & cols_ok[None, :],
            other=0.0,
        )
        x = tl.load(x_ptr + cols, mask=cols_ok, other=0.0)
        if GATED:
            up = tl.load(x_ptr + K + cols, mask=cols_ok, other=0.0)
            x = _silu_mul(x.to(tl.float32), up.to(tl.float32), w_ptr.dtype.element_ty)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=rows_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=rows_ok)


def gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gemv`` serves ``F.linear(x, weight)``: one row of ``x``, both contiguous
    along K, the same dtype."""
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and x.dtype == weight.dtype
    )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tiles: GemvTiles = GEMV_TILES,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x: [1, K]`` (``gemv_fits``) -> ``[1, N]``."""
    return _launch_gemv(x, weight, bias, tiles, gated=False)


def silu_mul_gemv(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tiles: GemvTiles = GEMV_TILES,
) -> torch.Tensor:
    """``gemv(silu_and_mul(gate_up), weight, bias)`` for ``gate_up: [1, 2K]`` (``gemv_fits``
    against ``weight: [N, K]`` but twice as wide) -> ``[1, N]``, in one kernel."""
    return _launch_gemv(gate_up, weight, bias, tiles, gated=True)


def _launch_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tiles: GemvTiles,
    *,
    gated: bool,
) -> torch.Tensor:
    n, k = weight.shape
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
        x, weight, weight if bias is None else bias, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, GATED=gated, BLOCK_N=tiles.block_n, BLOCK_K=tiles.step(k),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_options(x.device),
    )  # fmt: skip
    return y


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, y_ptr, width, stride_x, stride_y, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    wait_for_previous(PDL)
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(x_ptr + token * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_x + width + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + token * stride_y + cols, _silu_mul(gate, up, y_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2I]`` (gate columns, then up; contiguous along them) -> ``silu(gate) * up``."""
    tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, width), dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        grid = (tokens, triton.cdiv(width, _SILU_BLOCK))
        _silu_and_mul_kernel[grid](
            gate_up, out, width, gate_up.stride(0), out.stride(0), BLOCK=_SILU_BLOCK,
            num_warps=4, **pdl_options(gate_up.device),
        )  # fmt: skip
    return out


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, cos_sin_ptr, positions_ptr, q_out_ptr, k_out_ptr,
    stride_q, stride_k, eps, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)  # q heads first, then k heads
    half = tl.arange(0, DIM // 2)
    if head < Q_HEADS:
        src = q_ptr + token * stride_q + head * DIM
        weight = q_weight_ptr
        dst = q_out_ptr + (token * Q_HEADS + head) * DIM
    else:
        src = k_ptr + token * stride_k + (head - Q_HEADS) * DIM
        weight = k_weight_ptr
        dst = k_out_ptr + (token * KV_HEADS + head - Q_HEADS) * DIM
    x1 = tl.load(src + half).to(tl.float32)
    x2 = tl.load(src + DIM // 2 + half).to(tl.float32)
    scale = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / DIM + eps)
    # The norm's output is rounded to the model dtype, as the unfused norm stores it.
    dtype = q_out_ptr.dtype.element_ty
    n1 = (x1 * scale * tl.load(weight + half).to(tl.float32)).to(dtype).to(tl.float32)
    n2 = (x2 * scale * tl.load(weight + DIM // 2 + half).to(tl.float32)).to(dtype).to(tl.float32)
    at = cos_sin_ptr + tl.load(positions_ptr + token) * DIM
    cos = tl.load(at + half)
    sin = tl.load(at + DIM // 2 + half)
    tl.store(dst + half, (n1 * cos - n2 * sin).to(dtype))
    tl.store(dst + DIM // 2 + half, (n2 * cos + n1 * sin).to(dtype))


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q: [T, Hq, D]``, ``k: [T, Hkv, D]`` (``device.heads_contiguous``) -> each head
    RMS-normalised with its weight, then rotated (rotate-half) at ``positions: [T]`` from the
    float32 ``cos_sin: [P, D]`` table (cos, then sin): two new contiguous tensors."""
    tokens, q_heads, dim = q.shape
    kv_heads = k.shape[1]
    q_out = torch.empty((tokens, q_heads, dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, kv_heads, dim), dtype=k.dtype, device=k.device)
    if tokens:
        _qk_norm_rope_kernel[(tokens, q_heads + kv_heads)](
            q, k, q_weight, k_weight, cos_sin, positions, q_out, k_out,
            q.stride(0), k.stride(0), eps, Q_HEADS=q_heads, KV_HEADS=kv_heads, DIM=dim,
            num_warps=1, **pdl_options(q.device),
        )  # fmt: skip
    return q_out, k_out
