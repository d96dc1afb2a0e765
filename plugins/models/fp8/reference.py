"""FP8 (e4m3) weight-and-activation arithmetic: the records a quantized linear hands its
kernels, quantizing weights and activations, and the reference product every other path is
held to (``fp8/config.py`` names the checkpoint formats).

The reference (``w8a8_linear``), which ``TorchKernels.fp8_linear`` runs on any device:

1. activations ``x: [T, K]`` quantized dynamically: per token and group of ``block[1]`` columns
   (block format) or per token (channel format), scale ``s = max(amax, 1e-10) / 448`` in
   float32, values ``clamp(x / s, -448, 448)`` cast to float8_e4m3fn (round to nearest even);
2. per group (channel format: the whole row) the product of the FP8 values in float32, times
   the activation scale, times the weight scale of its rows and group, summed over the groups
   in order;
3. the bias added in float32, the result rounded once to ``x``'s dtype.

Routed experts (``w8a8_moe``, which ``TorchKernels.fused_moe_fp8`` runs) follow the same
rules per expert: the gate/up product of a token's activations quantized per group, rounded
to ``x``'s dtype, SiLU-and-multiply, the result quantized per group again for the down
product, rounded; then weighted and summed over the token's experts as ``fused_moe`` sums.

The GPU paths (``fp8/kernels.py``, ``fp8/moe_kernels.py``) quantize activations the same way;
their sums run in other orders, so they match the reference to float32 accumulation, not
bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from outrider.plugins.models.moe.reference import sum_over_experts

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# A group of zeros quantizes with this amax instead of dividing by zero.
AMAX_FLOOR = 1e-10


@dataclass(frozen=True)
class Fp8Weight:
    """A linear's FP8 weight ``data: [N, K]`` float8_e4m3fn and its float32 ``scale``:
    ``[ceil(N / bn), ceil(K / bk)]`` for ``block`` ``(bn, bk)``, ``[N, 1]`` per channel
    (``block`` None). The weight it stands for is ``data * scale`` of its block or row."""

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None

    @property
    def group(self) -> int:
        """Columns sharing one activation scale: the block's width, or the whole row."""
        return self.data.shape[1] if self.block is None else self.block[1]


@dataclass(frozen=True)
class Fp8Activations:
    """Activations ``data: [T, K]`` float8_e4m3fn with float32 ``scale: [T, ceil(K / group)]``."""

    data: torch.Tensor
    scale: torch.Tensor


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """``max(amax, floor) / 448``, correctly rounded on every device. NOTE: CUDA divides by a
    Python number as a product with its rounded reciprocal, an ulp off now and then; a
    divisor on the device divides exactly, as the Triton kernels do (``div_rn``)."""
    return amax.clamp(min=AMAX_FLOOR) / amax.new_full((), FP8_MAX)


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x: [R, K]`` float32 -> ``[R, ceil(K / group), group]``, zero-padded along K."""
    rows, k = x.shape
    pad = -k % group
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(rows, (k + pad) // group, group)


def _quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: [R, K]`` -> FP8 values ``[R, K]`` and float32 scales ``[R, ceil(K / group)]``,
    one per row and group of ``group`` columns."""
    k = x.shape[1]
    groups = _grouped(x.float(), group)
    scale = _scale_of(groups.abs().amax(dim=-1, keepdim=True))
    values = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values.flatten(1)[:, :k], scale.squeeze(-1)


def quantize_activations(x: torch.Tensor, group: int) -> Fp8Activations:
    """``x: [T, K]`` quantized per token and group of ``group`` columns (step 1 above)."""
    values, scale = _quantize_groups(x, group)
    return Fp8Activations(values, scale)


