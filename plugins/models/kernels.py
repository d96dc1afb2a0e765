"""The per-layer work of a decoder besides attention: the projections, RMSNorm (alone, or with
the residual add fused in), rotary embedding and SiLU-and-multiply, in two implementations.

``TorchKernels`` is the reference: plain torch ops that round as the HF reference does, on
every device and dtype (the float32 CPU path, which tests compare token for token, runs it).
``FusedKernels`` serves half-precision models on a GPU: FlashInfer's fused norm and rotary
kernels (one kernel per operation instead of five to ten, which is most of what a batch-1
decode step launches besides its GEMMs), and while a CUDA graph is built our Triton GEMV for
one-token projections, SiLU-and-multiply and Qwen3's q/k norm with the rotation
(``triton_kernels.py``). They compute in float32 and round once, so their results differ
from the reference's by bf16 rounding only (ARCHITECTURE.md 4.4). The routed experts of a
mixture-of-experts layer (``fused_moe``, ``fused_moe_fp8`` for FP8 experts) run our Triton
kernels (``moe/kernels.py``), eagerly too: they need no host sync, where the reference reads
on the host which experts were hit.

Modules reach their kernels through ``UsesKernels.kernels``; ``use_kernels`` sets them on a
whole model once it sits on its serving device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from outrider.plugins.debug import debug_knob
from outrider.plugins.device import heads_contiguous, in_graph_build
from outrider.plugins.models.fp8.reference import Fp8ExpertWeights, Fp8Weight, w8a8_linear, w8a8_moe
from outrider.plugins.models.moe.reference import sum_over_experts

log = logging.getLogger(__name__)


class RotaryTable(Protocol):
    """What a rotation reads of the model's rotary tables (layers.RotaryEmbedding)."""

    cos: torch.Tensor  # [max_positions, D/2], the model's dtype
    sin: torch.Tensor

    def cos_sin_float32(self) -> torch.Tensor: ...


