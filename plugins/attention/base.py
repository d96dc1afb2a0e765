"""Base class of attention backend implementations (loaded in the daemon only).

A backend turns a ``BatchLayout`` into its own metadata (``build``), once per forward, and
attends one layer at a time with that metadata (``forward``). Metadata belongs to the batch
(``ForwardBatch.metadata``), never to the backend instance, so one instance serves several
phases and models side by side.

CUDA graphs (declared by the spec's ``AttentionCapabilities.cuda_graphs``): the engine captures
a whole decode step, ``build`` included, over fixed input buffers, so a backend whose metadata
is device work needs nothing more; every layout of a graph is built with the graph's KV bound.
A backend that schedules on the host (from exact lengths) plans in ``plan_replay``, called
outside the graph before its warm-up and capture and before each replay (decode steps, and the
draft's deferred catch-ups): every layout such a graph builds has each row's KV length a fixed
amount past the row's start (the verify block, a draft step). The warm-up runs the graph's
work eagerly (``in_graph_build()``), its layouts carrying exact host lengths, so the backend
learns each forward of the graph there, in order; its ``build`` under capture
(``torch.cuda.is_current_stream_capturing()``) only writes the device side of a plan into
buffers it allocated beforehand: a replay reads every tensor at the address it was captured
with.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from outrider.plugins.device import AttentionShape, BatchLayout, ForwardBatch


@dataclass(frozen=True)
class GraphBounds:
    """The shape of one captured decode graph: what its buffers must hold."""

    max_bs: int  # rows, padding included
    max_q: int  # query tokens per row
    max_kv: int  # KV positions per row: every layout of the graph is built with this bound
    page_size: int


class AttentionBackend(ABC):
    """Paged attention for models of one ``AttentionShape``. Neither method may synchronise
    with the host (no ``.item()``, ``.tolist()``, ``.cpu()``, no data-dependent shapes): sizes
    come from the layout's host-known bounds and validity from its device tensors."""

    # Whether it serves sliding windows and sinks (``AttentionShape``): a backend that does
    # declares them in its capabilities; one that does not refuses a shape holding them (the
    # capability checks refuse such a model first).
    windows_and_sinks: ClassVar[bool] = False

    def __init__(self, shape: AttentionShape, options: Any, device: torch.device) -> None:
        if not self.windows_and_sinks and (any(shape.windows) or shape.sinks):
            raise ValueError(f"{type(self).__name__} serves no sliding windows or attention sinks")
        self.shape = shape
        self.options = options
        self.device = device

    @abstractmethod
    def build(self, layout: BatchLayout) -> object:
        """This backend's metadata for ``layout`` (called once per forward, before layer 0)."""

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fb: ForwardBatch,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store ``k, v: [T, kv_heads, head_dim]`` at ``fb.layout.out_loc`` into layer
        ``layer`` of ``fb.kv`` (``KVCache.store``), then attend ``q: [T, q_heads, head_dim]``
        over each row's KV with ``fb.metadata``, within the layer's sliding window
        (``AttentionShape.window``), each head's softmax denominator taking ``exp(sinks[h])``
        where given. Returns ``[T, q_heads, head_dim]``. A backend is handed windows and sinks
        only where its capabilities declare them."""

    def plan_replay(self, graph: Hashable, starts: tuple[int, ...], bounds: GraphBounds) -> None:
        """Before graph ``graph`` (of ``len(starts)`` rows) is warmed up and captured, and
        before each of its replays: each row's start, the KV length its layouts' lengths count
        from (a decode step's: the committed length; a deferred catch-up's: where its row
        ends), padding rows included, and the bounds of the captured layouts. Backends that
        schedule on the host plan every forward of the graph here; nothing by default."""
        return None