def quantize_weight(weight: torch.Tensor, block: tuple[int, int] | None) -> Fp8Weight:
    """A 16- or 32-bit ``weight: [N, K]`` in FP8 with the scales of ``block`` (None: per
    output row), each ``amax / 448`` of its block or row: what a checkpoint of that format
    stores (dummy weights, tests)."""
    if block is None:
        values, scale = _quantize_groups(weight, weight.shape[1])
        return Fp8Weight(values, scale, None)
    bn, bk = block
    n, k = weight.shape
    blocks = _grouped(weight.float(), bk)  # [N, Kb, bk]
    pad = -n % bn
    if pad:
        blocks = torch.nn.functional.pad(blocks, (0, 0, 0, 0, 0, pad))
    by_block = blocks.view(-1, bn, blocks.shape[1], bk)  # [Nb, bn, Kb, bk]
    scale = _scale_of(by_block.abs().amax(dim=(1, 3)))  # [Nb, Kb]
    values = (by_block / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(values.view(-1, blocks.shape[1] * bk)[:n, :k], scale, block)


def row_scales(weight: Fp8Weight) -> torch.Tensor:
    """The weight scale of each output row and group: ``[N, ceil(K / group)]`` float32."""
    if weight.block is None:
        return weight.scale.float()
    return weight.scale.float().repeat_interleave(weight.block[0], dim=0)[: weight.data.shape[0]]


def dequantize(weight: Fp8Weight) -> torch.Tensor:
    """``weight`` as the float32 ``[N, K]`` it stands for."""
    n, k = weight.data.shape
    values = _grouped(weight.data.float(), weight.group)
    return (values * row_scales(weight)[:, :, None]).flatten(1)[:, :k].view(n, k)


def w8a8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` for ``x: [T, K]`` in the model dtype, by the reference arithmetic
    (module docstring) -> ``[T, N]`` in ``x``'s dtype."""
    group = weight.group
    acts = quantize_activations(x, group)
    a, w = acts.data.float(), weight.data.float()
    scales = row_scales(weight)  # [N, G]
    out = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
    for g in range(scales.shape[1]):
        cols = slice(g * group, (g + 1) * group)
        out += (a[:, cols] @ w[:, cols].T) * acts.scale[:, g : g + 1] * scales[:, g]
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


@dataclass(frozen=True)
class Fp8ExpertWeights:
    """A layer's routed experts in FP8 with block scales (``block`` ``(bn, bk)``), stacked as
    ``moe.block.Experts`` stacks them: ``w13: [E, 2I, H]`` (gate rows, then up rows) with
    ``w13_scale: [E, 2I / bn, ceil(H / bk)]``, ``w2: [E, H, I]`` with
    ``w2_scale: [E, ceil(H / bn), ceil(I / bk)]``, float32. ``I`` is whole blocks of ``bn``
    rows (gate and up scales stack as their rows do)."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    block: tuple[int, int]

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def gate_up(self, expert: int) -> Fp8Weight:
        return Fp8Weight(self.w13[expert], self.w13_scale[expert], self.block)

    def down(self, expert: int) -> Fp8Weight:
        return Fp8Weight(self.w2[expert], self.w2_scale[expert], self.block)


def w8a8_expert(x: torch.Tensor, experts: Fp8ExpertWeights, expert: int) -> torch.Tensor:
    """One expert's SwiGLU MLP of ``x: [n, H]`` by the reference arithmetic -> ``[n, H]``."""
    gate, up = w8a8_linear(x, experts.gate_up(expert), None).chunk(2, dim=-1)
    return w8a8_linear(F.silu(gate) * up, experts.down(expert), None)


def w8a8_moe(
    x: torch.Tensor,
    experts: Fp8ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    every_expert: bool,
) -> torch.Tensor:
    """The routed experts of ``x: [T, H]`` (``fused_moe``'s contract) by the reference
    arithmetic. The tokens are grouped by the experts hit, read on the host; with
    ``every_expert`` (no host sync, for CUDA graphs) every expert runs on every token, zero
    weight where not routed. Either way each token's products are added in ascending expert
    order, from zero, each rounded to ``x``'s dtype (``moe/reference.py``)."""
    return sum_over_experts(
        x,
        topk_weights,
        topk_ids,
        experts.num_experts,
        lambda rows, e: w8a8_expert(rows, experts, e),
        every_expert,
    )
