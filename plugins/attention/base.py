"""Base class of attention backend implementations (loaded in the daemon only)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from outrider.daemon.engine.forward import ForwardBatch


@dataclass(frozen=True)
class AttentionShape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


class AttentionBackend(ABC):
    """Paged attention for one model. ``prepare`` runs once per step (before the first layer),
    ``forward`` once per layer. Neither may synchronise with the host (no ``.item()``,
    ``.tolist()``, ``.cpu()``, no data-dependent shapes): sizes come from the host-known bounds
    of the ``ForwardBatch`` and validity from its device tensors."""

    def __init__(self, shape: AttentionShape, options: Any, device: torch.device) -> None:
        self.shape = shape
        self.options = options
        self.device = device

    @abstractmethod
    def prepare(self, fb: ForwardBatch) -> None:
        """Build this step's metadata from ``fb`` (called once, before layer 0)."""

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        """Write ``k, v: [T, kv_heads, head_dim]`` at ``fb.out_loc`` into layer ``layer`` of
        ``fb.kv``, then attend ``q: [T, q_heads, head_dim]`` over each row's KV (causal by
        position when ``fb.causal``). Returns ``[T, q_heads, head_dim]``."""
