"""``auto`` attention (auto_backend.py): each batch of a phase routed to it goes to one of two
backends by its size. The metadata is the chosen backend's own, so ``forward`` hands the batch
to the backend that built it (the same size picks the same one)."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from outrider.plugins.attention.auto_backend import AutoOptions
from outrider.plugins.attention.base import AttentionBackend, GraphBounds
from outrider.plugins.device import AttentionShape, BatchLayout, ForwardBatch
from outrider.plugins.registry import named_spec


class AutoAttention(AttentionBackend):
    windows_and_sinks = True  # where both backends serve them (auto_backend.py's check)

    def __init__(self, shape: AttentionShape, options: AutoOptions, device: torch.device) -> None:
        super().__init__(shape, options, device)

        def backend(name: str) -> AttentionBackend:
            spec = named_spec("attention", name)
            child: AttentionBackend = spec.load()(shape, spec.parse_options(None), device)
            return child

        self.small, self.large = backend(options.small), backend(options.large)
        self.large_from_batch = options.large_from_batch
        self.small_from_batch = options.small_from_batch

    def route(self, bs: int) -> AttentionBackend:
        """The backend of a batch of ``bs`` rows."""
        if bs < self.large_from_batch or 0 < self.small_from_batch <= bs:
            return self.small
        return self.large

    def build(self, layout: BatchLayout) -> object:
        return self.route(layout.bs).build(layout)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fb: ForwardBatch,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.route(fb.layout.bs).forward(layer, q, k, v, fb, sinks)

    def plan_replay(self, graph: Hashable, starts: tuple[int, ...], bounds: GraphBounds) -> None:
        self.route(bounds.max_bs).plan_replay(graph, starts, bounds)
