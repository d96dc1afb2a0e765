"""Debug knobs: the only ``OUTRIDER_*`` variables read outside the serve flags (which
daemon/flags.py reads), in one typed table. Here, below the daemon, so that the public
building blocks (the layer kernels, the Triton launches) read them without importing it."""

from __future__ import annotations

import os
from collections.abc import Mapping

DEBUG_KNOBS: dict[str, str] = {
    "OUTRIDER_DEBUG_KV_CHECK": "run the KV integrity check after every step (tests)",
    "OUTRIDER_DEBUG_RETRACT_EVERY": "retract the youngest running request every N scheduler plans",
    "OUTRIDER_DEBUG_SYNC_CHECK": "raise on any host synchronisation inside a step (CUDA)",
    "OUTRIDER_DEBUG_TORCH_KERNELS": (
        "run norms, rotary and activations as plain torch ops where FlashInfer's fused "
        "kernels would serve, and sampled rows' race as torch ops where its Triton kernels "
        "would (to compare them)"
    ),
    "OUTRIDER_DEBUG_NO_PDL": (
        "launch the Triton kernels without programmatic dependent launch (to compare)"
    ),
    "OUTRIDER_DEBUG_NO_PEER_NORM": (
        "sum a tensor-parallel block's output with the one-shot all-reduce, then add and "
        "normalise, where the kernel that does all three would serve (to compare)"
    ),
    "OUTRIDER_DEBUG_RELAY_CHECK": (
        "poison released relay rows; assert decode batches read none (syncs)"
    ),
}


def debug_knob(name: str, environ: Mapping[str, str] | None = None) -> int:
    assert name in DEBUG_KNOBS, name
    raw = (os.environ if environ is None else environ).get(name, "0")
    return int(raw) if raw.strip() else 0
