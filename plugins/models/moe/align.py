"""The pairs of a batch grouped by expert on the device, for the fused MoE's grouped GEMMs
(``moe/kernels.py``): three kernels and a fill, no host synchronisation, every size from T, k,
E and the row block ``block_m`` (so they can be captured in a CUDA graph).

    sorted_pairs  [max_blocks * block_m] int32  pair t*k+j, grouped by expert in pair order,
                                                each expert's rows padded to a multiple of
                                                block_m with the sentinel T*k
    block_experts [max_blocks] int32            the expert of each row block; -1 past the
                                                used blocks (their programs exit at once)

    max_blocks = cdiv(T*k, block_m) + min(E, T*k)   (each used expert adds < 1 block of padding)

Counting: a program per chunk of pairs counts its experts. Offsets: one program turns the
counts into each expert's padded region and each chunk's first row in it, and labels the
blocks. Placing: a program per chunk writes each pair at its chunk's offset plus the number
of earlier pairs of its expert in the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from outrider.plugins.triton_launch import batch_jit, pdl_options, wait_for_previous

_ALIGN_CHUNK = 64  # pairs a counting / placing program
# Chunks or row blocks the offsets program takes at a time: it is a single program, so its
# passes over the chunks and blocks run one after another, each waiting on its loads.
_ALIGN_TILE = 64


@dataclass(frozen=True)
class AlignedPairs:
    """The pairs of one batch grouped by expert (the module docstring's table)."""

    sorted_pairs: torch.Tensor  # [max_blocks * block_m] int32
    block_experts: torch.Tensor  # [max_blocks] int32
    block_m: int
    num_pairs: int  # T * k
    topk: int

    @property
    def max_blocks(self) -> int:
        return self.block_experts.shape[0]


def max_blocks(num_pairs: int, experts: int, block_m: int) -> int:
    """The row blocks the alignment may use: a bound known on the host."""
    return triton.cdiv(num_pairs, block_m) + min(experts, num_pairs)


@batch_jit
def _count_kernel(ids_ptr, counts_ptr, num_pairs, CHUNK: tl.constexpr, E_P2: tl.constexpr,
                  PDL: tl.constexpr):  # fmt: skip
    wait_for_previous(PDL)
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    experts = tl.arange(0, E_P2)
    hits = (ids[:, None] == experts[None, :]).to(tl.int32)
    tl.store(counts_ptr + chunk * E_P2 + experts, tl.sum(hits, axis=0))


@batch_jit
def _offsets_kernel(
    counts_ptr, offsets_ptr, block_experts_ptr, num_chunks, num_blocks,
    BLOCK_M: tl.constexpr, E_P2: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    # counts, offsets: [num_chunks, E_P2]; offsets[c, e] is where chunk c's first pair of
    # expert e goes.
    experts = tl.arange(0, E_P2)
    step = tl.arange(0, TILE)
    totals = tl.zeros([E_P2], dtype=tl.int32)
    for c0 in range(0, num_chunks, TILE):
        at = (c0 + step)[:, None] * E_P2 + experts[None, :]
        totals += tl.sum(tl.load(counts_ptr + at, mask=at < num_chunks * E_P2, other=0), axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    running = ends - padded
    for c0 in range(0, num_chunks, TILE):
        at = (c0 + step)[:, None] * E_P2 + experts[None, :]
        ok = at < num_chunks * E_P2
        tile = tl.load(counts_ptr + at, mask=ok, other=0)
        tl.store(offsets_ptr + at, running[None, :] + tl.cumsum(tile, axis=0) - tile, mask=ok)
        running += tl.sum(tile, axis=0)
    used_rows = tl.sum(padded, axis=0)
    for b0 in range(0, num_blocks, TILE):
        blocks = b0 + step
        first_row = blocks * BLOCK_M
        # The regions lie in expert order: a row's expert is the number of regions ending
        # at or before it (empty regions included).
        expert = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        expert = tl.where(first_row < used_rows, expert, -1)
        tl.store(block_experts_ptr + blocks, expert, mask=blocks < num_blocks)


@batch_jit
def _place_kernel(ids_ptr, offsets_ptr, sorted_ptr, num_pairs, CHUNK: tl.constexpr,
                  E_P2: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    wait_for_previous(PDL)
    chunk = tl.program_id(0)
    slot = tl.arange(0, CHUNK)
    pairs = chunk * CHUNK + slot
    ok = pairs < num_pairs
    ids = tl.load(ids_ptr + pairs, mask=ok, other=-1)
    same_before = (ids[None, :] == ids[:, None]) & (slot[None, :] < slot[:, None])
    at = tl.load(offsets_ptr + chunk * E_P2 + ids, mask=ok, other=0)
    at += tl.sum(same_before.to(tl.int32), axis=1)
    tl.store(sorted_ptr + at, pairs, mask=ok)


def align_pairs(topk_ids: torch.Tensor, experts: int, block_m: int) -> AlignedPairs:
    """``topk_ids: [T, k]`` int32 -> its pairs grouped by expert, padded to ``block_m``."""
    ids = topk_ids.contiguous()
    num_pairs = ids.numel()
    device = ids.device
    blocks = max_blocks(num_pairs, experts, block_m)
    chunks = triton.cdiv(num_pairs, _ALIGN_CHUNK)
    e_p2 = triton.next_power_of_2(experts)
    counts = torch.empty((2, chunks, e_p2), dtype=torch.int32, device=device)  # counts, offsets
    sorted_pairs = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    block_experts = torch.empty(blocks, dtype=torch.int32, device=device)
    pdl = pdl_options(device)
    _count_kernel[(chunks,)](
        ids, counts[0], num_pairs, CHUNK=_ALIGN_CHUNK, E_P2=e_p2, num_warps=4, **pdl
    )
    _offsets_kernel[(1,)](
        counts[0], counts[1], block_experts, chunks, blocks,
        BLOCK_M=block_m, E_P2=e_p2, TILE=_ALIGN_TILE, num_warps=8, **pdl,
    )  # fmt: skip
    _place_kernel[(chunks,)](
        ids, counts[1], sorted_pairs, num_pairs, CHUNK=_ALIGN_CHUNK, E_P2=e_p2, num_warps=4, **pdl
    )
    return AlignedPairs(sorted_pairs, block_experts, block_m, num_pairs, ids.shape[1])
