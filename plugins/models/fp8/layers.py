"""FP8 linears: the decoder's projections holding an FP8 checkpoint's weights and scales
(``fp8/config.py`` names the formats, ``fp8/reference.py`` the arithmetic), and ``use_fp8``,
which puts them (and ``fp8.experts.Fp8Experts`` for the routed experts) in place of the 16-bit
ones in a model built on the meta device.

What a rank holds, beside its FP8 weight (the cut of ``parallel.py``)::

    layer                  block scales [ceil(N/bn), ceil(K/bk)]    channel scales [N, 1]
    ---------------------  ---------------------------------------  ----------------------
    Fp8ColumnParallel      its rows' blocks (rows cut on a block    its rows
                           boundary)
      Fp8FusedLinear       each part's blocks, stacked as the       each part's rows
                           weight's parts are
    Fp8RowParallel         its columns' blocks (columns cut on a    all of them
                           block boundary)

Invariants:
- a rank's rows of a column-parallel weight (each part of a fused one) and its columns of a
  row-parallel one are whole blocks (``_check_whole_blocks``, refused at build); so the scale
  block of output row ``n`` is ``n // bn`` on every rank, fused or not, and the activation
  groups of a rank's columns are the model's;
- the bias stays in the model dtype; the LM head, embeddings and norms are never FP8;
- the scales are float32 whatever the checkpoint stored (a copy converts).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import Parameter

from outrider.plugins.models.config import TENSOR_PARALLEL_FLAG
from outrider.plugins.models.fp8.config import FP8_EXPERTS_REFUSAL, Fp8Config, block_problem
from outrider.plugins.models.fp8.experts import Fp8Experts
from outrider.plugins.models.fp8.reference import FP8, Fp8Weight, quantize_weight
from outrider.plugins.models.kernels import UsesKernels
from outrider.plugins.models.layers import FusedLinear
from outrider.plugins.models.moe.block import Experts
from outrider.plugins.models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    Sharded,
    Split,
    TPGroup,
)
from outrider.plugins.models.weights import SelfDrawn, checkpoint_table

_DECODER_LAYERS = "model.layers."
# The checkpoint names of linear weights in a decoder layer: every `*_proj`, and each
# expert's projections (Mixtral's w1 / w2 / w3); not the router nor the shared expert's gate.
_PROJECTION = re.compile(r"(_proj|\.experts\.\d+\.\w+)\.weight$")


class Fp8Linear(nn.Linear, Sharded, SelfDrawn, UsesKernels):
    """What the three FP8 linears share: the FP8 ``weight`` (in place of nn.Linear's), its
    scale parameter (named as the checkpoint names it) and dummy draws."""

    tp: TPGroup
    fp8: Fp8Config

    def _hold_fp8(self, fp8: Fp8Config, scale_shape: tuple[int, ...]) -> None:
        """Replace the 16-bit weight with FP8 storage of its shape, add the float32 scale."""
        self.fp8 = fp8
        self.weight = Parameter(torch.empty(self.weight.shape, dtype=FP8), requires_grad=False)
        scale = Parameter(torch.empty(scale_shape, dtype=torch.float32), requires_grad=False)
        self.register_parameter(fp8.scale_name, scale)

    @property
    def fp8_weight(self) -> Fp8Weight:
        return Fp8Weight(self.weight, self.get_parameter(self.fp8.scale_name), self.fp8.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output rows (the column and fused linears; the row-parallel one sums
        its partial product over the ranks instead)."""
        return self.kernels.fp8_linear(x, self.fp8_weight, self.bias)

    def checkpoint_parts(self) -> list[int]:
        """Rows of each checkpoint projection this module holds a cut of, in order."""
        raise NotImplementedError

    def checkpoint_columns(self) -> int:
        """Columns of the checkpoint projections."""
        return self.weight.shape[1]

    def init_dummy(self, generator: torch.Generator, std: float) -> None:
        """Each projection drawn whole as a single rank draws it, N(0, std), quantized whole
        in the checkpoint's format, then cut: any world size holds the same model."""
        in_features = self.checkpoint_columns()
        scale = self.fp8_weight.scale
        weights, scales, biases = [], [], []
        device = self.weight.device
        for rows in self.checkpoint_parts():
            whole = torch.empty((rows, in_features), device=device).normal_(
                0.0, std, generator=generator
            )
            quantized = quantize_weight(whole, self.fp8.block)
            weights.append(_cut(quantized.data, self.param_split("weight")))
            scales.append(_cut(quantized.scale, self.param_split(self.fp8.scale_name)))
            if self.bias is not None:
                bias = torch.empty(rows, device=device).normal_(0.0, std, generator=generator)
                biases.append(_cut(bias, self.param_split("bias")))
        self.weight.data.copy_(torch.cat(weights))
        scale.data.copy_(torch.cat(scales))
        if self.bias is not None:
            self.bias.data.copy_(torch.cat(biases))


def _cut(whole: torch.Tensor, split: Split | None) -> torch.Tensor:
    return whole if split is None else split.take(whole, tuple(whole.shape))


def _blocks(n: int, size: int) -> int:
    return math.ceil(n / size)


def _check_whole_blocks(name: str, what: str, local: int, size: int, tp: TPGroup) -> None:
    """``local`` (a rank's rows or columns of projection ``name``) must be whole blocks."""
    problem = block_problem(what, local, size, tp.size, TENSOR_PARALLEL_FLAG)
    if problem is not None:
        raise ValueError(f"{name}: {problem}")


class Fp8ColumnParallelLinear(Fp8Linear, ColumnParallelLinear):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPGroup,
        fp8: Fp8Config,
        name: str,
    ) -> None:
        super().__init__(in_features, out_features, bias, tp)
        rows = self.out_features
        if fp8.block is not None and tp.size > 1:
            _check_whole_blocks(name, "the rows", rows, fp8.block[0], tp)
        self._hold_fp8(fp8, _scale_shape(fp8, rows, in_features))

    def checkpoint_parts(self) -> list[int]:
        return [self.out_features * self.tp.size]


