"""Whether the current run builds a CUDA graph (its warm-up or its capture): kernels whose
launch costs more host time than a library kernel's serve those runs only."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_GRAPH_BUILD: ContextVar[bool] = ContextVar("outrider_graph_build", default=False)


@contextmanager
def building_graph() -> Iterator[None]:
    """Marks the runs inside as a CUDA graph's warm-up and capture. Kernels whose launch costs
    more host time than a library kernel's (Triton's, about 20 µs) may serve these runs only:
    a replay launches nothing again. The warm-up is inside too, so that such kernels compile
    and load before the capture."""
    token = _GRAPH_BUILD.set(True)
    try:
        yield
    finally:
        _GRAPH_BUILD.reset(token)


def in_graph_build() -> bool:
    """Whether the current run is a CUDA graph's warm-up or capture (``building_graph``)."""
    return _GRAPH_BUILD.get()
