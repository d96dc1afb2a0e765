"""``flashinfer`` attention: FlashInfer's paged prefill and decode wrappers over the cache in
place (FlashInfer's "NHD" paged layout is ours: ``[pages, page_size, kv_heads, head_dim]``).

Per forward, ``build`` turns the layout into FlashInfer's page lists on the device (``indptr``,
page ``indices``, ``last_page_len``, from ``seq_lens`` and the page table) and plans a wrapper
on the host from ``layout.host``; each layer then stores its K/V and runs the planned kernel:
the decode wrapper for one query token a row, the prefill wrapper for more: causal over the
row's cached prefix (prompt chunks, a chain's verify block), non-causal (DFlash's block), or
under a tree's custom mask (a tree's verify or draft step), whose bits the device packs
(flashinfer_masks.py).

Graphs (decode steps, and the draft's catch-ups): every forward of a graph has a wrapper on
fixed buffers of its own (a site). ``plan_replay`` announces a new graph; its warm-up (eager,
with host lengths) meets its forwards in order, and each takes a site, planned there, at a
fixed distance past the rows' starts; the capture writes the page lists (and masks) into the
sites' buffers; before each replay ``plan_replay`` plans every site of the graph again from
the replay's starts. Graphs whose forwards match (greedy and sampled ones) share sites. A tree
mask needs such a site eagerly too (FlashInfer reads a custom mask from the buffers given at
the wrapper's construction when it plans without one): eager tree layouts take sites by batch
size, the last few kept.

Hazard: a plan writes its schedule into a page-locked host buffer and queues a copy from it;
planning the same wrapper again before that copy ran would rewrite the schedule of a step
still queued. Every wrapper waits for its previous plan's copy (an event) before planning
again. Under the overlap loop that copy ran before the previous step's results were read, so
the wait costs nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from outrider.plugins.attention.base import AttentionBackend, GraphBounds
from outrider.plugins.attention.flashinfer_masks import (
    mask_capacity,
    mask_offsets,
    pack_tree_mask,
)
from outrider.plugins.device import AttentionShape, BatchLayout, ForwardBatch, HostLengths
from outrider.plugins.graph_build import in_graph_build

# FlashInfer's split-KV scratch (partial outputs and their log-sum-exps), shared by every
# wrapper of a backend: they run one after another on one stream.
WORKSPACE_BYTES = 128 * 2**20
# Eager tree sites kept (each holds FlashInfer's own 8 MiB scratch, on the device and pinned).
EAGER_TREE_SITES = 4


class _Wrapper:
    """A FlashInfer wrapper and the event after its last plan's host-to-device copies."""

    def __init__(self, wrapper: Any) -> None:
        self.wrapper = wrapper
        self.copied: torch.cuda.Event | None = None

    def plan(self, *args: Any, **kwargs: Any) -> None:
        if self.copied is not None:
            self.copied.synchronize()
        self.wrapper.plan(*args, **kwargs)
        self.record()

    def record(self) -> None:
        """Mark the copies queued so far as the last plan's."""
        self.copied = torch.cuda.Event()
        self.copied.record()


@dataclass(frozen=True)
class PageLists:
    """FlashInfer's view of a batch's pages (int32, on the device)."""

    indptr: torch.Tensor  # [bs + 1]: row r's pages are indices[indptr[r] : indptr[r + 1]]
    indices: torch.Tensor  # [>= indptr[-1]] page ids
    last_page_len: torch.Tensor  # [bs]: positions used in each row's last page


@dataclass(frozen=True)
class FlashInferMetadata:
    wrapper: Any  # planned for this forward


@dataclass(frozen=True)
class _HostPlan:
    """The host side of a plan: the CSR offsets FlashInfer schedules from."""

    qo_indptr: torch.Tensor  # [bs + 1] int32, on the host
    kv_indptr: torch.Tensor  # [bs + 1]
    last_page_len: torch.Tensor  # [bs]

    @classmethod
    def of(cls, host: HostLengths, page_size: int) -> _HostPlan:
        seq_lens = torch.tensor(host.seq_lens, dtype=torch.int32)
        pages = (seq_lens + page_size - 1) // page_size
        zero = torch.zeros(1, dtype=torch.int32)
        q_lens = torch.tensor(host.q_lens, dtype=torch.int32)
        return cls(
            qo_indptr=torch.cat((zero, q_lens.cumsum(0, dtype=torch.int32))),
            kv_indptr=torch.cat((zero, pages.cumsum(0, dtype=torch.int32))),
            last_page_len=seq_lens - (pages - 1) * page_size,
        )


