"""Mixture-of-experts MLP blocks (Qwen3-MoE, Mixtral, Qwen2-MoE) and the model class that
puts them in the layers its config names (``MoeConfig.sparse_layers``; the others run the
dense MLP).

A block routes each token to its ``top_k`` experts (a linear router, softmax in float32,
top-k, renormalised when the config says so) and runs them through ``kernels.fused_moe``.
The experts are held stacked per layer; the checkpoint holds one tensor per expert and
projection, each loaded into its slice (``NamesCheckpoint``). What rank ``r`` of ``N`` holds,
``I`` an expert's intermediate size, ``{block}`` ``mlp`` (Mixtral: ``block_sparse_moe``)::

    parameter                   shape            checkpoint tensors (e: expert)
    --------------------------  ---------------  -------------------------------------------
    gate.weight (router)        [E, H]           {block}.gate.weight, whole
    experts.w13                 [E, 2I/N, H]     {block}.experts.{e}.{gate,up}.weight [I, H]:
                                                 rows r*I/N .. of each, gate's then up's
    experts.w2                  [E, H, I/N]      {block}.experts.{e}.{down}.weight [H, I]:
                                                 columns r*I/N ..
    shared_expert (Qwen2-MoE)   an MLP           {block}.shared_expert.*, cut as the MLP
    shared_expert_gate          [1, H]           {block}.shared_expert_gate.weight, whole

The router runs whole on every rank (its input is the same everywhere); each rank's experts
give a partial sum over its intermediate rows, which the layer's next norm sums over the
ranks (``RMSNorm.add``), as it sums the attention's row-parallel output. FP8 checkpoints'
experts are ``fp8.experts.Fp8Experts``, put in place of ``Experts`` by ``fp8.layers.use_fp8``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from outrider.plugins.models.kernels import UsesKernels
from outrider.plugins.models.layers import MLP, DecoderForCausalLM, dense_mlp
from outrider.plugins.models.parallel import SINGLE, TPGroup
from outrider.plugins.models.weights import Destination, NamesCheckpoint, checkpoint_table

if TYPE_CHECKING:
    from outrider.plugins.models.config import ModelConfig, MoeConfig


@dataclass(frozen=True)
class ExpertNames:
    """How a family's checkpoint names a block and its experts' projections."""

    block: str
    gate: str
    up: str
    down: str


_QWEN_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
EXPERT_NAMES: dict[str, ExpertNames] = {
    "qwen2_moe": _QWEN_NAMES,
    "qwen3_moe": _QWEN_NAMES,
    "mixtral": ExpertNames("block_sparse_moe", "w1", "w3", "w2"),
}


def _moe(config: ModelConfig) -> MoeConfig:
    assert config.moe is not None, f"{config.model_type} is not a mixture of experts"
    return config.moe


@dataclass(frozen=True)
class Routing:
    """Each token's experts, best first."""

    weights: torch.Tensor  # [T, k] float32
    ids: torch.Tensor  # [T, k] int32


class Router(nn.Module, UsesKernels):
    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize

    def forward(self, x: torch.Tensor) -> Routing:
        """``x: [T, H]``: logits in ``x``'s dtype, softmax and top-k in float32."""
        probs = self.kernels.linear(x, self.weight, None).float().softmax(dim=-1)  # [T, E]
        top = probs.topk(self.top_k, dim=-1)
        weights = top.values
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(weights, top.indices.to(torch.int32))


