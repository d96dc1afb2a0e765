"""The exponential race of ``sampling.py`` in two Triton kernels, on a GPU: the winner of each
row's ``values - log(-log U)`` where ``U`` is the counter-based uniform of the token id (a row
is in id order: a place is its token id).

torch computes the race as about twenty-five elementwise passes over a row's whole vocabulary
(the id hash in int64, two logarithms, the subtraction, the argmax), each reading and writing
the row. These kernels read each row's values once: pass 1 gives each (row, chunk) its best
score and the first id reaching it, pass 2 combines a row's chunks.

Exactness: the same operations as ``sampling._uniform_at`` and ``sampling._race`` on the same
float32 values. The hash is integer arithmetic below 2^63 (exact everywhere); ``U`` is an odd
multiple of 2^-24 (exact); the logarithms are libdevice's ``log``, the function torch's CUDA
``log`` compiles to, not an approximation (Triton's interpreter, which runs the CPU tests,
has only numpy's); ties go to the first place (the lowest id), as ``torch.argmax``'s do. So
a row's winner is torch's (``test_the_race_kernel_is_torch_race`` checks it on a GPU). Every
path of a GPU engine races here (eager and graphed, plain and speculative steps, sampled
drafts), so their tokens agree with each other whether or not it is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from outrider.plugins.triton_launch import pdl_options, wait_for_previous

_CHUNK = 1024


@triton.jit
def _mix32(x, MUL_1: tl.constexpr, MUL_2: tl.constexpr):
    """``sampling._mix32`` on int64 words below 2^32."""
    # The mask built in int64: a literal 0xFFFFFFFF may be typed as a 32-bit word.
    mask = (tl.full((), 1, tl.int64) << 32) - 1
    x = x ^ (x >> 16)
    x = (x * MUL_1) & mask
    x = x ^ (x >> 15)
    x = (x * MUL_2) & mask
    return x ^ (x >> 15)


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    """libdevice's ``log`` (torch's on a GPU); Triton's interpreter has only its own."""
    if LIBDEVICE:
        return libdevice.log(x)
    return tl.log(x)


@triton.jit
def _chunk_kernel(
    values_ptr, keys_ptr, best_ptr, at_ptr, vocab, stride_values, chunks, u_scale,
    CHUNK: tl.constexpr, MUL_1: tl.constexpr, MUL_2: tl.constexpr, LIBDEVICE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    place = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = place < vocab
    v = tl.load(values_ptr + row * stride_values + place, mask=inside, other=float("-inf"))
    ids = place.to(tl.int64)
    key_a = tl.load(keys_ptr + row * 2)
    key_b = tl.load(keys_ptr + row * 2 + 1)
    h = _mix32(_mix32(ids ^ key_a, MUL_1, MUL_2) ^ key_b, MUL_1, MUL_2)
    u = ((h >> 9).to(tl.float32) + 0.5) * u_scale
    score = v - _log(-_log(u, LIBDEVICE), LIBDEVICE)
    score = tl.where(inside, score, float("-inf"))
    best = tl.max(score, axis=0)
    at = tl.argmax(score, axis=0, tie_break_left=True)
    out = row * chunks + chunk
    tl.store(best_ptr + out, best)
    tl.store(at_ptr + out, chunk * CHUNK + at)


@triton.jit
def _combine_kernel(
    best_ptr, at_ptr, winner_ptr, chunks, BLOCK: tl.constexpr, PDL: tl.constexpr
):  # fmt: skip
    wait_for_previous(PDL)
    row = tl.program_id(0)
    index = tl.arange(0, BLOCK)
    bests = tl.load(best_ptr + row * chunks + index, mask=index < chunks, other=float("-inf"))
    # The chunks are in place order: the first chunk reaching the best holds the first place.
    first = tl.argmax(bests, axis=0, tie_break_left=True)
    tl.store(winner_ptr + row, tl.load(at_ptr + row * chunks + first))


def race_fits(values: torch.Tensor) -> bool:
    """Whether ``race_winners`` reads these: float32 ``[n, V]`` values contiguous along V, on
    a GPU."""
    fits = values.is_cuda and values.dim() == 2 and values.dtype == torch.float32
    return fits and values.stride(1) == 1


def race_winners(values: torch.Tensor, keys: torch.Tensor, mixers: tuple[int, int]) -> torch.Tensor:
    """Each row's winning token id ``[n, 1]`` (int64) of ``values [n, V] - log(-log U)``,
    ``U`` the uniform of each id under the row's two-lane key (``keys [n, 2]`` int64);
    ``mixers``: ``sampling._mix32``'s multipliers. ``race_fits``, or CPU tensors under
    Triton's interpreter."""
    rows, vocab = values.shape
    chunks = triton.cdiv(vocab, _CHUNK)
    best = torch.empty((rows, chunks), dtype=torch.float32, device=values.device)
    at = torch.empty((rows, chunks), dtype=torch.int64, device=values.device)
    winners = torch.empty((rows, 1), dtype=torch.int64, device=values.device)
    if rows:
        keys = keys.contiguous()
        pdl = pdl_options(values.device)
        _chunk_kernel[(rows, chunks)](
            values, keys, best, at, vocab, values.stride(0), chunks, 2.0**-23,
            CHUNK=_CHUNK, MUL_1=mixers[0], MUL_2=mixers[1], LIBDEVICE=values.is_cuda,
            num_warps=4, **pdl,
        )  # fmt: skip
        _combine_kernel[(rows,)](
            best, at, winners, chunks, BLOCK=triton.next_power_of_2(chunks), num_warps=1, **pdl
        )
    return winners