@dataclass(frozen=True)
class _Mask:
    """A site's custom mask buffers (flashinfer_masks.py): the packed bits, filled on the
    device, and each row's byte offset, planned on the host."""

    packed: torch.Tensor  # [capacity] uint8
    indptr: torch.Tensor  # [bs + 1] int32, on the device
    host_indptr: torch.Tensor  # [bs + 1] int32, page-locked: the plan's copy reads it


@dataclass(frozen=True)
class _SiteKey:
    bs: int
    q: int  # query tokens per row
    causal: bool
    tree: bool  # a custom (tree) mask
    max_kv: int
    ordinal: int  # of the forwards of one graph with the same shape, the how-manieth


class _Site:
    """A FlashInfer wrapper on fixed buffers of its own (FlashInfer's CUDA-graph mode) for
    forwards of one shape: ``bs`` rows of ``q`` query tokens, at most ``max_kv`` positions."""

    def __init__(self, backend: FlashInferAttention, key: _SiteKey, page_size: int) -> None:
        device, flashinfer = backend.device, backend.flashinfer
        bs = key.bs
        self.key = key
        self.page_size = page_size
        self.lists = PageLists(
            indptr=torch.zeros(bs + 1, dtype=torch.int32, device=device),
            indices=torch.zeros(bs * -(-key.max_kv // page_size), dtype=torch.int32, device=device),
            last_page_len=torch.zeros(bs, dtype=torch.int32, device=device),
        )
        self.mask: _Mask | None = None
        if key.q == 1:
            assert not key.tree, "one query a row sees its whole context"
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                backend.workspace,
                "NHD",
                use_cuda_graph=True,
                paged_kv_indptr_buffer=self.lists.indptr,
                paged_kv_indices_buffer=self.lists.indices,
                paged_kv_last_page_len_buffer=self.lists.last_page_len,
            )
        else:
            if key.tree:
                self.mask = _Mask(
                    packed=torch.zeros(
                        mask_capacity(bs, key.q, key.max_kv), dtype=torch.uint8, device=device
                    ),
                    indptr=torch.zeros(bs + 1, dtype=torch.int32, device=device),
                    host_indptr=torch.zeros(bs + 1, dtype=torch.int32).pin_memory(),
                )
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                backend.workspace,
                "NHD",
                use_cuda_graph=True,
                # Every row has q query tokens: the plan's copy of the offsets is the same at
                # every replay.
                qo_indptr_buf=torch.zeros(bs + 1, dtype=torch.int32, device=device),
                paged_kv_indptr_buf=self.lists.indptr,
                paged_kv_indices_buf=self.lists.indices,
                paged_kv_last_page_len_buf=self.lists.last_page_len,
                # Given, they make every plan's forward read its mask from them.
                custom_mask_buf=None if self.mask is None else self.mask.packed,
                mask_indptr_buf=None if self.mask is None else self.mask.indptr,
            )
        self.wrapper = _Wrapper(wrapper)

    def plan(self, backend: FlashInferAttention, host: HostLengths) -> None:
        """Plan the next forward over ``host``'s lengths (and queue its mask offsets)."""
        plan = _HostPlan.of(host, self.page_size)
        mask = self.mask
        if self.key.q == 1:
            backend.plan_decode(self.wrapper, plan, self.lists.indices, self.page_size)
        else:
            backend.plan_prefill(
                self.wrapper, plan, self.lists.indices, self.page_size, self.key.causal
            )
        if mask is not None:
            # The wrapper's event (recorded after this copy too) guards the pinned source.
            mask.host_indptr.numpy()[:] = mask_offsets(self.key.q, host.seq_lens)
            mask.indptr.copy_(mask.host_indptr, non_blocking=True)
            self.wrapper.record()

    def fill(self, layout: BatchLayout) -> FlashInferMetadata:
        """Write ``layout``'s page lists (and packed mask) into the buffers, on the device."""
        fill_page_lists(layout, self.lists)
        if self.mask is not None:
            assert layout.tree_mask is not None, "a tree site serves tree layouts"
            pack_tree_mask(layout.tree_mask, layout.seq_lens, self.mask.indptr, self.mask.packed)
        return FlashInferMetadata(self.wrapper.wrapper)


