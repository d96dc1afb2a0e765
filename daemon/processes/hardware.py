"""This machine as ``--device auto`` sees it: CUDA when torch sees a device, else the CPU.

Light: torch is imported only to answer ``auto`` (and not at all without torch, a light
install, which runs on the CPU), so resolving the flags costs nothing when ``--device`` is
given.
"""

from __future__ import annotations

import importlib.util

from outrider.daemon.config import Device

AUTO_DEVICE = "auto"


def cuda_available() -> bool:
    """Whether torch sees a CUDA device; False without torch."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def resolve_device(flag: str) -> Device:
    """The device ``--device flag`` runs on: ``auto`` is ``cuda`` when torch sees a CUDA
    device, else ``cpu``."""
    if flag == AUTO_DEVICE:
        return "cuda" if cuda_available() else "cpu"
    assert flag in ("cpu", "cuda"), "flags.resolve checks the choices first"
    return "cuda" if flag == "cuda" else "cpu"


def cuda_capability() -> tuple[int, int] | None:
    """The compute capability of the current CUDA device; None without one (or without
    torch)."""
    if not cuda_available():
        return None
    import torch

    major, minor = torch.cuda.get_device_capability()
    return (major, minor)
