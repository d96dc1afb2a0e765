"""How the project's Triton kernels launch: programmatic dependent launch (PDL), and the
batch-sized integers their compiled kernels are not specialized on (``batch_jit``).

A kernel launched with PDL may be scheduled before the kernel ahead of it in the stream has
finished: its programs start while that kernel's last wave drains, instead of after a launch
gap of about a microsecond (inside a CUDA graph as well: capture keeps the dependency). One
decode step runs some 300 kernels, most of them a few microseconds long, so the gaps add up.

The contract: every kernel that takes ``PDL`` calls ``wait_for_previous(PDL)`` before it reads
or writes any memory, which waits until the previous kernel has finished and its writes are
visible; it then lets the next kernel launch early in turn. Kernels of other libraries in the
stream are unaffected: a kernel without PDL waits as it always did.

Triton compiles a kernel once per class of each integer argument (equal to 1, a multiple of
16, or neither). For an integer that follows a batch's tokens, a class no earlier batch had
compiles while serving and stalls its batch for most of a second (a mixture-of-experts prompt
batch of 1,552 tokens after batches of 2,048: BENCHMARKS.md). ``batch_jit`` leaves the
arguments named in ``BATCH_COUNTS`` alone: they only bound masks and loops, where the class
buys nothing. Every other integer argument of these kernels is fixed per model and rank.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
import triton
import triton.language as tl

from outrider.plugins.debug import debug_knob

# PDL needs compute capability 9.0 (Hopper) or later.
_PDL_MIN_MAJOR = 9
# Kernel arguments that count a batch's tokens or what follows from them: its tokens, its
# (token, expert) pairs, and their chunks and row blocks.
BATCH_COUNTS = ("num_tokens", "num_pairs", "num_chunks", "num_blocks")


def batch_jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit`` of ``fn``, not specialized on those of its arguments ``BATCH_COUNTS``
    names."""
    names = inspect.signature(fn).parameters
    return triton.jit(fn, do_not_specialize=[name for name in BATCH_COUNTS if name in names])


@cache
def _pdl_device(index: int) -> bool:
    if debug_knob("OUTRIDER_DEBUG_NO_PDL"):
        return False
    return torch.cuda.get_device_capability(index)[0] >= _PDL_MIN_MAJOR


def pdl_options(device: torch.device) -> dict[str, bool]:
    """Launch keywords for a kernel taking the ``PDL`` constexpr, run on ``device``: PDL on a
    GPU that has it (unless ``OUTRIDER_DEBUG_NO_PDL`` is set, read once a device); off
    elsewhere (older GPUs, Triton's interpreter on CPU tensors)."""
    if device.type != "cuda":
        return {"PDL": False}
    if not _pdl_device(torch.cuda.current_device() if device.index is None else device.index):
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """A PDL kernel's first step: wait for the kernel before it, then let the next launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
