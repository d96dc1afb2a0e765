"""gpt-oss (``GptOssForCausalLM``): attention with biases and a learned sink per head
(``AttentionShape.sinks``), sliding-window layers alternating with full ones
(``AttentionShape.windows``), YaRN rotary scaling (config.py), and experts in every layer: a
router with a bias whose softmax runs over its top-k logits, and experts with biased
projections under the clamped SwiGLU (``ClampedSwiglu``).

Checkpoint layout (the HF one; ``E`` experts of ``I`` rows, ``H`` hidden)::

    parameter (and checkpoint name)        shape
    -------------------------------------  -----------------------------------------------
    mlp.router.weight, .bias               [E, H], [E]
    mlp.experts.gate_up_proj               [E, H, 2I]: gate and up interleaved (columns
                                           2j and 2j + 1 hold row j of each)
    mlp.experts.gate_up_proj_bias          [E, 2I], interleaved alike
    mlp.experts.down_proj, _bias           [E, I, H], [E, H]
    self_attn.sinks                        [heads]

Experts stored in mxfp4 (``quant_method: mxfp4``, as the published checkpoints are: mxfp4.py)
are held so, ``{gate_up,down}_proj_blocks`` and ``_scales`` of ``[E, out, in / 32, ...]`` (the
transpose of the 16-bit layout): on a GPU they run through Triton kernels that dequantize in
registers (moe/mxfp4_kernels.py: GEMVs at decode sizes, grouped GEMMs past them), on the CPU
dequantized an expert at a time.

Under tensor parallelism the attention heads (and their sinks) are cut as every family's, and
the experts are not cut at all: each rank holds ``E / N`` of them whole (expert parallelism),
runs the tokens routed to those (the router runs whole on every rank), and the ranks' shares
are summed as a row-parallel layer's output is. So no mxfp4 block is ever split, whatever
the intermediate size (gpt-oss's 2,880 rows are 90 blocks: no four equal shares).

Not yet: a kernel for the 16-bit experts (they run through ``moe/reference.py``'s sum, as
the 16-bit reference of the other families does).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from outrider.plugins.graph_build import in_graph_build
from outrider.plugins.models.kernels import UsesKernels
from outrider.plugins.models.layers import DecoderForCausalLM
from outrider.plugins.models.moe.block import Routing
from outrider.plugins.models.moe.reference import sum_over_experts
from outrider.plugins.models.mxfp4 import BLOCK, SCALE_BIAS, dequantize
from outrider.plugins.models.parallel import SINGLE, Sharded, Split, TPGroup
from outrider.plugins.models.weights import SelfDrawn

if TYPE_CHECKING:
    from outrider.plugins.models.config import ClampedSwiglu, ModelConfig, MoeConfig
    from outrider.plugins.models.moe.mxfp4_kernels import Mxfp4ExpertWeights


def _experts_of(config: ModelConfig) -> tuple[MoeConfig, ClampedSwiglu]:
    moe = config.moe
    assert moe is not None and moe.clamped_swiglu is not None, "a gpt-oss config"
    return moe, moe.clamped_swiglu


class GptOssRouter(nn.Module, UsesKernels):
    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(moe.num_experts))
        self.top_k = moe.top_k

    def forward(self, x: torch.Tensor) -> Routing:
        """``x: [T, H]``: the top-k logits (in ``x``'s dtype), their softmax in float32."""
        top = self.kernels.linear(x, self.weight, self.bias).topk(self.top_k, dim=-1)
        return Routing(top.values.float().softmax(dim=-1), top.indices.to(torch.int32))


class GptOssExperts(nn.Module, Sharded):
    """The rank's experts, whole (expert parallelism: module docstring), in 16 bits."""

    def __init__(
        self, hidden_size: int, moe: MoeConfig, swiglu: ClampedSwiglu, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        self._hold(moe, swiglu, tp)
        local, rows = len(self.held), moe.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(local, hidden_size, 2 * rows))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(local, 2 * rows))
        self.down_proj = nn.Parameter(torch.empty(local, rows, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.empty(local, hidden_size))

    def _hold(self, moe: MoeConfig, swiglu: ClampedSwiglu, tp: TPGroup) -> None:
        local = tp.part(moe.num_experts, "num_local_experts")
        self.held = range(tp.rank * local, (tp.rank + 1) * local)  # global expert indices
        self.num_experts = moe.num_experts
        self.swiglu = swiglu
        self.tp = tp

    def param_split(self, name: str) -> Split | None:
        return self.tp.split(0)  # each parameter stacks the experts

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """``x: [T, H]`` -> the rank's experts' share of the output ``[T, H]`` (to be summed
        over the ranks): each token's experts, weighted, summed in ascending expert order
        (grouped by expert; every held expert on every token while a CUDA graph is built)."""
        return sum_over_experts(
            x,
            routing.weights,
            routing.ids,
            self.num_experts,
            self._product,
            every_expert=in_graph_build(),
            held=self.held,
        )

    def _product(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """Expert ``expert`` (a global index) on the rows ``x: [n, H]``."""
        local = expert - self.held.start
        return self._gated(x, local, self.gate_up_proj[local], self.down_proj[local])

    def _gated(
        self, x: torch.Tensor, local: int, gate_up_proj: torch.Tensor, down_proj: torch.Tensor
    ) -> torch.Tensor:
        """``x: [n, H]`` through held expert ``local``'s ``gate_up_proj: [H, 2I]``
        (interleaved) and ``down_proj: [I, H]``, with its biases, under the clamped SwiGLU."""
        gate_up = x @ gate_up_proj + self.gate_up_proj_bias[local]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        limit = self.swiglu.limit
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        glu = gate * torch.sigmoid(gate * self.swiglu.alpha)
        return ((up + 1) * glu) @ down_proj + self.down_proj_bias[local]


class GptOssMxfp4Experts(GptOssExperts, SelfDrawn):
    """The rank's experts with their projections in mxfp4 (module docstring); biases in 16
    bits."""

    def __init__(
        self, hidden_size: int, moe: MoeConfig, swiglu: ClampedSwiglu, tp: TPGroup = SINGLE
    ) -> None:
        nn.Module.__init__(self)
        self._hold(moe, swiglu, tp)
        local, rows = len(self.held), moe.intermediate_size
        gate_up = (local, 2 * rows, _blocks(hidden_size, "gate_up_proj"))
        down = (local, hidden_size, _blocks(rows, "down_proj"))
        self.gate_up_proj_blocks = _packed(*gate_up, BLOCK // 2)
        self.gate_up_proj_scales = _packed(*gate_up)
        self.down_proj_blocks = _packed(*down, BLOCK // 2)
        self.down_proj_scales = _packed(*down)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(local, 2 * rows))
        self.down_proj_bias = nn.Parameter(torch.empty(local, hidden_size))

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """On a GPU the mxfp4 kernels (moe/mxfp4_kernels.py, dequantizing in registers): GEMVs
        at decode sizes, grouped GEMMs past them; on the CPU the reference sum."""
        if not x.is_cuda:
            return super().forward(x, routing)
        # Triton is imported on a GPU only (an optional dependency).
        from outrider.plugins.models.moe import mxfp4_kernels

        small = routing.ids.numel() <= mxfp4_kernels.MAX_PAIRS
        run = mxfp4_kernels.mxfp4_decode_moe if small else mxfp4_kernels.mxfp4_grouped_moe
        return run(x, self._stored(), routing.weights, routing.ids)

    def _stored(self) -> Mxfp4ExpertWeights:
        from outrider.plugins.models.moe.mxfp4_kernels import Mxfp4ExpertWeights

        return Mxfp4ExpertWeights(
            self.gate_up_proj_blocks, self.gate_up_proj_scales, self.gate_up_proj_bias,
            self.down_proj_blocks, self.down_proj_scales, self.down_proj_bias,
            self.held.start, len(self.held), self.swiglu.alpha, self.swiglu.limit,
        )  # fmt: skip

    def _product(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        local = expert - self.held.start
        gate_up, down = (
            dequantize(blocks[local], scales[local], x.dtype).t()
            for blocks, scales in (
                (self.gate_up_proj_blocks, self.gate_up_proj_scales),
                (self.down_proj_blocks, self.down_proj_scales),
            )
        )  # [H, 2I] and [I, H], as the 16-bit experts hold them
        return self._gated(x, local, gate_up, down)

    def init_dummy(self, generator: torch.Generator, std: float) -> None:
        """Random nibbles under one scale that keeps every weight within ``4 * std`` (the
        largest e2m1 value is 6), biases N(0, std): each expert from a generator of its own,
        seeded from ``generator`` alike on every rank, so that a rank holds the experts a
        single rank draws."""
        exponent = SCALE_BIAS + math.floor(math.log2(4 * std / 6.0))
        device = self.down_proj_bias.device
        base = int(torch.randint(0, 2**62, (1,), generator=generator, device=device).item())
        for local, expert in enumerate(self.held):
            own = torch.Generator(device=device).manual_seed(base + expert)
            for name in ("gate_up_proj", "down_proj"):
                blocks: torch.Tensor = getattr(self, f"{name}_blocks")[local]
                drawn = torch.randint(0, 256, blocks.shape, generator=own, device=device)
                blocks.copy_(drawn.to(torch.uint8))
                getattr(self, f"{name}_scales")[local].fill_(exponent)
                getattr(self, f"{name}_bias")[local].normal_(0.0, std, generator=own)


class GptOssMoeBlock(nn.Module):
    """One layer's router (whole on every rank) and the rank's experts (``mlp.``):
    ``[T, H] -> [T, H]``, the rank's part of the sum over the ranks (a ``FeedForward``)."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        moe, swiglu = _experts_of(config)
        self.router = GptOssRouter(config.hidden_size, moe)
        experts = GptOssMxfp4Experts if config.mxfp4_experts else GptOssExperts
        self.experts = experts(config.hidden_size, moe, swiglu, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GptOssForCausalLM(DecoderForCausalLM):
    model_type = "gpt_oss"

    def feed_forward(self, config: ModelConfig, layer_id: int, tp: TPGroup) -> nn.Module:
        return GptOssMoeBlock(config, tp)


def gpt_oss_checkpoint_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors (and shapes) of layer ``layer``'s sinks and experts."""
    moe, _ = _experts_of(config)
    experts, rows, hidden = moe.num_experts, moe.intermediate_size, config.hidden_size
    prefix = f"model.layers.{layer}"
    shapes = {
        f"{prefix}.self_attn.sinks": (config.num_q_heads,),
        f"{prefix}.mlp.router.weight": (experts, hidden),
        f"{prefix}.mlp.router.bias": (experts,),
        f"{prefix}.mlp.experts.gate_up_proj_bias": (experts, 2 * rows),
        f"{prefix}.mlp.experts.down_proj_bias": (experts, hidden),
    }
    projections = {"gate_up_proj": (2 * rows, hidden), "down_proj": (hidden, rows)}
    for name, (out, into) in projections.items():
        path = f"{prefix}.mlp.experts.{name}"
        if config.mxfp4_experts:
            groups = _blocks(into, name)
            shapes[f"{path}_blocks"] = (experts, out, groups, BLOCK // 2)
            shapes[f"{path}_scales"] = (experts, out, groups)
        else:
            shapes[path] = (experts, into, out)
    return shapes


def _packed(*shape: int) -> nn.Parameter:
    """Bytes of mxfp4 blocks or scales (no gradient: an integer parameter takes none)."""
    return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)


def _blocks(features: int, name: str) -> int:
    """The mxfp4 blocks of a row of ``features`` inputs; ValueError where they do not
    divide it."""
    if features % BLOCK:
        raise ValueError(f"mxfp4 {name}: {features} input features are not blocks of {BLOCK}")
    return features // BLOCK
