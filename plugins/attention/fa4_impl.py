"""``fa4`` attention: FlashAttention-4's varlen kernel over the paged cache in place.

Our layout is FA4's: per layer K and V ``[pages, page_size, kv_heads, head_dim]``, the flat
query tokens row after row (``q_start`` is its ``cu_seqlens_q``). ``build`` turns a layout into
FA4's int32 views on the device, once per forward; every layer then stores its K/V and runs one
kernel. What a query attends (the torch backend's masks, per row of KV length ``seq_len``):

    causal      kv <= seq_len - q_len + i for the row's query i: FA4's causal mask, aligned to
                the end of the row, which is where every causal layout puts its queries
    non-causal  kv <  seq_len (a DFlash block)
    tree        the tree mask_mod of ``fa4_masks``

In a layer of a sliding window of ``W`` positions (``AttentionShape.window``) a causal query
attends the keys less than ``W`` behind it (FA4's local window ``(W - 1, 0)``, aligned as its
causal mask is), a tree's through its mask_mod (which reads the queries' positions: a block
cell sits at its node's position); sinks are FA4's ``learnable_sink``, one logit a query head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from outrider.plugins.attention.base import AttentionBackend
from outrider.plugins.attention.fa4_backend import head_dim_problem
from outrider.plugins.device import AttentionShape, BatchLayout, ForwardBatch


@dataclass(frozen=True)
class FA4Metadata:
    cu_seqlens_q: torch.Tensor  # [bs + 1] int32: the layout's q_start
    seqused_k: torch.Tensor  # [bs] int32: each row's KV length
    page_table: torch.Tensor  # [bs, max_pages] int32: each row's pages (its slot's table row)
    max_q: int  # host bound on a row's queries: FA4 sizes its tiles and grid by it
    causal: bool
    tree: torch.Tensor | None  # [bs, max_q, block] int32: the layout's tree mask
    # [bs, max_q] int32: each query's position (-1: padding), for a tree in windowed layers.
    positions: torch.Tensor | None = None


def fa4_metadata(layout: BatchLayout, windowed: bool = False) -> FA4Metadata:
    """FA4's view of ``layout``, from its device tensors only (no host sync); ``windowed``:
    some layer has a sliding window (a tree's mask then reads the queries' positions)."""
    tree = layout.tree_mask
    positions = None
    if tree is not None and windowed:
        grid = layout.bs * layout.max_q
        positions = torch.full((grid,), -1, dtype=torch.int32, device=layout.positions.device)
        positions[layout.q_pad_index] = layout.positions.to(torch.int32)
        positions = positions.view(layout.bs, layout.max_q)
    return FA4Metadata(
        cu_seqlens_q=layout.q_start.to(torch.int32),
        seqused_k=layout.seq_lens.to(torch.int32),
        page_table=layout.page_table.index_select(0, layout.slots),
        max_q=layout.max_q,
        causal=layout.causal and tree is None,
        tree=None if tree is None else tree.to(torch.int32, memory_format=torch.contiguous_format),
        positions=positions,
    )


class FA4Attention(AttentionBackend):
    windows_and_sinks = True

    def __init__(self, shape: AttentionShape, options: Any, device: torch.device) -> None:
        super().__init__(shape, options, device)
        capability = None
        if device.type == "cuda":
            capability = torch.cuda.get_device_capability(device)
        why = head_dim_problem(shape.head_dim, capability)
        if why is not None:
            raise ValueError(f"fa4 attention {why}")
        if shape.num_q_heads % shape.num_kv_heads:
            raise ValueError("fa4 attention needs q heads a multiple of kv heads")
        from flash_attn.cute import flash_attn_varlen_func

        from outrider.plugins.attention.fa4_masks import tree_mask_mod

        self._attend = flash_attn_varlen_func
        self._tree_mask_mod = tree_mask_mod

    def build(self, layout: BatchLayout) -> FA4Metadata:
        return fa4_metadata(layout, any(self.shape.windows))

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
        assert isinstance(meta, FA4Metadata), "metadata built by another backend"
        fb.kv.store(layer, fb.layout.out_loc, k, v)
        window = self.shape.window(layer)
        mask_mod, aux = None, None
        window_size: tuple[int | None, int | None] = (None, None)
        if meta.tree is not None:
            block = meta.tree.shape[-1]
            mask_mod = self._tree_mask_mod(block, window)
            aux = [meta.tree]
            if window:  # a verify's tree: its block cells are its queries
                assert meta.positions is not None and block == meta.tree.shape[1]
                aux.append(meta.positions)
        elif window:
            assert meta.causal, "sliding windows are causal"
            window_size = (window - 1, 0)
        out, _ = self._attend(
            q,
            fb.kv.k[layer],
            fb.kv.v[layer],
            cu_seqlens_q=meta.cu_seqlens_q,
            max_seqlen_q=meta.max_q,
            seqused_k=meta.seqused_k,
            page_table=meta.page_table,
            softmax_scale=self.shape.scale,
            causal=meta.causal,
            window_size=window_size,
            learnable_sink=sinks,
            mask_mod=mask_mod,
            aux_tensors=aux,
        )
        result: torch.Tensor = out  # [T, Hq, D]
        return result
