"""One CUDA graph capture in the graphs' shared memory pool (engine/graphs.py decides what is
captured and when; this room runs a capture).

- Every graph lives in one pool, made at the first capture, so that a smaller capture reuses
  the blocks a larger one freed; the start-up memory plan (engine/memory_plan.py) sizes it.
- Every capture's warm-up run goes on one stream: cuBLAS keeps a workspace for each stream it
  ran on, for good (outside the pool), and torch hands out up to 32 different streams to
  ``torch.cuda.Stream()`` calls.
- A step that waits for the host (``MaskHoles``, engine/token_masks.py) is captured as
  segments, cut at each wait: a replay runs each segment, then the host's fill recorded there,
  then the next. A tensor a later segment reads from an earlier one lives in the shared pool,
  which is safe because nothing else replays between the segments of one step.
- Python's cyclic garbage collector is held off while capturing: a collection inside a capture
  may free an older engine's graphs, and destroying a graph while a stream captures (in the
  default, process-wide capture mode) invalidates that capture.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, TypeVar

import torch

from outrider.daemon.engine.sync_check import syncs_allowed
from outrider.daemon.engine.token_masks import MaskHoles
from outrider.plugins.device import building_graph

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

_Out = TypeVar("_Out")  # what a captured run returns
# A graph before a host wait, and the host's fill to run after it.
Segment = tuple[torch.cuda.CUDAGraph, Callable[[], None]]

# (graphs captured so far, graphs of the set): a progress bar's update.
CaptureProgress = Callable[[int, int], None]


class GraphPool:
    """The memory pool and warm-up stream every graph of an engine is captured with."""

    def __init__(self) -> None:
        self.handle: _POOL_HANDLE | None = None  # made at the first capture
        self.warm_stream: torch.cuda.Stream | None = None

    def capture(
        self, run: Callable[[], _Out], holes: MaskHoles | None = None
    ) -> tuple[torch.cuda.CUDAGraph, _Out, list[Segment]]:
        """``run``'s graph in the pool, after a warm-up run on the warm-up stream, what the
        captured run returned (its static outputs), and the segments before the graph where
        ``run`` waited at one of ``holes``."""
        # NOTE: capture synchronises; a launch under the sync check must not raise for it.
        with syncs_allowed(torch.device("cuda")), _collector_paused():
            # NOTE: a capture stages one extra step, so the next staging reuses the host set of
            # the step still in flight out of turn: let every copy in flight finish first.
            torch.cuda.synchronize()
            if self.handle is None:
                self.handle = torch.cuda.graph_pool_handle()
            if self.warm_stream is None:
                self.warm_stream = torch.cuda.Stream()
            side = self.warm_stream
            side.wait_stream(torch.cuda.current_stream())
            with building_graph():
                with torch.cuda.stream(side):
                    run()  # warm-up: lazy initialisations happen outside the graph
                torch.cuda.current_stream().wait_stream(side)
                capture = _SegmentedCapture(self.handle)
                with capture, holes.cutting(capture.cut) if holes else nullcontext():
                    outputs = run()
            torch.cuda.synchronize()
        return capture.graph, outputs, capture.segments


class _SegmentedCapture:
    """One capture in a pool, cut into segments where the step waits for the host."""

    def __init__(self, pool: _POOL_HANDLE) -> None:
        self.pool = pool
        self.segments: list[Segment] = []
        self.graph = torch.cuda.CUDAGraph()
        self._context = torch.cuda.graph(self.graph, pool=pool)

    def __enter__(self) -> None:
        self._context.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._context.__exit__(*exc)

    def cut(self, fill: Callable[[], None]) -> None:
        """End the graph being captured (a segment, ``fill`` after it) and begin the next."""
        self._context.__exit__(None, None, None)
        self.segments.append((self.graph, fill))
        self.graph = torch.cuda.CUDAGraph()
        self._context = torch.cuda.graph(self.graph, pool=self.pool)
        self._context.__enter__()


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off (module docstring)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture_progress() -> CaptureProgress | None:
    """A tqdm bar when stderr is a TTY, else None (``DecodeGraphs.capture_all`` logs the
    set)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    bar = tqdm(desc="Capturing CUDA graphs", unit="graph", total=None)

    def update_bar(done: int, total: int) -> None:
        bar.total = total
        bar.update(1)
        if done == total:
            bar.close()

    return update_bar


def reserved_after_release() -> int:
    """Device memory the caching allocator holds once its unused cached blocks are released
    (0 without CUDA): what graph pools and live tensors keep."""
    if not torch.cuda.is_initialized():
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()
