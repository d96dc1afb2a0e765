"""The per-step forward context handed to models and attention backends.

Token layout: the ``T`` query tokens of a step are flat, row after row. Row ``r`` owns tokens
``q_start[r] .. q_start[r] + q_len[r]``. Host-known sizes (``max_q``, ``max_kv``) are upper
bounds that size the work; validity always comes from the device tensors (``positions``,
``seq_lens``), so a step never needs a host sync.

KV layout (DESIGN.md 4.2): per layer ``k, v: [num_pages, page_size, kv_heads, head_dim]``.
Logical position ``p`` of the request in slot ``s`` lives at flat index
``page_table[s, p // page_size] * page_size + p % page_size``. Page 0 is a scratch page that is
never handed out: padded tokens write there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from outrider.plugins.attention.base import AttentionBackend

SCRATCH_PAGE = 0


def flat_kv_index(
    page_table: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Flat KV index of logical ``positions`` (>= 0) of the requests in ``slots`` (the two
    broadcast together)."""
    pages = page_table[slots, torch.div(positions, page_size, rounding_mode="floor")]
    return pages.to(torch.int64) * page_size + positions % page_size


@dataclass
class KVCache:
    """One model's paged K/V storage (target and draft each own one)."""

    k: list[torch.Tensor]  # per layer [num_pages, page_size, kv_heads, head_dim]
    v: list[torch.Tensor]
    page_size: int

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V at flat indices ``src`` to ``dst`` (all reads first, so a
        destination may be another pair's source)."""
        for cache in (*self.k, *self.v):
            flat = cache.view(-1, *cache.shape[2:])
            flat.index_copy_(0, dst, flat[src])

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        shape = (num_pages, page_size, kv_heads, head_dim)
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            page_size=page_size,
        )


@dataclass
class ForwardBatch:
    """Everything one forward pass needs besides ``input_ids`` (an explicit model argument)."""

    backend: AttentionBackend
    kv: KVCache
    page_table: torch.Tensor  # [max_slots, max_pages] int32, shared by target and draft
    slots: torch.Tensor  # [bs] int64: request-table rows
    positions: torch.Tensor  # [T] int64: logical position of each query token
    out_loc: torch.Tensor  # [T] int64: flat KV index each token's K/V is written to
    q_start: torch.Tensor  # [bs + 1] int64: cumulative query lengths (device)
    seq_lens: torch.Tensor  # [bs] int64: KV length of each row after this step (device)
    # [T] int64: row * max_q + offset within the row; places flat tokens into a padded
    # [bs, max_q] grid (host-computed: query lengths are known when the step is planned).
    q_pad_index: torch.Tensor
    bs: int
    max_q: int  # upper bound on query tokens per row
    max_kv: int  # upper bound on KV length per row (allocated_len)
    causal: bool = True
    # A tree (speculative verify and tree drafting): each row's last ``block`` KV positions
    # (``seq_lens - block ..``) form the block; query ``i`` of a row attends to every position
    # before the block and to block position ``j`` where ``tree_mask[row, i, j]``. Positions
    # then only place RoPE, and ``out_loc`` the K/V. None: causal by position (or ``causal``).
    tree_mask: torch.Tensor | None = None  # [bs, max_q, block] bool
    # Layers (output-of-layer convention) whose hidden states the caller wants back.
    capture_layers: tuple[int, ...] = ()
    captured: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]
