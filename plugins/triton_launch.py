"""Programmatic dependent launch (PDL) for the project's Triton kernels.

A kernel launched with PDL may be scheduled before the kernel ahead of it in the stream has
finished: its programs start while that kernel's last wave drains, instead of after a launch
gap of about a microsecond (inside a CUDA graph as well: capture keeps the dependency). One
decode step runs some 300 kernels, most of them a few microseconds long, so the gaps add up.

The contract: every kernel that takes ``PDL`` calls ``wait_for_previous(PDL)`` before it reads
or writes any memory, which waits until the previous kernel has finished and its writes are
visible; it then lets the next kernel launch early in turn. Kernels of other libraries in the
stream are unaffected: a kernel without PDL waits as it always did.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from outrider.plugins.debug import debug_knob

# PDL needs compute capability 9.0 (Hopper) or later.
_PDL_MIN_MAJOR = 9


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
