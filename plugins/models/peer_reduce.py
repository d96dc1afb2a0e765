"""The small all-reduce of one host's GPUs: one kernel over peer memory instead of NCCL.

A tensor-parallel decode step sums each layer's partial outputs twice, a few KiB to a few
hundred KiB a call. Through NCCL's general path such a call costs about 20 us inside a CUDA
graph (BENCHMARKS.md, "Tensor parallelism"), which at 64 calls a step is most of what a second
GPU saves. Here each rank keeps one buffer in torch's symmetric memory (its CUDA backend: the
peers' buffers mapped through CUDA IPC, no NVLink multicast), and a call is one kernel of
torch's (``symm_mem.one_shot_all_reduce_copy_out``): copy this rank's part into its buffer,
meet the peers at a signal, read every peer's buffer and sum, meet again.

Invariants:

- Every rank takes the same path for the same call: the choice (``PeerAllReduce.takes``)
  reads the message's byte size, layout and alignment, which the ranks share (they run the
  same shapes, and the caching allocator starts every block 512-byte aligned, so an
  address's alignment is its offset's), and the buffer exists on every rank or on none
  (``join_peer_all_reduce`` agrees on it).
- Every rank sums the parts in rank order, so every rank gets the same bits, as with NCCL:
  the ranks' samplers then agree without exchanging tokens.
- The buffer is allocated and exchanged once, when the ranks join, before any graph is
  captured; graphs replay the same buffer and signal pads.
- One host only: with ``--nnodes`` > 1 every call goes through NCCL.

Messages above ``one_shot_max_bytes`` (prompt chunks) go through NCCL, whose
bandwidth-optimal algorithms win there.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from outrider.plugins.models.peer_norm import PeerSumNorm

log = logging.getLogger("outrider.models")

# The largest message summed over peer memory, by the ranks: every rank reads every peer's
# whole message, so the one-shot kernel's traffic grows with the ranks. On two H200s it beats
# NCCL at every size to 4 MiB, by 1.5x at 2 MiB (a decode step of 256 rows at hidden 4,096;
# BENCHMARKS.md, "One-shot all-reduce over peer memory"); more ranks are not measured yet.
ONE_SHOT_MAX_BYTES = {2: 2 * 2**20}
ONE_SHOT_UNMEASURED_BYTES = 512 * 2**10


def one_shot_max_bytes(world: int) -> int:
    """The largest message ``world`` ranks sum over peer memory."""
    return ONE_SHOT_MAX_BYTES.get(world, ONE_SHOT_UNMEASURED_BYTES)


DISABLE_FLAG = "--disable-peer-all-reduce"
# The kernel's vector width: messages and buffer offsets are multiples of it.
_ALIGN_BYTES = 16


class PeerAllReduce:
    """This rank's symmetric buffer and the one-shot sum over it; ``norm``: the sum fused
    with the residual add and RMSNorm after it (peer_norm.py), over a buffer of its own."""

    def __init__(
        self, buffer: torch.Tensor, group_name: str, norm: PeerSumNorm | None = None
    ) -> None:
        self._buffer = buffer  # uint8, rendezvoused with the group: its size is the limit
        self._group_name = group_name
        self.norm = norm

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is summed here: small, contiguous, aligned, on this GPU."""
        size = x.numel() * x.element_size()
        return (
            0 < size <= self._buffer.numel()
            and size % _ALIGN_BYTES == 0
            and x.is_contiguous()
            and x.data_ptr() % _ALIGN_BYTES == 0
            and x.device == self._buffer.device
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks, in place (``takes(x)`` must hold)."""
        flat = x.view(-1)
        staged = self._buffer.view(x.dtype)[: flat.numel()]
        # In place is safe: the kernel reads each element of its input before the first
        # signal and writes the same element of its output, by the same thread, after it.
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(
            staged, flat, "sum", self._group_name, out=flat
        )
        return x


def join_peer_all_reduce(
    group: ProcessGroup, device: torch.device, devices: range, max_bytes: int | None = None
) -> PeerAllReduce | None:
    """Every rank's buffer of ``max_bytes`` (None: ``one_shot_max_bytes`` of the group's
    ranks), and the fused sum's (``PeerSumNorm``, as many bytes a rank's slot), allocated and
    exchanged, a collective over
    ``group`` (NCCL, the ranks on ``devices`` of one host); None on every rank when some GPU
    of them cannot reach another's memory (the calls then go through NCCL). Raises
    RuntimeError naming ``DISABLE_FLAG`` when the buffers cannot be mapped or do not sum."""
    import torch.distributed as dist

    peers = [d for d in devices if d != device.index]
    reachable = all(torch.cuda.can_device_access_peer(device, d) for d in peers)
    if not _all_ranks(reachable, group, device):
        log.warning("GPUs without peer access: all-reduces go through NCCL")
        return None
    from torch.distributed import _symmetric_memory as symm_mem

    from outrider.plugins.models.peer_norm import PeerSumNorm

    world = dist.get_world_size(group)
    if max_bytes is None:
        max_bytes = one_shot_max_bytes(world)
    try:
        buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(buffer, group.group_name)
        norm_bytes = PeerSumNorm.buffer_bytes(max_bytes, world)
        norm_buffer = symm_mem.empty(norm_bytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(norm_buffer, group.group_name)
    except RuntimeError as e:
        raise RuntimeError(
            f"mapping the peers' all-reduce buffers failed ({DISABLE_FLAG}: NCCL only): {e}"
        ) from e
    norm_buffer.zero_()  # the flag words: zero on every rank before any peer sets one
    _all_ranks(True, group, device)  # after this rank's zeroing, in stream order
    bases = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
    peer = PeerAllReduce(buffer, group.group_name, PeerSumNorm(norm_buffer, bases, group.rank()))
    probe = torch.ones(_ALIGN_BYTES // 4, dtype=torch.float32, device=device)
    peer(probe)
    if not torch.equal(probe, torch.full_like(probe, world)):
        raise RuntimeError(
            f"the peer all-reduce summed ones over the ranks to {probe.tolist()} "
            f"({DISABLE_FLAG}: NCCL only)"
        )
    return peer


def _all_ranks(holds: bool, group: ProcessGroup, device: torch.device) -> bool:
    import torch.distributed as dist

    flag = torch.tensor([int(holds)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
