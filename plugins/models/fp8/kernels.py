"""The FP8 projections on a GPU (``FusedKernels.fp8_linear``), held to the reference
arithmetic of ``fp8/reference.py`` (activation quantization bit for bit, sums in other orders):

- ``quantize_activations``: each token's groups of columns to e4m3 with their float32 scales
  (grid: tokens x groups; a group as wide as the row, per channel, is read twice in chunks);
- per-channel weights, several tokens: ``torch._scaled_mm`` with row-wise scales (one per
  token, one per output row; compute capability 8.9 or later), bfloat16 out;
- per-channel weights, one token: the token quantized, then ``_channel_gemv_kernel`` (whole
  output rows a program, one scale each);
- block-scaled weights, several tokens: ``_block_gemm_kernel``, a tiled w8a8 GEMM whose K
  step is one scale group, each partial product scaled by its token's and its block's scale;
- block-scaled weights, one token: ``_block_gemv_kernel``, which quantizes the token's
  groups itself as it reads them, several groups a step (``_group_dot``), and gives each
  program whole output rows, so each FP8 weight byte is read once (the decode step's case,
  bandwidth-bound).

NOTE: Triton's interpreter (3.x) rounds a float32 that rounds up into the next binade to the
wrong e4m3 value (126.8 to 64, not 128): on CPU the kernels that quantize are checked on
activations that need no rounding, the GEMM also from the reference's quantized activations;
their rounding is checked on a GPU.

What these kernels cannot serve (fp16 with per-channel weights, a group that is not a power
of two of at least 32, non-contiguous rows) runs the reference on the GPU. The GEMVs' tiles
were timed on an H200; the GEMM's are first guesses.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from outrider.plugins.models.fp8.reference import (
    AMAX_FLOOR,
    FP8,
    FP8_MAX,
    Fp8Activations,
    Fp8Weight,
    w8a8_linear,
)
from outrider.plugins.models.moe.tiles import GemvTiles
from outrider.plugins.triton_launch import batch_jit, pdl_options, wait_for_previous

# NOTE: divisions are div_rn (IEEE, as torch divides): Triton's `/` on float32 is approximate,
# and one ulp moves a value across an e4m3 rounding boundary now and then.
# Triton reads module globals in kernels only as constexprs: reference.py's constants, as such.
_E4M3_MAX = tl.constexpr(FP8_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_QUANT_CHUNK = 1024
# The one-token GEMVs' tiles (block_k counts e4m3 bytes), the least summed time over
# Llama-3.1-8B's and Qwen3-30B-A3B's projections on an H200 (benchmarks/fp8_gemv.py).
CHANNEL_GEMV_TILES = GemvTiles(block_n=4, block_k=2048, num_warps=4, num_stages=3)
BLOCK_GEMV_TILES = GemvTiles(block_n=16, block_k=4096, num_warps=8, num_stages=3)
_GEMM_BLOCK_M = 64
_GEMM_BLOCK_N = 128
# tl.dot of 8-bit tiles reduces at least 32 columns (Triton's smallest dot of e4m3 operands).
_MIN_DOT_K = 32
# torch._scaled_mm wants K and N multiples of 16.
_SCALED_MM_ALIGN = 16
_SCALED_MM_MIN_CAPABILITY = (8, 9)


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, s_ptr, K, GROUP, stride_x, stride_q, groups,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    token = tl.program_id(0)
    group = tl.program_id(1)
    start = group * GROUP
    step = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(0, GROUP, BLOCK):
        cols = start + c + step
        ok = (c + step < GROUP) & (cols < K)
        x = tl.load(x_ptr + token * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), _AMAX_FLOOR), _E4M3_MAX)
    for c in range(0, GROUP, BLOCK):
        cols = start + c + step
        ok = (c + step < GROUP) & (cols < K)
        x = tl.load(x_ptr + token * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -_E4M3_MAX, _E4M3_MAX)
        tl.store(q_ptr + token * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + token * groups + group, scale)


def quantize_activations(x: torch.Tensor, group: int) -> Fp8Activations:
    """``x: [T, K]`` (contiguous along K) -> e4m3 values and float32 scales per token and
    group of ``group`` columns: ``fp8.reference.quantize_activations``, in one launch."""
    tokens, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty((tokens, k), dtype=FP8, device=x.device)
    s = torch.empty((tokens, groups), dtype=torch.float32, device=x.device)
    if tokens:
        block = min(_QUANT_CHUNK, triton.next_power_of_2(group))
        _quantize_kernel[(tokens, groups)](
            x, q, s, k, group, x.stride(0), q.stride(0), groups, BLOCK=block,
            num_warps=4, **pdl_options(x.device),
        )  # fmt: skip
    return Fp8Activations(q, s)


@triton.jit
def _group_dot(
    w, xq, w_scale, x_scale, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr
):
    """``sum_g (sum_{k in g} w[:, k] * xq[k]) * w_scale[:, g] * x_scale[g]`` in float32 over
    ``GROUPS`` consecutive groups of ``GROUP`` columns: ``w: [BLOCK_N, GROUPS * GROUP]`` e4m3,
    ``xq: [GROUPS * GROUP]`` float32 (e4m3 values), ``w_scale: [BLOCK_N, GROUPS]``,
    ``x_scale: [GROUPS]`` -> ``[BLOCK_N]``. The one-token GEMVs' step: several groups a load,
    so that a program's loads are long enough to stream the weights."""
    products = tl.reshape(w.to(tl.float32) * xq[None, :], (BLOCK_N, GROUPS, GROUP))
    return tl.sum(tl.sum(products, axis=2) * w_scale * x_scale[None, :], axis=1)


