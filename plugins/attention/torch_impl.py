"""``torch`` attention: gather each row's paged K/V into a padded grid and run SDPA.

Work is sized by the host-known bounds ``bs x max_q x max_kv``; validity comes from the device
tensors only (no host sync). Grid cells past a row's length are masked out, so the gathered
values there are never read; they must still be finite (0 x NaN is NaN), which holds because
KVCache pages start zeroed and only ever receive K/V.

Sliding windows (``AttentionShape.windows``): a mask per window size, the causal (or tree) mask
narrowed to the keys less than a window behind the query's position (a tree's node at its
depth's position, not its KV slot's). Sinks: the softmax over each
head's scores and its sink logit, computed here (SDPA takes no extra logit), the sink's share
dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from outrider.plugins.attention.base import AttentionBackend
from outrider.plugins.device import AttentionShape, BatchLayout, ForwardBatch


@dataclass(frozen=True)
class TorchAttentionMetadata:
    kv_index: torch.Tensor  # [bs, max_kv] int64: flat KV index of each row's logical position
    mask: torch.Tensor  # [bs, 1, max_q, max_kv] bool: True = attend
    # Per sliding window of the shape, the mask within it.
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)


class TorchAttention(AttentionBackend):
    windows_and_sinks = True

    def __init__(self, shape: AttentionShape, options: Any, device: torch.device) -> None:
        super().__init__(shape, options, device)
        if device.type == "cuda":
            # NOTE: SDPA prefers cuDNN for masked attention, and cuDNN builds an execution
            # plan on the host for every new shape: the KV bound grows every step, so each
            # call paid 1.3 ms (5 ms with a tree mask) of host time on an H100. The
            # memory-efficient kernel takes the same masks with no planning. Process-wide:
            # the daemon's attention is this backend's when it is loaded.
            torch.backends.cuda.enable_cudnn_sdp(False)

    def build(self, layout: BatchLayout) -> TorchAttentionMetadata:
        device = layout.positions.device
        page_size = layout.page_size
        kv_pos = torch.arange(layout.max_kv, device=device)  # [max_kv]
        # Positions past the table width (max_kv is only a bound) read its last column;
        # the mask hides them.
        page_col = (kv_pos // page_size).clamp_(max=layout.page_table.shape[1] - 1)
        pages = layout.page_table[layout.slots][:, page_col].long()  # [bs, max_kv]
        kv_index = pages * page_size + kv_pos % page_size  # [bs, max_kv]

        q_pos = torch.full((layout.bs * layout.max_q,), -1, dtype=torch.long, device=device)
        q_pos[layout.q_pad_index] = layout.positions
        q_pos = q_pos.view(layout.bs, layout.max_q, 1)  # [bs, max_q, 1]; -1: padding
        is_query = q_pos >= 0
        if layout.tree_mask is not None:
            mask = self._tree_mask(layout, kv_pos)
        elif layout.causal:
            mask = kv_pos <= q_pos  # [bs, max_q, max_kv]
        else:
            mask = (kv_pos < layout.seq_lens.view(layout.bs, 1, 1)).expand(
                layout.bs, layout.max_q, layout.max_kv
            )

        def finite(cells: torch.Tensor) -> torch.Tensor:
            # Padded query cells see kv 0 only, so their softmax has a finite row (no NaN).
            return torch.where(is_query, cells, kv_pos == 0).unsqueeze(1)

        windowed = {}
        windows = sorted({w for w in self.shape.windows if w})
        if windows:
            assert layout.causal, "sliding windows are causal"
            key_pos = self._key_positions(layout, kv_pos, q_pos).unsqueeze(1)  # [bs, 1, max_kv]
        for window in windows:
            windowed[window] = finite(mask & (key_pos > q_pos - window))
        return TorchAttentionMetadata(kv_index=kv_index, mask=finite(mask), windowed=windowed)

    @staticmethod
    def _key_positions(
        layout: BatchLayout, kv_pos: torch.Tensor, q_pos: torch.Tensor
    ) -> torch.Tensor:
        """``[bs, max_kv]``: the position of each KV cell: its index, but in a tree's block,
        whose node ``j`` (a query of the row too) sits at its depth's position."""
        key_pos = kv_pos.expand(layout.bs, layout.max_kv)
        if layout.tree_mask is None:
            return key_pos
        block = layout.tree_mask.shape[-1]
        offset = key_pos - (layout.seq_lens - block).view(layout.bs, 1)  # [bs, max_kv]
        node = q_pos[:, :, 0].gather(1, offset.clamp(0, block - 1))
        return torch.where((offset >= 0) & (offset < block), node, key_pos)

    @staticmethod
    def _tree_mask(layout: BatchLayout, kv_pos: torch.Tensor) -> torch.Tensor:
        """``[bs, max_q, max_kv]``: the prefix before each row's block, and the block's cells
        that ``layout.tree_mask`` opens."""
        tree = layout.tree_mask
        assert tree is not None
        block = tree.shape[-1]
        start = (layout.seq_lens - block).view(layout.bs, 1, 1)  # [bs, 1, 1]
        offset = kv_pos - start  # [bs, 1, max_kv]: position within the block
        in_block = (offset >= 0) & (offset < block)
        opened = tree.gather(
            2, offset.clamp(0, block - 1).expand(layout.bs, layout.max_q, layout.max_kv)
        )
        return (offset < 0) | (in_block & opened)

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
        assert isinstance(meta, TorchAttentionMetadata), "metadata built by another backend"
        layout = fb.layout
        fb.kv.store(layer, layout.out_loc, k, v)
        num_q_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], k.shape[2]
        k_cache = fb.kv.k[layer].view(-1, num_kv_heads, head_dim)  # [pages * page_size, Hkv, D]
        v_cache = fb.kv.v[layer].view(-1, num_kv_heads, head_dim)

        # GQA by repeating K/V: SDPA's enable_gqa is served only by the flash kernel (no
        # masks) and the math one; repeated heads let CUDA pick memory-efficient attention.
        groups = num_q_heads // num_kv_heads
        keys = k_cache[meta.kv_index].transpose(1, 2)  # [bs, Hkv, max_kv, D]
        values = v_cache[meta.kv_index].transpose(1, 2)
        if groups > 1:
            keys = keys.repeat_interleave(groups, dim=1)  # [bs, Hq, max_kv, D]
            values = values.repeat_interleave(groups, dim=1)

        bs, max_q = layout.bs, layout.max_q
        q_grid = q.new_zeros(bs * max_q, num_q_heads, head_dim)
        q_grid[layout.q_pad_index] = q
        q_grid = q_grid.view(bs, max_q, num_q_heads, head_dim).transpose(1, 2)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        window = self.shape.window(layer)
        mask = meta.windowed[window] if window else meta.mask
        if sinks is None:
            out = F.scaled_dot_product_attention(
                q_grid, keys, values, attn_mask=mask, scale=self.shape.scale
            )  # [bs, Hq, max_q, D]
        else:
            out = _attend_with_sinks(q_grid, keys, values, mask, self.shape.scale, sinks)
        out = out.transpose(1, 2).reshape(bs * max_q, num_q_heads, head_dim)
        return out[layout.q_pad_index]  # [T, Hq, D]


def _attend_with_sinks(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """``q: [bs, H, max_q, D]`` over ``keys, values: [bs, H, max_kv, D]`` where ``mask``
    allows, each head's softmax taking its sink logit (``sinks: [H]``) beside the scores."""
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [bs, H, max_q, max_kv]
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)