class Rotation:
    """The rotary embedding of one forward's positions, applied to each layer's q and k."""

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q: [T, Hq, D]``, ``k: [T, Hkv, D]`` -> both rotated. May rotate in place:
        callers pass tensors they own (fresh projections)."""
        raise NotImplementedError

    def rotate_keys(self, k: torch.Tensor) -> torch.Tensor:
        """``k: [T, Hkv, D]`` rotated, out of place."""
        raise NotImplementedError


@dataclass(frozen=True)
class TableRotation(Rotation):
    """Rotate-half RoPE from tables gathered once per forward (in the model dtype)."""

    cos: torch.Tensor  # [T, D/2]
    sin: torch.Tensor

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotate_half(q, self.cos, self.sin), rotate_half(k, self.cos, self.sin)

    def rotate_keys(self, k: torch.Tensor) -> torch.Tensor:
        return rotate_half(k, self.cos, self.sin)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. ``x: [T, H, D]``, ``cos, sin: [T, D/2]``."""
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class TorchKernels:
    """Plain torch ops (the reference)."""

    name = "torch"

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x W^T + b`` for ``x: [T, K]``, ``weight: [N, K]``."""
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim of ``x: [..., D]``."""
        # Statistics in float32, scale in the input dtype (as the HF reference rounds).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(residual + x), residual + x)`` for ``x, residual: [T, D]``. May
        overwrite both inputs: callers pass tensors they own."""
        summed = residual + x
        return self.rms_norm(summed, weight, eps), summed

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[T, 2I]`` (gate rows, then up rows) -> ``silu(gate) * up: [T, I]``."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def silu_mul_linear(
        self, gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``linear(silu_and_mul(gate_up), weight, bias)``: the MLP's down projection."""
        return self.linear(self.silu_and_mul(gate_up), weight, bias)

    def fp8_linear(
        self, x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x W^T + b`` for ``x: [T, K]`` and an FP8 weight, activations quantized on the
        fly (the reference arithmetic of ``fp8/reference.py``)."""
        return w8a8_linear(x, weight, bias)

    def silu_mul_fp8_linear(
        self, gate_up: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``fp8_linear(silu_and_mul(gate_up), weight, bias)``."""
        return self.fp8_linear(self.silu_and_mul(gate_up), weight, bias)

    def rotation(self, table: RotaryTable, positions: torch.Tensor) -> Rotation:
        """The rotation of ``positions: [T]`` (each below the table's length)."""
        return TableRotation(table.cos[positions], table.sin[positions])

    def qk_norm_rotate(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        rotation: Rotation,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's per-head RMSNorm of ``q: [T, Hq, D]`` and ``k: [T, Hkv, D]``, then
        ``rotation``."""
        return rotation.rotate(self.rms_norm(q, q_weight, eps), self.rms_norm(k, k_weight, eps))

    def fused_moe(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The routed experts of ``x: [T, H]``: ``[T, H]`` in ``x``'s dtype, where
        ``out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t)`` over
        ``e = topk_ids[t, j]``. ``w13: [E, 2I, H]`` holds each expert's gate rows then its up
        rows, ``w2: [E, H, I]`` its down projection; ``topk_weights: [T, k]`` float32,
        ``topk_ids: [T, k]`` int32 (distinct experts per row). Each product is taken in float32
        and rounded to ``x``'s dtype once; the sum over a token's experts runs in ascending
        expert order, from zero (as the HF reference adds them). Tokens are grouped by expert;
        while a CUDA graph is built, every expert runs on every token instead."""
        return sum_over_experts(
            x,
            topk_weights,
            topk_ids,
            w13.shape[0],
            lambda rows, e: _expert(rows, w13[e], w2[e]),
            every_expert=in_graph_build(),
        )

    def fused_moe_fp8(
        self,
        x: torch.Tensor,
        experts: Fp8ExpertWeights,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """``fused_moe`` of FP8 experts with block scales: each product by the w8a8 reference
        arithmetic of ``fp8/reference.py`` (activations quantized per token and group before the
        gate/up product and again before the down product). Grouped by expert, or every expert on
        every token while a CUDA graph is built, as ``fused_moe``."""
        return w8a8_moe(x, experts, topk_weights, topk_ids, every_expert=in_graph_build())


def _expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert's MLP of ``x: [n, H]`` in ``x``'s dtype (``w13``: its gate rows, then up)."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


@dataclass(frozen=True)
class FusedRotation(Rotation):
    """FlashInfer's in-place RoPE from the float32 ``[cos | sin]`` table."""

    flashinfer: Any
    positions: torch.Tensor  # [T]
    cos_sin: torch.Tensor  # [max_positions, D] float32

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.flashinfer.apply_rope_with_cos_sin_cache_inplace(
            self.positions, _rows(q), _rows(k), k.shape[-1], self.cos_sin
        )
        return q, k

    def rotate_keys(self, k: torch.Tensor) -> torch.Tensor:
        # The kernel rotates a q and a k together: the keys go in as both, out of place.
        flat = _rows(k)
        rotated, _ = self.flashinfer.apply_rope_with_cos_sin_cache(
            self.positions, flat, flat, k.shape[-1], self.cos_sin
        )
        return rotated.view(k.shape)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[T, H, D] -> [T, H * D]`` as a view (raises rather than copy: in-place kernels
    write through it)."""
    return x.view(x.shape[0], -1)


class FusedKernels(TorchKernels):
    """FlashInfer's fused kernels, and Triton's for graphs being built (CUDA, float16 /
    bfloat16)."""

    name = "fused"

    def __init__(self, flashinfer: Any) -> None:
        """With the ``flashinfer`` package; the Triton kernel modules are imported here, so
        an ImportError says Triton is missing (``select_kernels``)."""
        from outrider.plugins.models import triton_kernels
        from outrider.plugins.models.fp8 import kernels as fp8_kernels
        from outrider.plugins.models.fp8 import moe_kernels as moe_fp8_kernels
        from outrider.plugins.models.moe import kernels as moe_kernels

        self.flashinfer = flashinfer
        self.triton = triton_kernels
        self.moe = moe_kernels
        self.fp8 = fp8_kernels
        self.moe_fp8 = moe_fp8_kernels

    def fused_moe(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        # Eager too: the reference's grouping reads the experts hit on the host.
        out: torch.Tensor = self.moe.fused_moe(x, w13, w2, topk_weights, topk_ids)
        return out

    def fused_moe_fp8(
        self,
        x: torch.Tensor,
        experts: Fp8ExpertWeights,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        out: torch.Tensor = self.moe_fp8.fused_moe_fp8(x, experts, topk_weights, topk_ids)
        return out

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if in_graph_build() and self.triton.gemv_fits(x, weight):
            return self.triton.gemv(x, weight, bias)
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # 2-D rows, or 3-D [T, H, D] per-head rows (Qwen3's q/k norm over a strided view).
        return self.flashinfer.rmsnorm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # In place: residual += x, then x = rms_norm(residual).
        self.flashinfer.fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if in_graph_build():
            return self.triton.silu_and_mul(gate_up)
        return self.flashinfer.silu_and_mul(gate_up)

    def silu_mul_linear(
        self, gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if in_graph_build() and self.triton.gemv_fits(gate_up, weight):
            return self.triton.silu_mul_gemv(gate_up, weight, bias)
        return super().silu_mul_linear(gate_up, weight, bias)

    def fp8_linear(
        self, x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        out: torch.Tensor = self.fp8.fp8_linear(x, weight, bias)
        return out

    def rotation(self, table: RotaryTable, positions: torch.Tensor) -> Rotation:
        return FusedRotation(self.flashinfer, positions, table.cos_sin_float32())

    def qk_norm_rotate(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        rotation: Rotation,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (
            in_graph_build()
            and isinstance(rotation, FusedRotation)
            and heads_contiguous(q)
            and heads_contiguous(k)
        ):
            return self.triton.qk_norm_rope(
                q, k, q_weight, k_weight, eps, rotation.positions, rotation.cos_sin
            )
        return super().qk_norm_rotate(q, k, q_weight, k_weight, eps, rotation)


TORCH_KERNELS = TorchKernels()


class UsesKernels:
    """A module that runs ``kernels`` (the reference until ``use_kernels`` says otherwise)."""

    kernels: TorchKernels = TORCH_KERNELS


# Head dims FlashInfer's rotary kernel is built for (it falls back to a slower general path
# for others).
FUSED_HEAD_DIMS = (64, 128, 256, 512)


def select_kernels(device: torch.device, dtype: torch.dtype, head_dim: int) -> TorchKernels:
    """The fused kernels for half-precision models of a common head dim on a GPU when
    FlashInfer and Triton are installed (and ``OUTRIDER_DEBUG_TORCH_KERNELS`` is unset), else
    the reference."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return TORCH_KERNELS
    if head_dim not in FUSED_HEAD_DIMS:
        log.info("layer kernels: torch (head dim %d is not one of %s)", head_dim, FUSED_HEAD_DIMS)
        return TORCH_KERNELS
    if debug_knob("OUTRIDER_DEBUG_TORCH_KERNELS"):
        log.info("layer kernels: torch (OUTRIDER_DEBUG_TORCH_KERNELS)")
        return TORCH_KERNELS
    try:
        import flashinfer

        return FusedKernels(flashinfer)
    except ImportError as exc:
        log.info("layer kernels: torch (%s is not installed)", exc.name)
        return TORCH_KERNELS


def use_kernels(model: torch.nn.Module, kernels: TorchKernels) -> None:
    """Run every ``UsesKernels`` module of ``model`` with ``kernels``."""
    for module in model.modules():
        if isinstance(module, UsesKernels):
            module.kernels = kernels
