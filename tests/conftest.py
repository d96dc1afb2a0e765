"""Shared test setup: one torch thread per process, GPU tests skipped without a GPU."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    torch.set_num_threads(1)
    return torch.cuda.is_available()


CUDA = _cuda_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not CUDA:
            item.add_marker(skip)
