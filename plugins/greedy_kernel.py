"""The greedy token and its log-softmax over a vocabulary in two Triton kernels, for
graph-captured batches (``sampling.sample`` of all-greedy rows without top logprobs while
``in_graph_build``). torch runs ``argmax`` and ``logsumexp`` as three reductions of one block
a row over the whole vocabulary: on an H100 about 54 µs a step at 128,256 ids and 35 µs at
151,936, where these kernels spread each row over many programs and read it once (together
under 4 µs a step at 151,936 ids, BENCHMARKS.md).

Pass 1 gives each (row, chunk) its maximum, the first id reaching it and the sum of
``exp(logit - maximum)``; pass 2 combines a row's chunks. The token is exactly torch's (the
lowest id among equal maxima); the log-softmax differs from torch's in float32 summation order
only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from outrider.plugins.triton_launch import pdl_options, wait_for_previous

_CHUNK = 2048


@triton.jit
def _finite(best):
    """The shift of a sum of exponentials: 0 where every term is -inf (masked logits), so that
    they add exp(-inf) = 0 rather than exp(nan)."""
    return tl.where(best == float("-inf"), 0.0, best)


@triton.jit
def _chunk_kernel(
    logits_ptr, max_ptr, arg_ptr, sum_ptr, vocab, stride_row, chunks,
    CHUNK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    ids = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * stride_row + ids, mask=ids < vocab, other=float("-inf"))
    best = tl.max(x, axis=0)
    # First maximum of the chunk: ties go to the lowest id, as torch.argmax's do.
    at = tl.argmax(x, axis=0, tie_break_left=True)
    total = tl.sum(tl.exp(x - _finite(best)), axis=0)
    out = row * chunks + chunk
    tl.store(max_ptr + out, best)
    tl.store(arg_ptr + out, chunk * CHUNK + at)
    tl.store(sum_ptr + out, total)


@triton.jit
def _combine_kernel(
    logits_ptr, max_ptr, arg_ptr, sum_ptr, token_ptr, logprob_ptr, stride_row, chunks,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    row = tl.program_id(0)
    at = tl.arange(0, BLOCK)
    ok = at < chunks
    maxima = tl.load(max_ptr + row * chunks + at, mask=ok, other=float("-inf"))
    best = tl.max(maxima, axis=0)
    # The chunks are in id order: the first chunk reaching the maximum holds the lowest id.
    winner = tl.argmax(maxima, axis=0, tie_break_left=True)
    token = tl.load(arg_ptr + row * chunks + winner)
    sums = tl.load(sum_ptr + row * chunks + at, mask=ok, other=0.0)
    log_norm = best + tl.log(tl.sum(sums * tl.exp(maxima - _finite(best)), axis=0))
    chosen = tl.load(logits_ptr + row * stride_row + token)
    tl.store(token_ptr + row, token)
    tl.store(logprob_ptr + row, chosen - log_norm)


def greedy_fits(logits: torch.Tensor) -> bool:
    """Whether ``greedy_logprob`` reads ``logits``: float32 ``[n, V]`` rows contiguous along V,
    on a GPU."""
    return (
        logits.is_cuda
        and logits.dim() == 2
        and logits.dtype == torch.float32
        and logits.stride(1) == 1
    )


def greedy_logprob(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits: [n, V]`` (``greedy_fits``, or a CPU tensor under Triton's interpreter) ->
    (``[n]`` int64 argmax ids, ``[n]`` float32 log-softmax at them)."""
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, _CHUNK)
    parts = torch.empty((2, rows, chunks), dtype=torch.float32, device=logits.device)
    args = torch.empty((rows, chunks), dtype=torch.int64, device=logits.device)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprob = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        pdl = pdl_options(logits.device)
        _chunk_kernel[(rows, chunks)](
            logits, parts[0], args, parts[1], vocab, logits.stride(0), chunks,
            CHUNK=_CHUNK, num_warps=4, **pdl,
        )  # fmt: skip
        _combine_kernel[(rows,)](
            logits, parts[0], args, parts[1], tokens, logprob, logits.stride(0), chunks,
            BLOCK=triton.next_power_of_2(chunks), num_warps=1, **pdl,
        )  # fmt: skip
    return tokens, logprob