@triton.jit
def _block_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, N, K, stride_w, stride_ws, BLOCK_ROWS,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < N
    row_at = rows.to(tl.int64)[:, None] * stride_w
    scale_at = ws_ptr + (rows // BLOCK_ROWS)[:, None] * stride_ws
    step = tl.arange(0, GROUPS * GROUP)
    group_step = tl.arange(0, GROUPS)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, GROUPS * GROUP):
        cols = k0 + step
        cols_ok = cols < K
        # The token's groups quantized as quantize_activations does (each program redoes it:
        # GROUPS * GROUP values against BLOCK_N times as many weight bytes).
        x = tl.reshape(
            tl.load(x_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32), (GROUPS, GROUP)
        )
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), _AMAX_FLOOR)
        x_scale = tl.math.div_rn(amax, _E4M3_MAX)
        xq = tl.clamp(tl.math.div_rn(x, x_scale[:, None]), -_E4M3_MAX, _E4M3_MAX)
        xq = tl.reshape(xq.to(w_ptr.dtype.element_ty).to(tl.float32), (GROUPS * GROUP,))
        w = tl.load(
            w_ptr + row_at + cols[None, :], mask=rows_ok[:, None] & cols_ok[None, :], other=0.0
        )
        groups = k0 // GROUP + group_step
        scales_ok = rows_ok[:, None] & (groups * GROUP < K)[None, :]
        w_scale = tl.load(scale_at + groups[None, :], mask=scales_ok, other=0.0)
        acc += _group_dot(w, xq, w_scale, x_scale, BLOCK_N, GROUPS, GROUP)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=rows_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=rows_ok)


def groups_a_step(group: int, k: int, tiles: GemvTiles) -> int:
    """How many activation groups of ``group`` columns a GEMV step of ``tiles`` loads: as
    many as fit ``tiles.block_k`` weight bytes, no more than ``k`` holds (a power of two)."""
    return max(1, min(tiles.block_k, triton.next_power_of_2(k)) // group)


def block_gemv(
    x: torch.Tensor,
    weight: Fp8Weight,
    bias: torch.Tensor | None,
    tiles: GemvTiles = BLOCK_GEMV_TILES,
) -> torch.Tensor:
    """``fp8_linear`` of one token ``x: [1, K]`` against block-scaled ``weight`` -> ``[1, N]``."""
    assert weight.block is not None
    n, k = weight.data.shape
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _block_gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
        x, weight.data, weight.scale, x if bias is None else bias, y, n, k,
        weight.data.stride(0), weight.scale.stride(0), weight.block[0],
        HAS_BIAS=bias is not None, BLOCK_N=tiles.block_n, GROUP=weight.group,
        GROUPS=groups_a_step(weight.group, k, tiles), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **pdl_options(x.device),
    )  # fmt: skip
    return y


@triton.jit
def _channel_gemv_kernel(
    q_ptr, qs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, N, K, stride_w,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = rows < N
    row_at = rows.to(tl.int64)[:, None] * stride_w
    step = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + step
        cols_ok = cols < K
        xq = tl.load(q_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + row_at + cols[None, :], mask=rows_ok[:, None] & cols_ok[None, :], other=0.0
        )
        acc += tl.sum(w.to(tl.float32) * xq[None, :], axis=1)
    acc *= tl.load(qs_ptr) * tl.load(ws_ptr + rows, mask=rows_ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=rows_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=rows_ok)


def channel_gemv(
    x: torch.Tensor,
    weight: Fp8Weight,
    bias: torch.Tensor | None,
    tiles: GemvTiles = CHANNEL_GEMV_TILES,
) -> torch.Tensor:
    """``fp8_linear`` of one token ``x: [1, K]`` against per-channel ``weight`` -> ``[1, N]``:
    the token quantized in one launch, the GEMV (one scale a row) in another."""
    n, k = weight.data.shape
    acts = quantize_activations(x, k)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _channel_gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
        acts.data, acts.scale, weight.data, weight.scale, x if bias is None else bias, y, n, k,
        weight.data.stride(0), HAS_BIAS=bias is not None, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.step(k), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **pdl_options(x.device),
    )  # fmt: skip
    return y