@dataclass
class _GraphBuild:
    """The graph ``plan_replay`` announced last, while its warm-up and capture run: the sites
    its warm-up met, each with its rows' distance past their starts, and how many of them its
    capture has used."""

    starts: tuple[int, ...]
    sites: list[tuple[_Site, int]] = field(default_factory=list)
    captured: int = 0


class FlashInferAttention(AttentionBackend):
    def __init__(self, shape: AttentionShape, options: Any, device: torch.device) -> None:
        super().__init__(shape, options, device)
        import flashinfer

        self.flashinfer = flashinfer
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = _Wrapper(
            flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        )
        self._decode = _Wrapper(
            flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
        )
        self._sites: dict[_SiteKey, _Site] = {}
        self._graphs: dict[Hashable, list[tuple[_Site, int]]] = {}
        self._building: _GraphBuild | None = None
        self._eager_trees: OrderedDict[tuple[int, int], _Site] = OrderedDict()

    def build(self, layout: BatchLayout) -> FlashInferMetadata:
        if torch.cuda.is_current_stream_capturing():
            return self._captured_site().fill(layout)
        host = layout.host
        if host is None:
            raise ValueError("flashinfer plans on the host: the layout carries no host lengths")
        if in_graph_build():
            site = self._warm_site(layout, host)
            site.plan(self, host)
            return site.fill(layout)
        if layout.tree_mask is not None:
            site = self._eager_tree_site(layout)
            site.plan(self, host)
            return site.fill(layout)
        plan = _HostPlan.of(host, layout.page_size)
        lists = page_lists(layout, int(plan.kv_indptr[-1]))
        if layout.max_q == 1:
            self.plan_decode(self._decode, plan, lists.indices, layout.page_size)
            return FlashInferMetadata(self._decode.wrapper)
        self.plan_prefill(self._prefill, plan, lists.indices, layout.page_size, layout.causal)
        return FlashInferMetadata(self._prefill.wrapper)

    def plan_replay(self, graph: Hashable, starts: tuple[int, ...], bounds: GraphBounds) -> None:
        sites = self._graphs.get(graph)
        if sites is None:  # its warm-up and capture come next
            self._building = _GraphBuild(starts)
            self._graphs[graph] = self._building.sites
            return
        for site, past in sites:
            q = site.key.q
            site.plan(self, HostLengths((q,) * len(starts), tuple(s + past for s in starts)))

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fb: ForwardBatch,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        meta = fb.metadata
        assert isinstance(meta, FlashInferMetadata), "metadata built by another backend"
        fb.kv.store(layer, fb.layout.out_loc, k, v)
        out: torch.Tensor = meta.wrapper.run(q, (fb.kv.k[layer], fb.kv.v[layer]))
        return out  # [T, Hq, D]

    def _warm_site(self, layout: BatchLayout, host: HostLengths) -> _Site:
        """The site of the next forward of the graph being built (its warm-up), recorded
        with its distance past the rows' starts."""
        building = self._building
        if building is None:
            raise RuntimeError("flashinfer: a graph's forward before plan_replay announced it")
        pasts = {seq - start for seq, start in zip(host.seq_lens, building.starts, strict=True)}
        if len(pasts) != 1 or set(host.q_lens) != {layout.max_q}:
            raise ValueError(
                "flashinfer plans a graph's forward from its rows' starts: every row needs the "
                "same query length and KV length past its start"
            )
        tree = layout.tree_mask is not None
        shape = (layout.bs, layout.max_q, layout.causal and not tree, tree)
        ordinal = sum(
            (site.key.bs, site.key.q, site.key.causal, site.key.tree) == shape
            for site, _ in building.sites
        )
        key = _SiteKey(*shape, max_kv=layout.max_kv, ordinal=ordinal)
        if key not in self._sites:
            self._sites[key] = _Site(self, key, layout.page_size)
        building.sites.append((self._sites[key], pasts.pop()))
        return self._sites[key]

    def _captured_site(self) -> _Site:
        """The site of the next forward of the graph being captured (in warm-up order)."""
        building = self._building
        assert building is not None and building.captured < len(building.sites), (
            "a capture runs the forwards of its warm-up"
        )
        site, _ = building.sites[building.captured]
        building.captured += 1
        return site

    def _eager_tree_site(self, layout: BatchLayout) -> _Site:
        """A site for an eager tree layout of ``layout``'s batch size and queries, grown to
        its KV bound when short."""
        shape = (layout.bs, layout.max_q)
        site = self._eager_trees.pop(shape, None)
        if site is None or site.key.max_kv < layout.max_kv:
            # The bound rounded up to a power of two: a few growths serve a long request.
            max_kv = 1 << (layout.max_kv - 1).bit_length()
            key = _SiteKey(*shape, causal=False, tree=True, max_kv=max_kv, ordinal=0)
            site = _Site(self, key, layout.page_size)
        self._eager_trees[shape] = site
        while len(self._eager_trees) > EAGER_TREE_SITES:
            self._eager_trees.popitem(last=False)
        return site

    def plan_prefill(
        self, wrapper: _Wrapper, plan: _HostPlan, indices: torch.Tensor, page_size: int,
        causal: bool,
    ) -> None:  # fmt: skip
        wrapper.plan(
            plan.qo_indptr,
            plan.kv_indptr,
            indices,
            plan.last_page_len,
            self.shape.num_q_heads,
            self.shape.num_kv_heads,
            self.shape.head_dim,
            page_size,
            causal=causal,
            sm_scale=self.shape.scale,
            q_data_type=self.shape.dtype,
            kv_data_type=self.shape.dtype,
        )

    def plan_decode(
        self, wrapper: _Wrapper, plan: _HostPlan, indices: torch.Tensor, page_size: int
    ) -> None:
        wrapper.plan(
            plan.kv_indptr,
            indices,
            plan.last_page_len,
            self.shape.num_q_heads,
            self.shape.num_kv_heads,
            self.shape.head_dim,
            page_size,
            sm_scale=self.shape.scale,
            q_data_type=self.shape.dtype,
            kv_data_type=self.shape.dtype,
        )


