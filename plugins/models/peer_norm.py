"""The sum over one host's GPUs fused with the residual add and RMSNorm that follow it.

Under tensor parallelism a decoder layer's attention and MLP blocks end in a row-parallel
projection whose output is each rank's part of a sum; the next thing the model does with the
sum is ``RMSNorm.add`` (residual add, then the norm). Summed through the one-shot all-reduce
(peer_reduce.py) and then normalised, that is two kernels and two barriers a block; here it is
one kernel with one exchange: each program (one row) writes the rank's part into every
rank's buffer, tells every peer, waits until every peer told it, then reads the ranks' parts
from its own buffer in rank order, adds the residual and normalises (BENCHMARKS.md, "The sum
over two GPUs, the residual add and the norm in one kernel").

Invariants:

- Every rank makes the same calls with the same row counts, in the same order (the ranks run
  the same batches), and takes the same path (``takes`` reads shapes and dtypes only).
- A row's call number is counted on the device, per row (``_calls[row]``, touched by that
  row's program only), so replays of captured graphs count too. Call ``n`` of row ``r`` writes
  the rank's slot of parity ``n % 2`` in every rank's buffer and sets its flag word in every
  peer to ``n``. Reuse is safe without a second barrier: a rank reaches call ``n + 2`` only
  after its call ``n + 1`` saw every peer's flag reach ``n + 1``, which a peer sets after its
  call ``n`` (and its reads of parity ``n % 2``) finished, the calls being stream-ordered
  kernels.
- A flag may run one call ahead of its reader (a peer's call ``n + 1`` starts once it saw
  ours of ``n``), so a wait is for ``>= n``, never ``== n``; counts are int64 (no wrap).
- The parts are summed in rank order, in float32 and rounded once to the model's dtype (as
  the one-shot all-reduce sums), then added to the residual in float32: every rank gets the
  same bits.
- A wait that sees nothing for ``_WAIT_LIMIT_NS`` traps (a CUDA error in the rank, which its
  supervisor reports), as a peer that never arrives means the ranks' calls went out of step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The most rows one call sums: the flag words and call counts are sized for it.
MAX_ROWS = 512
# A wait longer than this is a fault, not a slow peer: NCCL's default collective timeout.
# A peer may legitimately lag for minutes while it builds a JIT kernel (FlashInfer's, in a
# graph's warm-up between two of these calls), so nothing much shorter will do.
_WAIT_LIMIT_NS = 10 * 60 * 10**9
_WARPS = 8


@triton.jit
def _now_ns():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _trap():
    tl.inline_asm_elementwise(
        "trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _base(bases_ptr, rank, dtype: tl.constexpr):
    # A symmetric buffer starts 16-byte aligned at least: vector loads and stores.
    return tl.multiple_of(tl.load(bases_ptr + rank).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _sum_add_rms_norm(
    bases_ptr, calls_ptr, x_ptr, res_ptr, w_ptr, eps,
    RANK: tl.constexpr, WORLD: tl.constexpr, H: tl.constexpr, BLOCK: tl.constexpr,
    PARITY_ELEMS: tl.constexpr, FLAGS_AT: tl.constexpr, WAIT_NS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < H
    call = tl.load(calls_ptr + row) + 1
    tl.store(calls_ptr + row, call)
    # Slot ``src`` of this call's parity holds rank ``src``'s part: each rank writes its own
    # into every rank's buffer (posted writes), so that the reads below are all local.
    slots = (call % 2) * WORLD * PARITY_ELEMS + row * H
    part = tl.load(x_ptr + row * H + cols, mask=inside)
    for dest in tl.static_range(WORLD):
        theirs = _base(bases_ptr, dest, x_ptr.dtype.element_ty)
        tl.store(theirs + slots + RANK * PARITY_ELEMS + cols, part, mask=inside)
    tl.debug_barrier()  # every thread's store done before the flag says so
    flag = FLAGS_AT + row * WORLD
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            theirs = tl.load(bases_ptr + peer).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(theirs + flag + RANK, call, sem="release", scope="sys")
    my_flags = tl.load(bases_ptr + RANK).to(tl.pointer_type(tl.int64)) + flag
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            start = _now_ns()
            seen = tl.atomic_add(my_flags + peer, 0, sem="acquire", scope="sys")
            while seen < call:
                if _now_ns() - start > WAIT_NS:
                    _trap()
                seen = tl.atomic_add(my_flags + peer, 0, sem="acquire", scope="sys")
    tl.debug_barrier()  # the acquire seen before any thread reads a peer's part
    mine = _base(bases_ptr, RANK, x_ptr.dtype.element_ty)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for src in tl.static_range(WORLD):
        at = mine + slots + src * PARITY_ELEMS + cols
        total += tl.load(at, mask=inside, other=0.0, cache_modifier=".cv").to(tl.float32)
    summed = total.to(x_ptr.dtype.element_ty).to(tl.float32)
    summed += tl.load(res_ptr + row * H + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(res_ptr + row * H + cols, summed.to(res_ptr.dtype.element_ty), mask=inside)
    scale = tl.rsqrt(tl.sum(summed * summed, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(x_ptr + row * H + cols, (summed * scale * w).to(x_ptr.dtype.element_ty), mask=inside)


class PeerSumNorm:
    """This rank's symmetric buffer for the fused sum, add and norm: two parities of a slot of
    ``parity_bytes`` a rank each, then ``MAX_ROWS x world`` int64 flag words (zero at the
    start on every rank), and the rank's own call counts."""

    def __init__(self, buffer: torch.Tensor, bases: torch.Tensor, rank: int) -> None:
        self._buffer = buffer  # uint8, rendezvoused with the group
        self._bases = bases  # [world] int64: every rank's buffer address, in rank order
        self._rank = rank
        self._world = bases.numel()
        self.parity_bytes = (buffer.numel() - MAX_ROWS * self._world * 8) // (2 * self._world)
        self._calls = torch.zeros(MAX_ROWS, dtype=torch.int64, device=buffer.device)

    @staticmethod
    def buffer_bytes(parity_bytes: int, world: int) -> int:
        """The symmetric buffer a rank allocates for ``parity_bytes`` of rows a call."""
        return 2 * world * parity_bytes + MAX_ROWS * world * 8

    def takes(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether ``x`` (the rank's part) and ``residual``, ``[rows, H]`` each, are summed and
        normalised here: as many rows as the flags and a parity hold, contiguous, alike."""
        rows = x.shape[0]
        return (
            x.dim() == 2
            and 0 < rows <= MAX_ROWS
            and x.numel() * x.element_size() <= self.parity_bytes
            and x.shape == residual.shape
            and x.dtype == residual.dtype
            and x.is_contiguous()
            and residual.is_contiguous()
            and x.device == self._buffer.device
        )

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + S), residual + S)``, ``S`` the sum of ``x`` over the ranks, in
        place of ``x`` and ``residual`` (``takes`` must hold)."""
        rows, hidden = x.shape
        elem = x.element_size()
        _sum_add_rms_norm[(rows,)](
            self._bases, self._calls, x, residual, weight, eps,
            RANK=self._rank, WORLD=self._world, H=hidden, BLOCK=triton.next_power_of_2(hidden),
            PARITY_ELEMS=self.parity_bytes // elem,
            FLAGS_AT=2 * self._world * self.parity_bytes // 8,
            WAIT_NS=_WAIT_LIMIT_NS, num_warps=_WARPS,
        )  # fmt: skip
        return x, residual
