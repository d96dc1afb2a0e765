"""FP8 routed experts: ``moe.block.Experts`` holding a block-scaled FP8 checkpoint's expert weights
(``fp8.reference.Fp8ExpertWeights``), loaded from one FP8 tensor and one scale tensor per expert and
projection, and run through ``kernels.fused_moe_fp8``. ``use_fp8`` (``fp8/layers.py``) puts
them in place of the 16-bit experts.

What rank ``r`` of ``N`` holds (``I`` an expert's intermediate size, blocks ``(bn, bk)``)::

    parameter   shape                        checkpoint tensors (e: expert)
    ----------  ---------------------------  ---------------------------------------------
    w13         [E, 2I/N, H] float8_e4m3fn   experts.{e}.{gate,up}.weight [I, H]: rows
                                             r*I/N .. of each, gate's then up's
    w13_scale   [E, 2I/(N bn), ceil(H/bk)]   experts.{e}.{gate,up}.weight_scale_inv
                                             [I/bn, ceil(H/bk)]: the blocks of those rows
    w2          [E, H, I/N] float8_e4m3fn    experts.{e}.{down}.weight [H, I]: columns
                                             r*I/N ..
    w2_scale    [E, ceil(H/bn), I/(N bk)]    experts.{e}.{down}.weight_scale_inv
                                             [ceil(H/bn), ceil(I/bk)]: those columns' blocks

Invariants:
- a rank's ``I/N`` is whole blocks of ``bn`` (gate and up stack by rows, so their scales
  stack by block rows) and, cut, of ``bk`` (its down columns are the model's activation
  groups): refused at build otherwise (``expert_block_problems``, also a start check);
- the router stays in the model dtype whatever ``modules_to_not_convert`` says.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch.nn import Parameter

from outrider.plugins.models.config import TENSOR_PARALLEL_FLAG
from outrider.plugins.models.fp8.config import Fp8Config, expert_block_problems
from outrider.plugins.models.fp8.reference import FP8, Fp8ExpertWeights, Fp8Weight, quantize_weight
from outrider.plugins.models.moe.block import ExpertNames, Experts, Routing
from outrider.plugins.models.parallel import SINGLE, Split, TPGroup
from outrider.plugins.models.weights import Destination, SelfDrawn

if TYPE_CHECKING:
    from outrider.plugins.models.config import MoeConfig


class Fp8Experts(Experts, SelfDrawn):
    """The routed experts in FP8 with block scales; the rank's intermediate rows of each."""

    def __init__(
        self, hidden_size: int, moe: MoeConfig, fp8: Fp8Config, name: str, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__(hidden_size, moe, tp)
        assert fp8.block is not None, "FP8 experts are block-scaled"
        problems = expert_block_problems(
            moe.intermediate_size, fp8.block, tp.size, TENSOR_PARALLEL_FLAG
        )
        if problems:
            raise ValueError(f"{name}: " + "; ".join(problems))
        self.block = fp8.block
        self.scale_name = fp8.scale_name
        bn, bk = fp8.block
        experts, rows = moe.num_experts, self.rows
        self.w13 = Parameter(torch.empty(self.w13.shape, dtype=FP8), requires_grad=False)
        self.w2 = Parameter(torch.empty(self.w2.shape, dtype=FP8), requires_grad=False)
        self.w13_scale = _scale((experts, 2 * rows // bn, math.ceil(hidden_size / bk)))
        self.w2_scale = _scale((experts, math.ceil(hidden_size / bn), math.ceil(rows / bk)))

    @property
    def fp8_weights(self) -> Fp8ExpertWeights:
        return Fp8ExpertWeights(self.w13, self.w13_scale, self.w2, self.w2_scale, self.block)

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        return self.kernels.fused_moe_fp8(x, self.fp8_weights, routing.weights, routing.ids)

    def destinations(self, prefix: str, names: ExpertNames) -> dict[str, Destination]:
        table = super().destinations(prefix, names)
        blocks = self.rows // self.block[0]
        by_rows, by_columns = self.tp.split(0), self.tp.split(1)
        for e in range(self.w13.shape[0]):
            gate = Destination(self.w13_scale, (e, slice(0, blocks)), by_rows)
            up = Destination(self.w13_scale, (e, slice(blocks, 2 * blocks)), by_rows)
            down = Destination(self.w2_scale, e, by_columns)
            table[f"{prefix}.{e}.{names.gate}.{self.scale_name}"] = gate
            table[f"{prefix}.{e}.{names.up}.{self.scale_name}"] = up
            table[f"{prefix}.{e}.{names.down}.{self.scale_name}"] = down
        return table

    def init_dummy(self, generator: torch.Generator, std: float) -> None:
        """Each expert's projections drawn whole as a single rank draws them, N(0, std),
        quantized whole, then cut: any world size holds the same experts."""
        rows, hidden = self.rows * self.tp.size, self.w13.shape[2]
        by_rows, by_columns = self.tp.split(0), self.tp.split(1)
        for e in range(self.w13.shape[0]):
            gate, up, down = (
                self._draw(shape, generator, std)
                for shape in ((rows, hidden), (rows, hidden), (hidden, rows))
            )
            self.w13.data[e] = torch.cat([_cut(gate.data, by_rows), _cut(up.data, by_rows)])
            self.w13_scale.data[e] = torch.cat([_cut(gate.scale, by_rows), _cut(up.scale, by_rows)])
            self.w2.data[e] = _cut(down.data, by_columns)
            self.w2_scale.data[e] = _cut(down.scale, by_columns)

    def _draw(self, shape: tuple[int, int], generator: torch.Generator, std: float) -> Fp8Weight:
        whole = torch.empty(shape, device=self.w13.device).normal_(0.0, std, generator=generator)
        return quantize_weight(whole, self.block)


def _scale(shape: tuple[int, int, int]) -> Parameter:
    return Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)


def _cut(whole: torch.Tensor, split: Split | None) -> torch.Tensor:
    return whole if split is None else split.take(whole, tuple(whole.shape))