class Experts(nn.Module, UsesKernels):
    """The routed experts, stacked; the rank's intermediate rows of each."""

    def __init__(self, hidden_size: int, moe: MoeConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        rows = tp.part(moe.intermediate_size, moe.intermediate_key)
        self.moe = moe
        self.rows = rows
        self.tp = tp
        self.w13 = nn.Parameter(torch.empty(moe.num_experts, 2 * rows, hidden_size))
        self.w2 = nn.Parameter(torch.empty(moe.num_experts, hidden_size, rows))

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """``x: [T, H]`` -> the rank's partial sum ``[T, H]``."""
        return self.kernels.fused_moe(x, self.w13, self.w2, routing.weights, routing.ids)

    def destinations(self, prefix: str, names: ExpertNames) -> dict[str, Destination]:
        """The table entries of every expert's three checkpoint tensors under ``prefix``."""
        rows, by_rows, by_columns = self.rows, self.tp.split(0), self.tp.split(1)
        table: dict[str, Destination] = {}
        for e in range(self.w13.shape[0]):
            table[f"{prefix}.{e}.{names.gate}.weight"] = Destination(
                self.w13, (e, slice(0, rows)), by_rows
            )
            table[f"{prefix}.{e}.{names.up}.weight"] = Destination(
                self.w13, (e, slice(rows, 2 * rows)), by_rows
            )
            table[f"{prefix}.{e}.{names.down}.weight"] = Destination(self.w2, e, by_columns)
        return table


class SparseMoeBlock(nn.Module, NamesCheckpoint, UsesKernels):
    """One layer's experts (and Qwen2-MoE's shared expert): ``[T, H] -> [T, H]``, the rank's
    part of the sum over the ranks (a ``FeedForward``)."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        moe = _moe(config)
        self.names = EXPERT_NAMES[config.model_type]
        self.gate = Router(config.hidden_size, moe)
        self.experts = Experts(config.hidden_size, moe, tp)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Parameter | None = None
        if moe.shared_expert_size:
            self.shared_expert = MLP(config, tp, moe.shared_expert_size, summed=False)
            self.shared_expert_gate = nn.Parameter(torch.empty(1, config.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is None or self.shared_expert_gate is None:
            return out
        scale = torch.sigmoid(self.kernels.linear(x, self.shared_expert_gate, None))  # [T, 1]
        return out + scale * self.shared_expert(x)

    def checkpoint_destinations(self, path: str) -> dict[str, Destination]:
        parent = path.rpartition(".")[0]
        block = f"{parent}.{self.names.block}" if parent else self.names.block
        table = {f"{block}.gate.weight": Destination(self.gate.weight, None, None)}
        table |= self.experts.destinations(f"{block}.experts", self.names)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = checkpoint_table(self.shared_expert)
            table |= {f"{block}.shared_expert.{name}": d for name, d in shared.items()}
            gate = Destination(self.shared_expert_gate, None, None)
            table[f"{block}.shared_expert_gate.weight"] = gate
        return table


def moe_checkpoint_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors (and shapes) of sparse layer ``layer``'s block."""
    moe, names, hidden = _moe(config), EXPERT_NAMES[config.model_type], config.hidden_size
    block, inter = f"model.layers.{layer}.{names.block}", moe.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {f"{block}.gate.weight": (moe.num_experts, hidden)}
    for e in range(moe.num_experts):
        shapes[f"{block}.experts.{e}.{names.gate}.weight"] = (inter, hidden)
        shapes[f"{block}.experts.{e}.{names.up}.weight"] = (inter, hidden)
        shapes[f"{block}.experts.{e}.{names.down}.weight"] = (hidden, inter)
    shared = moe.shared_expert_size
    if shared:
        shapes[f"{block}.shared_expert.gate_proj.weight"] = (shared, hidden)
        shapes[f"{block}.shared_expert.up_proj.weight"] = (shared, hidden)
        shapes[f"{block}.shared_expert.down_proj.weight"] = (hidden, shared)
        shapes[f"{block}.shared_expert_gate.weight"] = (1, hidden)
    return shapes


class MoeForCausalLM(DecoderForCausalLM):
    """A decoder whose sparse layers run a ``SparseMoeBlock``, the others the dense MLP."""

    def feed_forward(self, config: ModelConfig, layer_id: int, tp: TPGroup) -> nn.Module:
        if layer_id in _moe(config).sparse_layers:
            return SparseMoeBlock(config, tp)
        return dense_mlp(config, layer_id, tp)