def page_lists(layout: BatchLayout, num_pages: int) -> PageLists:
    """The batch's page lists, ``indices`` holding exactly ``num_pages`` entries (the host's
    ``indptr[-1]``)."""
    device = layout.seq_lens.device
    lists = PageLists(
        indptr=torch.empty(layout.bs + 1, dtype=torch.int32, device=device),
        indices=torch.empty(num_pages, dtype=torch.int32, device=device),
        last_page_len=torch.empty(layout.bs, dtype=torch.int32, device=device),
    )
    fill_page_lists(layout, lists)
    return lists


def fill_page_lists(layout: BatchLayout, lists: PageLists) -> None:
    """Write ``layout``'s page lists into ``lists`` in place, from the device lengths only (no
    host sync; fixed sizes, so a graph can hold it). ``lists.indices`` past the last row's
    pages receives harmless repeats of valid entries."""
    page_size = layout.page_size
    seq_lens = layout.seq_lens.to(torch.int32)
    pages = (seq_lens + page_size - 1) // page_size  # [bs]
    lists.indptr[:1].zero_()  # a device fill: a host scalar would be a copy (none in a graph)
    torch.cumsum(pages, 0, dtype=torch.int32, out=lists.indptr[1:])
    torch.sub(seq_lens, (pages - 1) * page_size, out=lists.last_page_len)
    entry = torch.arange(lists.indices.shape[0], device=seq_lens.device, dtype=torch.int32)
    # Entry e belongs to the row whose span [indptr[r], indptr[r + 1]) holds it.
    row = torch.searchsorted(lists.indptr[1:], entry, right=True).clamp_(max=layout.bs - 1)
    col = (entry - lists.indptr[row]).clamp_(0, layout.page_table.shape[1] - 1).long()
    lists.indices.copy_(layout.page_table[layout.slots[row], col])