class Fp8FusedLinear(Fp8Linear, FusedLinear):
    def __init__(
        self,
        in_features: int,
        shard_rows: dict[str, int],
        bias: bool,
        tp: TPGroup,
        fp8: Fp8Config,
        name: str,
    ) -> None:
        super().__init__(in_features, shard_rows, bias, tp)
        self._scale_shards = dict(self.shards)
        if fp8.block is not None:
            start = 0
            for part, rows in zip(self.shards, self.sizes, strict=True):
                _check_whole_blocks(name, f"the {part} rows", rows, fp8.block[0], tp)
                self._scale_shards[part] = slice(start, start + rows // fp8.block[0])
                start += rows // fp8.block[0]
        self._hold_fp8(fp8, _scale_shape(fp8, self.out_features, in_features))

    def part_rows(self, leaf: str) -> dict[str, slice]:
        return self._scale_shards if leaf == self.fp8.scale_name else self.shards

    def checkpoint_parts(self) -> list[int]:
        return list(self.checkpoint_rows.values())


class Fp8RowParallelLinear(Fp8Linear, RowParallelLinear):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPGroup,
        fp8: Fp8Config,
        name: str,
        summed: bool = True,
    ) -> None:
        super().__init__(in_features, out_features, bias, tp, summed)
        columns = self.in_features
        if fp8.block is not None and tp.size > 1:
            _check_whole_blocks(name, "the columns", columns, fp8.block[1], tp)
        self._hold_fp8(fp8, _scale_shape(fp8, out_features, columns))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._summed(self.kernels.fp8_linear(x, self.fp8_weight, self._rank_bias()))

    def silu_mul_forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        weight, bias = self.fp8_weight, self._rank_bias()
        return self._summed(self.kernels.silu_mul_fp8_linear(gate_up, weight, bias))

    def checkpoint_parts(self) -> list[int]:
        return [self.out_features]

    def checkpoint_columns(self) -> int:
        return self.in_features * self.tp.size

    def param_split(self, name: str) -> Split | None:
        # Channel scales belong to output rows, which every rank holds whole.
        if name == "weight" or (name == self.fp8.scale_name and self.fp8.block is not None):
            return self.tp.split(1)
        return None


def _scale_shape(fp8: Fp8Config, rows: int, columns: int) -> tuple[int, int]:
    """A rank's scale shape for its ``rows x columns`` of FP8 weight (whole blocks where cut)."""
    if fp8.block is None:
        return (rows, 1)
    return (_blocks(rows, fp8.block[0]), _blocks(columns, fp8.block[1]))


