"""Tensor parallelism over ``torch.distributed``: a rank's group and the sharded layers.

What rank ``r`` of ``N`` holds and what each layer communicates::

    layer                    rank r holds (of the checkpoint tensor)      communication
    -----------------------  -------------------------------------------  -----------------
    ColumnParallelLinear     output rows   r*O/N .. (r+1)*O/N             none: output split
      FusedLinear            the same cut of each part (q, k, v; gate,
                             up): its heads' q, k, v, its gate and up
    RowParallelLinear        input columns r*I/N .. (r+1)*I/N; the bias   all-reduce (sum), or
                             whole, added by rank 0 only                  in the next norm
    VocabParallelEmbedding   vocabulary rows r*V/N .. (r+1)*V/N           all-reduce (sum)
    LM head (column over V)  vocabulary rows, as the embedding            ``gather_vocab``
                                                                          or ``vocab_argmax``
                                                                          or ``vocab_top_logprobs``
    norms, q/k norms, RoPE   everything (replicated)                      none

A world of size 1 never touches ``torch.distributed`` and runs exactly the ops of a plain
``nn.Linear`` / ``nn.Embedding``: its numerics are those of the unsharded model, bit for bit.
Sizes that do not divide are refused before anything is built
(``outrider.plugins.models.config.tensor_parallel_problems``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from outrider.plugins.debug import debug_knob
from outrider.plugins.graph_build import in_graph_build
from outrider.plugins.models.config import TENSOR_PARALLEL_FLAG
from outrider.plugins.models.kernels import UsesKernels
from outrider.plugins.models.peer_reduce import PeerAllReduce, join_peer_all_reduce

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from outrider.plugins.models.peer_norm import PeerSumNorm


class TensorSource(Protocol):
    """A checkpoint tensor, in memory (``torch.Tensor``) or not yet read (a safetensors
    slice): indexing reads the part asked for."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class Split:
    """Rank ``rank``'s cut of a checkpoint tensor: part ``rank`` of ``parts`` equal parts
    along ``dim`` (0: rows, 1: columns)."""

    dim: int
    rank: int
    parts: int

    def take(self, source: TensorSource, full: tuple[int, ...]) -> torch.Tensor:
        """The rank's part of ``source``, whose shape is ``full``."""
        size = full[self.dim] // self.parts
        cut = slice(self.rank * size, (self.rank + 1) * size)
        return source[cut] if self.dim == 0 else source[:, cut]

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint shape whose part has shape ``local``."""
        return tuple(n * self.parts if d == self.dim else n for d, n in enumerate(local))


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group. ``group`` None with ``size`` 1: no
    communication at all. (A size > 1 without a group builds sharded shapes only, e.g. on
    the meta device for checks; any collective then needs the default group initialised.)
    ``peer`` sums the small messages of one host's GPUs (peer_reduce.py); the rest, and
    everything without it, goes through ``torch.distributed``."""

    rank: int = 0
    size: int = 1
    group: ProcessGroup | None = None
    peer: PeerAllReduce | None = None

    def part(self, total: int, what: str) -> int:
        """This rank's share of ``total`` (ValueError naming the flag unless it divides)."""
        if total % self.size:
            raise ValueError(f"{TENSOR_PARALLEL_FLAG} {self.size} does not divide {what} ({total})")
        return total // self.size

    def split(self, dim: int) -> Split | None:
        """The rank's cut along ``dim``; None in a world of one (the whole tensor)."""
        return None if self.size == 1 else Split(dim, self.rank, self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks, in place."""
        if self.peer is not None and self.peer.takes(x):
            return self.peer(x)
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def fused_sum_norm(self, x: torch.Tensor, residual: torch.Tensor) -> PeerSumNorm | None:
        """The kernel that sums ``x`` over the ranks with the residual add and norm after
        it, where one does (inside a CUDA graph's build: a Triton launch costs more host
        time than an eager step saves); None: ``all_reduce``, then the norm."""
        norm = None if self.peer is None else self.peer.norm
        if norm is None or not in_graph_build() or not norm.takes(x, residual):
            return None
        return None if debug_knob("OUTRIDER_DEBUG_NO_PEER_NORM") else norm

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape on all), in rank order."""
        if self.size == 1:
            return [x]
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return parts


SINGLE = TPGroup()


def init_tensor_parallel(
    rank: int, size: int, init_method: str, backend: str, peer_devices: range | None = None
) -> TPGroup:
    """Join the default process group (``backend``: "nccl" on GPUs, "gloo" on CPU) through
    ``init_method`` (``tcp://HOST:PORT``, torch.distributed's rendezvous) and return this
    rank's handle. A world of one joins nothing. ``peer_devices``: the GPUs of a world on
    one host, whose small all-reduces then go over their peer memory (every rank passes the
    same)."""
    if size == 1:
        return SINGLE
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
    group = dist.group.WORLD
    assert group is not None
    if peer_devices is None:
        return TPGroup(rank, size, group)
    device = torch.device("cuda", torch.cuda.current_device())
    return TPGroup(rank, size, group, join_peer_all_reduce(group, device, peer_devices))


class Sharded:
    """A module holding its rank's cut of some parameters."""

    def param_split(self, name: str) -> Split | None:
        """How parameter ``name`` is cut from its checkpoint tensor; None: held whole."""
        raise NotImplementedError


class ColumnParallelLinear(nn.Linear, Sharded, UsesKernels):
    """``y = x W^T + b`` with the rank's ``out_features / N`` output rows: the output stays
    split (the next layer is row-parallel, or the caller gathers)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__(in_features, tp.part(out_features, "output features"), bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, self.weight, self.bias)

    def param_split(self, name: str) -> Split | None:
        return self.tp.split(0)


class RowParallelLinear(nn.Linear, Sharded, UsesKernels):
    """``y = x W^T + b`` from the rank's ``in_features / N`` input columns (``x`` split the
    same way), summed over the ranks; ``summed`` False: the rank's part of that sum, which
    the caller sums (a decoder block's output, summed in the next ``RMSNorm.add``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPGroup = SINGLE,
        summed: bool = True,
    ) -> None:
        super().__init__(tp.part(in_features, "input features"), out_features, bias=bias)
        self.tp = tp
        self.summed = summed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._summed(self.kernels.linear(x, self.weight, self._rank_bias()))

    def silu_mul_forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``forward(kernels.silu_and_mul(gate_up))``, in one kernel where the kernels can."""
        return self._summed(self.kernels.silu_mul_linear(gate_up, self.weight, self._rank_bias()))

    def _rank_bias(self) -> torch.Tensor | None:
        # NOTE: every rank holds the whole bias; only rank 0 adds it, or the sum counts it N times.
        return self.bias if self.tp.rank == 0 else None

    def _summed(self, y: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(y) if self.summed and self.tp.size > 1 else y

    def param_split(self, name: str) -> Split | None:
        return self.tp.split(1) if name == "weight" else None


class VocabParallelEmbedding(nn.Embedding, Sharded):
    """The rank's vocabulary rows ``vocab_start .. vocab_start + num_embeddings``; ids outside
    them look up zeros, and the sum over the ranks is the full lookup (exact: one rank
    contributes each row, the others zeros)."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup = SINGLE) -> None:
        super().__init__(tp.part(vocab_size, "vocab_size"), dim)
        self.tp = tp
        self.vocab_start = tp.rank * self.num_embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, H]
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def param_split(self, name: str) -> Split | None:
        return self.tp.split(0)


