"""Base class of attention backend implementations (loaded in the daemon only).

A backend turns a ``BatchLayout`` into its own metadata (``build``), once per forward, and
attends one layer at a time with that metadata (``forward``). Metadata belongs to the batch
(``ForwardBatch.metadata``), never to the backend instance, so one instance serves several
phases and models side by side.

CUDA graphs (declared by the spec's ``AttentionCapabilities.cuda_graphs``; the graph runner
calls these only then):

```
init_graph_buffers(bounds)        once: buffers for the largest captured batch
capture_metadata(layout) -> meta  per captured batch size: metadata viewing those buffers
replay_metadata(layout, meta)     before each replay: rewrite those buffers in place
plan_replay(host, bounds)         before a decode graph's capture and each of its replays,
                                  with the rows' exact lengths when the host knows them
```
A replay only writes into buffers allocated by ``init_graph_buffers``: every tensor of the
captured metadata keeps its address (``data_ptr()``) for the life of the backend. The runner
captures the whole decode step, ``build`` included: a backend whose metadata is device work
needs no hook, one that schedules on the host plans in ``plan_replay`` (outside the graph), and
``build`` under capture (``torch.cuda.is_current_stream_capturing()``) then only writes the
device side of that plan into fixed buffers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from outrider.plugins.device import AttentionShape, BatchLayout, ForwardBatch, HostLengths


@dataclass(frozen=True)
class GraphBounds:
    """The largest batch a backend's graph buffers must hold."""

    max_bs: int  # rows
    max_q: int  # query tokens per row
    max_kv: int  # KV positions per row: every captured layout is built with this bound
    page_size: int = 1


class AttentionBackend(ABC):
    """Paged attention for models of one ``AttentionShape``. Neither method may synchronise
    with the host (no ``.item()``, ``.tolist()``, ``.cpu()``, no data-dependent shapes): sizes
    come from the layout's host-known bounds and validity from its device tensors."""

    def __init__(self, shape: AttentionShape, options: Any, device: torch.device) -> None:
        self.shape = shape
        self.options = options
        self.device = device

    @abstractmethod
    def build(self, layout: BatchLayout) -> object:
        """This backend's metadata for ``layout`` (called once per forward, before layer 0)."""

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        """Store ``k, v: [T, kv_heads, head_dim]`` at ``fb.layout.out_loc`` into layer
        ``layer`` of ``fb.kv`` (``KVCache.store``), then attend ``q: [T, q_heads, head_dim]``
        over each row's KV with ``fb.metadata``. Returns ``[T, q_heads, head_dim]``."""

    def init_graph_buffers(self, bounds: GraphBounds) -> None:
        """Allocate the metadata buffers of every captured batch (once)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in a CUDA graph")

    def capture_metadata(self, layout: BatchLayout) -> object:
        """Metadata for ``layout`` (``layout.max_kv`` is the bounds' ``max_kv``) whose tensors
        view the graph buffers, filled for ``layout``."""
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in a CUDA graph")

    def replay_metadata(self, layout: BatchLayout, metadata: object) -> None:
        """Rewrite ``metadata`` (from ``capture_metadata`` for the same batch size) in place
        for ``layout``."""
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in a CUDA graph")

    def plan_replay(self, host: HostLengths, bounds: GraphBounds) -> None:
        """Before a decode graph of ``len(host.seq_lens)`` rows is captured and before each
        of its replays: the rows' exact lengths (padding rows included) and the bounds of the
        captured layouts. Backends that schedule on the host plan here; nothing by default."""
        return None
