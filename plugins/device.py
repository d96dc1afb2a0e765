"""The device surface of plugins: what an attention backend or a speculative worker may use.

Token layout: the ``T`` query tokens of a batch are flat, row after row. Row ``r`` owns tokens
``q_start[r] .. q_start[r] + q_len[r]``. Host-known sizes (``max_q``, ``max_kv``) are upper
bounds that size the work; validity always comes from the device tensors (``positions``,
``seq_lens``), so a batch never needs a host sync.

KV layout (ARCHITECTURE.md 4.2): per layer ``k, v: [num_pages, page_size, kv_heads, head_dim]``.
Logical position ``p`` of the request in slot ``s`` lives at flat index
``page_table[s, p // page_size] * page_size + p % page_size``. Page 0 is a scratch page that is
never handed out: padded tokens write there.

Sliding layers (``AttentionShape.windows``) may keep their K/V in a page space of their own
(``KVCache.window_map``): page ``p``'s positions of such a layer sit in its window page
``window_map[p]`` (0, the scratch page, where the page is outside every window that reads
it), so that pages left behind by every window free that space while the other layers keep
them. A ``ForwardBatch`` over such a cache binds a second layout, the same one translated
through the map (``BatchLayout.through``), and routes the sliding layers to it.

A ``BatchLayout`` says where a batch's tokens sit and what they attend; a ``ForwardBatch`` is
one layout run by one attention backend over one KV cache, with the metadata that backend
built for it. A draft that runs its own model over the target's layout binds the same layout
to its own backend and cache: metadata never outlives its batch.

A prompt batch that decoding rows ride (their one token each after the prompt rows) binds
those riders as a batch of their own to a second backend, the decode phase's
(``ForwardBatch.bind``'s ``riders``): a prompt kernel tiles its queries by row, so a row of one
token wastes nearly all of its tile, over the row's whole context.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from outrider.plugins.graph_build import building_graph, in_graph_build
from outrider.plugins.sampling import (
    DRAW_DRAFT,
    SamplingBatch,
    processed_probs,
    sample_probs,
)

__all__ = [
    "DRAW_DRAFT",
    "SCRATCH_PAGE",
    "Attention",
    "AttentionShape",
    "BatchLayout",
    "ForwardBatch",
    "HostLengths",
    "KVCache",
    "SamplingBatch",
    "building_graph",
    "flat_kv_index",
    "heads_contiguous",
    "in_graph_build",
    "processed_probs",
    "sample_probs",
]

SCRATCH_PAGE = 0


def flat_kv_index(
    page_table: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Flat KV index of logical ``positions`` (>= 0) of the requests in ``slots`` (the two
    broadcast together)."""
    pages = page_table[slots, torch.div(positions, page_size, rounding_mode="floor")]
    return pages.to(torch.int64) * page_size + positions % page_size


def heads_contiguous(x: torch.Tensor) -> bool:
    """Whether ``x: [T, H, D]`` has each token's heads side by side, as the Triton kernels of
    graphs being built read them; a token's row may be a view of a wider one (a projection)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _store_fits(cache: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``kv_store.store_kv`` writes ``value: [T, H, D]`` into ``cache: [P, S, H, D]``:
    the same dtype, on a GPU, each token's heads contiguous (a row may be a view of a wider
    one)."""
    return (
        value.is_cuda
        and value.dtype == cache.dtype
        and heads_contiguous(value)
        and cache.is_contiguous()
        and cache.shape[2:] == value.shape[1:]
    )


