"""The sync check (debug, CUDA: ``OUTRIDER_DEBUG_SYNC_CHECK``): a launched step raises on any
host synchronisation inside it (``sync_checked``), but for the waits made on purpose
(``syncs_allowed``): a graph's capture, and the host's grammar-mask fills inside a step,
which wait for the step before's results and for the paths and drafts copied to the host
(host_masks.py).

Only a check that is on is lifted: setting torch's sync debug mode at all warns that it is a
prototype."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def sync_checked(on: bool) -> Iterator[None]:
    """Any host synchronisation inside raises, where ``on`` (CUDA only)."""
    if not on:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@contextmanager
def syncs_allowed(device: torch.device) -> Iterator[None]:
    """The sync check off inside, where it is on."""
    mode = torch.cuda.get_sync_debug_mode() if device.type == "cuda" else 0
    if not mode:
        yield
        return
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)