@batch_jit
def _block_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, c_ptr, num_tokens, N, K,
    stride_a, stride_as, stride_w, stride_ws, stride_c, BLOCK_ROWS,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < num_tokens, n < N
    step = tl.arange(0, GROUP)
    a_rows = a_ptr + m.to(tl.int64)[:, None] * stride_a
    w_rows = w_ptr + n.to(tl.int64)[None, :] * stride_w
    w_scales = ws_ptr + (n // BLOCK_ROWS) * stride_ws
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, tl.cdiv(K, GROUP)):
        cols = g * GROUP + step
        cols_ok = cols < K
        a = tl.load(a_rows + cols[None, :], mask=m_ok[:, None] & cols_ok[None, :], other=0.0)
        w = tl.load(w_rows + cols[:, None], mask=cols_ok[:, None] & n_ok[None, :], other=0.0)
        a_scale = tl.load(as_ptr + m * stride_as + g, mask=m_ok, other=0.0)
        w_scale = tl.load(w_scales + g, mask=n_ok, other=0.0)
        acc += tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + m.to(tl.int64)[:, None] * stride_c + n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_gemm(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``fp8_linear`` of ``x: [T, K]`` against block-scaled ``weight`` -> ``[T, N]``:
    activations quantized in one launch, the GEMM in another."""
    acts = quantize_activations(x, weight.group)
    return scaled_block_gemm(acts, weight, bias, x.dtype)


def scaled_block_gemm(
    acts: Fp8Activations, weight: Fp8Weight, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Quantized activations (groups of ``weight.group``) times block-scaled ``weight`` ->
    ``[T, N]`` in ``dtype``."""
    assert weight.block is not None
    n, k = weight.data.shape
    tokens = acts.data.shape[0]
    y = torch.empty((tokens, n), dtype=dtype, device=acts.data.device)
    if tokens:
        grid = (triton.cdiv(tokens, _GEMM_BLOCK_M), triton.cdiv(n, _GEMM_BLOCK_N))
        _block_gemm_kernel[grid](
            acts.data, acts.scale, weight.data, weight.scale, y if bias is None else bias, y,
            tokens, n, k, acts.data.stride(0), acts.scale.stride(0), weight.data.stride(0),
            weight.scale.stride(0), y.stride(0), weight.block[0],
            HAS_BIAS=bias is not None, BLOCK_M=_GEMM_BLOCK_M, BLOCK_N=_GEMM_BLOCK_N,
            GROUP=weight.group, num_warps=4, num_stages=3, **pdl_options(y.device),
        )  # fmt: skip
    return y


def channel_scaled_mm(
    x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None
) -> torch.Tensor:
    """``fp8_linear`` of ``x: [T, K]`` bfloat16 against per-channel ``weight``, through
    ``torch._scaled_mm`` with row-wise scales."""
    acts = quantize_activations(x, x.shape[1])
    return torch._scaled_mm(
        acts.data,
        weight.data.t(),  # [K, N], column-major as _scaled_mm wants its second operand
        scale_a=acts.scale,  # [T, 1]
        scale_b=weight.scale.view(1, -1),  # [1, N]
        bias=bias,
        out_dtype=x.dtype,
    )


@cache
def _has_scaled_mm(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= _SCALED_MM_MIN_CAPABILITY


def _scaled_mm_serves(x: torch.Tensor, weight: Fp8Weight) -> bool:
    n, k = weight.data.shape
    return (
        x.dtype == torch.bfloat16
        and n % _SCALED_MM_ALIGN == 0
        and k % _SCALED_MM_ALIGN == 0
        and _has_scaled_mm(x.device)
    )


def dot_takes_group(group: int) -> bool:
    """Whether a GEMM's ``tl.dot`` can reduce one activation group of ``group`` columns."""
    return group >= _MIN_DOT_K and group == triton.next_power_of_2(group)


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``TorchKernels.fp8_linear`` on a GPU: the kernel of ``weight``'s format and ``x``'s
    token count, or the reference where none serves."""
    if x.dim() != 2 or x.shape[0] == 0 or x.stride(1) != 1 or weight.data.stride(1) != 1:
        return w8a8_linear(x, weight, bias)
    if weight.block is None:
        if x.shape[0] == 1:
            return channel_gemv(x, weight, bias)
        if _scaled_mm_serves(x, weight):
            return channel_scaled_mm(x.contiguous(), weight, bias)
        return w8a8_linear(x, weight, bias)
    if not dot_takes_group(weight.group):
        return w8a8_linear(x, weight, bias)
    if x.shape[0] == 1:
        return block_gemv(x, weight, bias)
    return block_gemm(x, weight, bias)
