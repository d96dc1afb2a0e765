"""Triton kernels for the decoder's graph-captured batches, where the library kernels leave
device time on the table (measured on an H100, BENCHMARKS.md "Triton GEMV, SiLU-mul and K/V
store"):

- ``gemv``: a one-token projection ``x W^T (+ b)``. cuBLAS serves a single row with split-K
  kernels and their reduces (the o and down projections) or under the read bandwidth (q/k/v,
  the LM head); this kernel gives each program ``BLOCK_N`` whole output rows, so each weight
  byte is read once with no reduce step, and accumulates in float32.
- ``silu_and_mul``: FlashInfer's runs one block per token, a single SM at batch 1; this grid is
  tokens x blocks of the intermediate size. Same arithmetic (float32, one rounding).

A Triton launch from Python costs about 20 µs of host time, several library launches' worth,
so the layer kernels run these only while a CUDA graph is built (``in_graph_build``): replays
pay no launch cost at all. Eager batches keep the library kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Measured on an H100 over Llama-3.1-8B's and Qwen3-8B's projections (N x K from 4,096 x
# 4,096 to 151,936 x 4,096, weights read from memory, not L2): 8 output rows a program, a K
# step of 1,024, 8 warps, 3 pipeline stages is within 2 % of each shape's best of 72 configs.
_GEMV_BLOCK_N = 8
_GEMV_BLOCK_K = 1024
_SILU_BLOCK = 512


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_w,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < N
    step = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + step
        cols_ok = cols < K
        w = tl.load(
            w_ptr + rows[:, None] * stride_w + cols[None, :],
            mask=rows_ok[:, None] & cols_ok[None, :],
            other=0.0,
        )
        x = tl.load(x_ptr + cols, mask=cols_ok, other=0.0)
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


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x: [1, K]`` (``gemv_fits``) -> ``[1, N]``."""
    n, k = weight.shape
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_k = min(_GEMV_BLOCK_K, triton.next_power_of_2(k))
    _gemv_kernel[(triton.cdiv(n, _GEMV_BLOCK_N),)](
        x, weight, weight if bias is None else bias, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=_GEMV_BLOCK_N, BLOCK_K=block_k,
        num_warps=8, num_stages=3,
    )  # fmt: skip
    return y


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, width, stride_x, stride_y, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(x_ptr + token * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_x + width + cols, mask=ok, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(y_ptr + token * stride_y + cols, out.to(y_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2I]`` (gate columns, then up; contiguous along them) -> ``silu(gate) * up``."""
    tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, width), dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        grid = (tokens, triton.cdiv(width, _SILU_BLOCK))
        _silu_and_mul_kernel[grid](
            gate_up, out, width, gate_up.stride(0), out.stride(0), BLOCK=_SILU_BLOCK, num_warps=4
        )
    return out