@dataclass(frozen=True)
class AttentionShape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    dtype: torch.dtype  # of q, k, v and the cache
    # Per layer, the positions a query attends back to, its own included (a sliding window);
    # 0, or no entry: every one before it. Backends serve them where their capabilities say
    # ``sliding_window``.
    windows: tuple[int, ...] = ()
    # Its layers give each query head a learned sink: a logit beside the keys' in the
    # softmax's denominator, attending to nothing (``attend``'s ``sinks``; capability
    # ``sinks``).
    sinks: bool = False

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window; 0: none."""
        return self.windows[layer] if layer < len(self.windows) else 0


@dataclass
class KVCache:
    """One model's paged K/V storage (target and draft each own one)."""

    k: list[torch.Tensor]  # per layer [num_pages, page_size, kv_heads, head_dim]
    v: list[torch.Tensor]
    page_size: int
    # [num_pages] int32: each page's window page, for the layers of ``windowed`` (whose
    # tensors hold ``window_pages`` pages); None: every layer addressed by the page ids.
    window_map: torch.Tensor | None = None
    windowed: tuple[bool, ...] = ()

    @property
    def num_pages(self) -> int:
        """The pages of the layers that keep every position (the page ids' range)."""
        return self.window_map.shape[0] if self.window_map is not None else self.k[0].shape[0]

    def in_window_space(self, layer: int) -> bool:
        """Whether layer ``layer``'s K/V sit in the window pages (``window_map``)."""
        return self.window_map is not None and layer < len(self.windowed) and self.windowed[layer]

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k, v: [T, kv_heads, head_dim]`` of layer ``layer`` at flat indices ``loc``
        ``[T]`` (in the cache's dtype). A graph being built writes both in one kernel."""
        k_cache, v_cache = self.k[layer], self.v[layer]
        if in_graph_build() and _store_fits(k_cache, k) and _store_fits(v_cache, v):
            from outrider.plugins.kv_store import store_kv

            store_kv(k_cache, v_cache, loc, k, v)
            return
        for cache, value in ((k_cache, k), (v_cache, v)):
            flat = cache.view(-1, *cache.shape[2:])
            flat.index_copy_(0, loc, value.to(flat.dtype))

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V at flat indices ``src`` to ``dst`` (all reads first, so a
        destination may be another pair's source); the window pages' layers through the map."""
        moves = [(src, dst)]
        if self.window_map is not None:
            moves.append((self.translate(src), self.translate(dst)))
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            s, d = moves[self.in_window_space(layer)]
            for cache in (k, v):
                flat = cache.view(-1, *cache.shape[2:])
                flat.index_copy_(0, d, flat[s])

    def copy_window_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy window pages ``src`` to ``dst`` (``[n]`` int64, none of them both) in every
        layer kept in the window pages."""
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            if self.in_window_space(layer):
                for cache in (k, v):
                    cache.index_copy_(0, dst, cache.index_select(0, src))

    def translate(self, loc: torch.Tensor) -> torch.Tensor:
        """Flat indices ``loc`` (int64) of the page ids, in the window pages."""
        assert self.window_map is not None
        pages = torch.div(loc, self.page_size, rounding_mode="floor")
        return self.window_map[pages].to(torch.int64) * self.page_size + loc % self.page_size

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_pages: int,
        page_size: int,
        shape: AttentionShape,
        dtype: torch.dtype,
        device: torch.device,
        window_pages: int | None = None,
    ) -> KVCache:
        """``window_pages``: the window page space of the sliding layers (``shape.windows``),
        its map all scratch (0) until the pages are given theirs; None: no such space."""
        windowed = tuple(shape.window(layer) > 0 for layer in range(num_layers))
        window_map = None
        if window_pages is not None and any(windowed):
            window_map = torch.zeros(num_pages, dtype=torch.int32, device=device)

        def pages(layer: int) -> tuple[int, ...]:
            rows = window_pages if window_map is not None and windowed[layer] else num_pages
            assert rows is not None
            return (rows, page_size, shape.num_kv_heads, shape.head_dim)

        return cls(
            k=[torch.zeros(pages(i), dtype=dtype, device=device) for i in range(num_layers)],
            v=[torch.zeros(pages(i), dtype=dtype, device=device) for i in range(num_layers)],
            page_size=page_size,
            window_map=window_map,
            windowed=windowed if window_map is not None else (),
        )


@dataclass(frozen=True)
class HostLengths:
    """Each row's query and KV lengths of a batch as the host knows them exactly: prompt
    (extend) batches and plain decode batches. A speculative cycle's lengths follow the
    accepted counts, on the device: its layouts carry them only where the engine waited for
    the previous cycle (a backend routed to the cycle plans on the host)."""

    q_lens: tuple[int, ...]  # query tokens per row
    seq_lens: tuple[int, ...]  # KV length per row after the batch


@dataclass(frozen=True)
class BatchLayout:
    """Where one batch's query tokens sit, where their K/V go and what they attend."""

    page_table: torch.Tensor  # [max_slots, max_pages] int32, shared by target and draft
    page_size: int
    slots: torch.Tensor  # [bs] int64: request-table rows
    positions: torch.Tensor  # [T] int64: logical position of each query token
    out_loc: torch.Tensor  # [T] int64: flat KV index each token's K/V is written to
    q_start: torch.Tensor  # [bs + 1] int64: cumulative query lengths
    seq_lens: torch.Tensor  # [bs] int64: KV length of each row after this batch
    # [T] int64: row * max_q + offset within the row; places flat tokens into a padded
    # [bs, max_q] grid.
    q_pad_index: torch.Tensor
    bs: int
    max_q: int  # upper bound on query tokens per row
    max_kv: int  # upper bound on KV length per row
    causal: bool = True
    # A tree (speculative verify and tree drafting): each row's last ``block`` KV positions
    # (``seq_lens - block ..``) form the block; query ``i`` of a row attends to every position
    # before the block and to block position ``j`` where ``tree_mask[row, i, j]``. Positions
    # then only place RoPE, and ``out_loc`` the K/V. None: causal by position (or ``causal``).
    tree_mask: torch.Tensor | None = None  # [bs, max_q, block] bool
    # The exact lengths when the host knows them (for backends that plan on the host).
    host: HostLengths | None = None

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    def rider_rows(self) -> int:
        """Where this batch's riders start: the first row of its trailing run of one-token
        rows after a longer row, from the host lengths; ``bs`` where there is no such run."""
        if self.host is None or self.tree_mask is not None or self.max_q == 1:
            return self.bs
        first = self.bs
        while first > 0 and self.host.q_lens[first - 1] == 1:
            first -= 1
        return first if first > 0 else self.bs

    def split_rows(self, rows: int) -> tuple[BatchLayout, BatchLayout]:
        """This batch as two: its first ``rows`` rows, and the rest, one query token each
        (``rider_rows``). Slices of the device tensors at host offsets, and one index."""
        host = self.host
        assert host is not None and 0 < rows < self.bs and set(host.q_lens[rows:]) == {1}
        tokens = sum(host.q_lens[:rows])
        riders = self.bs - rows
        head = replace(
            self,
            slots=self.slots[:rows],
            positions=self.positions[:tokens],
            out_loc=self.out_loc[:tokens],
            q_start=self.q_start[: rows + 1],
            seq_lens=self.seq_lens[:rows],
            q_pad_index=self.q_pad_index[:tokens],  # its stride stays max_q
            bs=rows,
            max_kv=max(host.seq_lens[:rows]),
            host=HostLengths(host.q_lens[:rows], host.seq_lens[:rows]),
        )
        tail = replace(
            self,
            slots=self.slots[rows:],
            positions=self.positions[tokens:],
            out_loc=self.out_loc[tokens:],
            q_start=self.q_start[rows:] - tokens,
            seq_lens=self.seq_lens[rows:],
            q_pad_index=torch.arange(riders, device=self.q_pad_index.device),
            bs=riders,
            max_q=1,
            max_kv=max(host.seq_lens[rows:]),
            host=HostLengths(host.q_lens[rows:], host.seq_lens[rows:]),
        )
        return head, tail

    def through(self, kv: KVCache) -> BatchLayout:
        """This layout in ``kv``'s window pages: each row's page-table row translated
        through the map (row ``r`` of the new table is the row of ``slots[r]``), and the
        K/V indices alike. Device work only."""
        assert kv.window_map is not None
        rows = self.page_table.index_select(0, self.slots).to(torch.int64)
        return replace(
            self,
            page_table=kv.window_map[rows],
            slots=torch.arange(self.bs, device=self.slots.device),
            out_loc=kv.translate(self.out_loc),
        )


class Attention(Protocol):
    """What a ``ForwardBatch`` needs of its attention backend (``AttentionBackend`` in
    ``outrider.plugins.attention.base`` is the base class to implement)."""

    def build(self, layout: BatchLayout) -> object: ...

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fb: ForwardBatch,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class ForwardBatch:
    """One forward pass: everything besides ``input_ids`` (an explicit model argument)."""

    layout: BatchLayout
    kv: KVCache
    backend: Attention
    metadata: object  # built by ``backend`` for ``layout``
    # Layers (output-of-layer convention) whose hidden states the caller wants back.
    capture_layers: tuple[int, ...] = ()
    captured: dict[int, torch.Tensor] = field(default_factory=dict)
    # The same forward in ``kv``'s window pages (``BatchLayout.through``), for the layers
    # kept there; None where the cache has none.
    window: ForwardBatch | None = None
    # A prompt batch with riders: its prompt rows and its riders, each bound to its own
    # backend; they attend apart (``metadata`` is then None).
    parts: tuple[ForwardBatch, ForwardBatch] | None = None

    @classmethod
    def bind(
        cls,
        layout: BatchLayout,
        backend: Attention,
        kv: KVCache,
        capture_layers: tuple[int, ...] = (),
        riders: Attention | None = None,
    ) -> ForwardBatch:
        """``layout`` run by ``backend`` over ``kv``; the backend builds its metadata now
        (for the window pages' layout too, where ``kv`` has them). ``riders``: the backend of
        the batch's riders (``BatchLayout.rider_rows``), where it may have some."""
        if riders is not None and (rows := layout.rider_rows()) < layout.bs:
            head, tail = layout.split_rows(rows)
            parts = (cls.bind(head, backend, kv), cls.bind(tail, riders, kv))
            return cls(layout, kv, backend, None, capture_layers, parts=parts)
        window = None
        if kv.window_map is not None:
            inside = layout.through(kv)
            window = cls(inside, kv, backend, backend.build(inside))
        return cls(layout, kv, backend, backend.build(layout), capture_layers, window=window)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store ``k, v`` of layer ``layer`` and attend ``q`` (the backend's contract);
        ``sinks: [q_heads]``: the layer's sink logits (``AttentionShape.sinks``)."""
        if self.parts is not None:
            head, tail = self.parts
            n = head.layout.num_tokens
            return torch.cat(
                (
                    head.attend(layer, q[:n], k[:n], v[:n], sinks),
                    tail.attend(layer, q[n:], k[n:], v[n:], sinks),
                )
            )
        fb = self.window if self.window is not None and self.kv.in_window_space(layer) else self
        if sinks is None:
            return self.backend.forward(layer, q, k, v, fb)
        return self.backend.forward(layer, q, k, v, fb, sinks)
