"""``flashinfer`` attention: FlashInfer's paged prefill and decode wrappers over the cache in
place (FlashInfer's "NHD" paged layout is ours: ``[pages, page_size, kv_heads, head_dim]``).

Per forward, ``build`` turns the layout into FlashInfer's page lists on the device (``indptr``,
page ``indices``, ``last_page_len``, from ``seq_lens`` and the page table) and plans a wrapper
on the host from ``layout.host``; each layer then stores its K/V and runs the planned kernel:
the decode wrapper for one query token a row, the prefill wrapper (causal over the row's
cached prefix) for more, as a speculative chain's verify block. Decode graphs: one wrapper per
captured batch size and query width on fixed buffers, planned by ``plan_replay`` before the
capture and each replay; ``build`` under capture only rewrites the page lists into that
wrapper's buffers, from the staged layout.

Hazard: a plan writes its schedule into a page-locked host buffer and queues a copy from it;
planning the same wrapper again before that copy ran would rewrite the schedule of a step
still queued. Every wrapper waits for its previous plan's copy (an event) before planning
again. Under the overlap loop that copy ran before the previous step's results were read, so
the wait costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from outrider.plugins.attention.base import AttentionBackend, GraphBounds
from outrider.plugins.device import AttentionShape, BatchLayout, ForwardBatch, HostLengths

# FlashInfer's split-KV scratch (partial outputs and their log-sum-exps), shared by every
# wrapper of a backend: they run one after another on one stream.
WORKSPACE_BYTES = 128 * 2**20


class _Wrapper:
    """A FlashInfer wrapper and the event after its last plan's host-to-device copies."""

    def __init__(self, wrapper: Any) -> None:
        self.wrapper = wrapper
        self.copied: torch.cuda.Event | None = None

    def plan(self, *args: Any, **kwargs: Any) -> None:
        if self.copied is not None:
            self.copied.synchronize()
        self.wrapper.plan(*args, **kwargs)
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


class FlashInferAttention(AttentionBackend):
    def __init__(self, shape: AttentionShape, options: Any, device: torch.device) -> None:
        super().__init__(shape, options, device)
        import flashinfer

        self._flashinfer = flashinfer
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = _Wrapper(
            flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        )
        self._decode = _Wrapper(
            flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        )
        # Graph wrappers by (batch size, query tokens per row).
        self._graphs: dict[tuple[int, int], tuple[_Wrapper, PageLists]] = {}

    def build(self, layout: BatchLayout) -> FlashInferMetadata:
        if torch.cuda.is_current_stream_capturing():
            wrapper, lists = self._graphs[layout.bs, layout.max_q]
            fill_page_lists(layout, lists)
            return FlashInferMetadata(wrapper.wrapper)
        host = layout.host
        if host is None:
            raise ValueError("flashinfer plans on the host: the layout carries no host lengths")
        plan = _HostPlan.of(host, layout.page_size)
        lists = page_lists(layout, int(plan.kv_indptr[-1]))
        if layout.max_q == 1:
            self._plan_decode(self._decode, plan, lists.indices, layout.page_size)
            return FlashInferMetadata(self._decode.wrapper)
        self._plan_prefill(self._prefill, plan, lists.indices, layout.page_size, layout.causal)
        return FlashInferMetadata(self._prefill.wrapper)

    def plan_replay(self, host: HostLengths, bounds: GraphBounds) -> None:
        key = (len(host.seq_lens), bounds.max_q)
        if key not in self._graphs:
            self._graphs[key] = self._graph_wrapper(*key, bounds)
        wrapper, lists = self._graphs[key]
        plan = _HostPlan.of(host, bounds.page_size)
        if bounds.max_q == 1:
            self._plan_decode(wrapper, plan, lists.indices, bounds.page_size)
        else:  # a speculative chain's verify block: causal over the cached prefix
            self._plan_prefill(wrapper, plan, lists.indices, bounds.page_size, causal=True)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        meta = fb.metadata
        assert isinstance(meta, FlashInferMetadata), "metadata built by another backend"
        fb.kv.store(layer, fb.layout.out_loc, k, v)
        out: torch.Tensor = meta.wrapper.run(q, (fb.kv.k[layer], fb.kv.v[layer]))
        return out  # [T, Hq, D]

    def _graph_wrapper(self, bs: int, q: int, bounds: GraphBounds) -> tuple[_Wrapper, PageLists]:
        max_pages = -(-bounds.max_kv // bounds.page_size)
        lists = PageLists(
            indptr=torch.zeros(bs + 1, dtype=torch.int32, device=self.device),
            indices=torch.zeros(bs * max_pages, dtype=torch.int32, device=self.device),
            last_page_len=torch.zeros(bs, dtype=torch.int32, device=self.device),
        )
        if q == 1:
            wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                paged_kv_indptr_buffer=lists.indptr,
                paged_kv_indices_buffer=lists.indices,
                paged_kv_last_page_len_buffer=lists.last_page_len,
            )
        else:
            wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                # Every row has q query tokens: the plan's copy of the offsets is the same at
                # every replay.
                qo_indptr_buf=torch.zeros(bs + 1, dtype=torch.int32, device=self.device),
                paged_kv_indptr_buf=lists.indptr,
                paged_kv_indices_buf=lists.indices,
                paged_kv_last_page_len_buf=lists.last_page_len,
            )
        return _Wrapper(wrapper), lists

    def _plan_prefill(
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

    def _plan_decode(
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