def gather_vocab(local: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """``local: [n, V/N]`` (each rank its vocabulary slice, in rank order) -> ``[n, V]`` on
    every rank. Only where full logits are needed (sampling); greedy needs ``vocab_argmax``."""
    if tp.size == 1:
        return local
    return torch.cat(tp.all_gather(local), dim=-1)


def vocab_argmax(local: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """``local: [n, V/N]`` -> ``[n]`` int64: the global argmax ids, on every rank, without
    gathering the logits: each rank's (max, global id), one all-gather of those pairs, then
    the best rank per row. Ties go to the lowest id, as ``argmax`` over the full row does."""
    index = local.argmax(dim=-1)  # [n]: the first maximum of the slice
    if tp.size == 1:
        return index
    best = local.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    # float64 holds a float32 maximum and any vocabulary id exactly: one collective for both.
    pairs = torch.stack((best.double(), (index + tp.rank * local.shape[-1]).double()))  # [2, n]
    gathered = torch.stack(tp.all_gather(pairs))  # [N, 2, n]
    winner = gathered[:, 0].argmax(dim=0, keepdim=True)  # [1, n]: ties to the lowest rank
    return gathered[:, 1].gather(0, winner).squeeze(0).long()


@dataclass(frozen=True)
class VocabTop:
    """The ``k`` best tokens of each row over the whole vocabulary, best first."""

    logprobs: torch.Tensor  # [n, k] float32: log-softmax over the whole vocabulary
    ids: torch.Tensor  # [n, k] int64: global vocabulary ids


def vocab_top_logprobs(local: torch.Tensor, k: int, tp: TPGroup) -> VocabTop:
    """``local: [n, V/N]`` float32 logits -> the ``k`` best tokens and their log-probabilities
    over the whole vocabulary, on every rank, without gathering the logits: each rank's ``k``
    best and its log-normaliser, one all-gather of those, then the best ``k`` of the ``N * k``.
    A world of one runs ``log_softmax(local).topk(k)``. With ``k`` 1, ties go to the lowest id
    as in ``vocab_argmax``; with ``k`` > 1, equal scores across ranks in id order."""
    if tp.size == 1:
        top = torch.log_softmax(local, dim=-1).topk(k, dim=-1)
        return VocabTop(top.values, top.indices)
    n, width = local.shape
    index = local.argmax(dim=-1, keepdim=True) if k == 1 else local.topk(k, dim=-1).indices
    best = local.gather(-1, index)  # [n, k]
    normaliser = torch.logsumexp(local, dim=-1, keepdim=True)  # [n, 1]
    # float64 holds float32 values and vocabulary ids exactly: one collective for all three.
    ids = (index + tp.rank * width).double()
    packed = torch.cat((best.double(), ids, normaliser.double()), dim=-1)  # [n, 2k + 1]
    gathered = torch.stack(tp.all_gather(packed))  # [N, n, 2k + 1]
    total = torch.logsumexp(gathered[:, :, -1], dim=0).unsqueeze(-1)  # [n, 1]
    values = gathered[:, :, :k].permute(1, 0, 2).reshape(n, tp.size * k)  # rank-major
    ids = gathered[:, :, k : 2 * k].permute(1, 0, 2).reshape(n, tp.size * k)
    by_id = ids.argsort(dim=-1, stable=True)
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    chosen = values.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    logprobs = (values.gather(-1, chosen) - total).to(local.dtype)
    return VocabTop(logprobs, ids.gather(-1, chosen).long())