def _fp8_twin(module: nn.Linear, fp8: Fp8Config, name: str) -> Fp8Linear:
    """The FP8 linear of ``module``'s shape and cut, sharing its bias (model dtype)."""
    has_bias = module.bias is not None
    twin: Fp8Linear
    if isinstance(module, FusedLinear):
        twin = Fp8FusedLinear(
            module.in_features, module.checkpoint_rows, has_bias, module.tp, fp8, name
        )
    elif isinstance(module, ColumnParallelLinear):
        out_features = module.out_features * module.tp.size
        twin = Fp8ColumnParallelLinear(
            module.in_features, out_features, has_bias, module.tp, fp8, name
        )
    elif isinstance(module, RowParallelLinear):
        in_features = module.in_features * module.tp.size
        twin = Fp8RowParallelLinear(
            in_features, module.out_features, has_bias, module.tp, fp8, name, module.summed
        )
    else:
        raise TypeError(f"{name}: {type(module).__name__} has no FP8 twin")
    twin.bias = module.bias
    return twin


def use_fp8(model: nn.Module, fp8: Fp8Config) -> None:
    """Put FP8 linears in place of the decoder layers' projections the checkpoint quantizes,
    and FP8 experts in place of the routed experts (on the meta device, after the model took
    its dtype: the FP8 weights and float32 scales keep theirs). ValueError naming the
    projection or experts where a rank's cut splits a block, or where the checkpoint quantizes
    some parts of a fused projection (or some experts' projections) only."""
    names: dict[int, list[str]] = {}
    for name, dest in checkpoint_table(model).items():
        if name.endswith(".weight"):
            names.setdefault(id(dest.tensor), []).append(name.removesuffix(".weight"))
    for path, module in list(model.named_modules()):
        if not path.startswith(_DECODER_LAYERS):
            continue
        twin: nn.Module
        if isinstance(module, Experts):
            projections = names[id(module.w13)] + names[id(module.w2)]
            what = f"its {len(projections)} expert projections only (they run stacked)"
            if not _all_or_none(fp8, path, projections, what):
                continue
            with torch.device(module.w13.device):
                twin = _fp8_experts_twin(module, fp8, path)
        elif isinstance(module, ColumnParallelLinear | RowParallelLinear):
            projections = names[id(module.weight)]
            what = f"{', '.join(projections)} only (they run as one fused projection)"
            if not _all_or_none(fp8, path, projections, what):
                continue
            with torch.device(module.weight.device):
                twin = _fp8_twin(module, fp8, path)
        else:
            continue
        parent, _, attribute = path.rpartition(".")
        setattr(model.get_submodule(parent), attribute, twin)


def _all_or_none(fp8: Fp8Config, path: str, projections: list[str], what: str) -> bool:
    """Whether the checkpoint quantizes ``projections`` (all run as module ``path``);
    ValueError "quantizes some of ``what``" where it quantizes some only."""
    quantized = [fp8.quantizes(projection) for projection in projections]
    if any(quantized) and not all(quantized):
        raise ValueError(f"{path}: the checkpoint quantizes some of {what}")
    return all(quantized)


def _fp8_experts_twin(module: Experts, fp8: Fp8Config, name: str) -> Fp8Experts:
    """The FP8 experts of ``module``'s shape and cut (block-scaled checkpoints only)."""
    if fp8.block is None:
        raise ValueError(f"{name}: {FP8_EXPERTS_REFUSAL}")
    hidden = module.w13.shape[2]
    return Fp8Experts(hidden, module.moe, fp8, name, module.tp)


@dataclass(frozen=True)
class Fp8Layout:
    """What an FP8 checkpoint of a model holds besides its 16-bit layout: which weights are
    FP8 and the shape of each scale tensor."""

    fp8_weights: frozenset[str]
    scales: dict[str, tuple[int, ...]]


def fp8_layout(shapes: dict[str, tuple[int, ...]], fp8: Fp8Config) -> Fp8Layout:
    """The FP8 weights and scales of a checkpoint whose 16-bit layout is ``shapes`` (name ->
    shape, as ``loader.expected_checkpoint_shapes`` lists them)."""
    quantized: set[str] = set()
    scales: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        module = name.removesuffix(".weight")
        if not (name.startswith(_DECODER_LAYERS) and _PROJECTION.search(name)):
            continue
        if not fp8.quantizes(module):
            continue
        quantized.add(name)
        scales[f"{module}.{fp8.scale_name}"] = _scale_shape(fp8, shape[0], shape[1])
    return Fp8Layout(frozenset(quantized), scales)
