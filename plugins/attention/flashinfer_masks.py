"""FlashInfer's packed custom mask for a tree layout (``BatchLayout.tree_mask``), written on
the device with fixed shapes (a CUDA graph holds it).

FlashInfer reads row ``r``'s mask as ``q * kv_r`` bits, query-major (bit ``i * kv_r + j``:
query ``i`` sees KV position ``j``), little-endian within a byte, starting at byte
``indptr[r]``: every row from a byte of its own. A tree row sees its whole context (every
position before the block) and the block positions its ``tree_mask`` row sets, so most bytes
are all ones: the buffer is filled with ones, then only the bytes holding block bits are
computed, each from its 8 bits, whichever query and column they belong to.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ALL_SET = 0xFF


def mask_offsets(q: int, seq_lens: Sequence[int]) -> list[int]:
    """Where each row's bits start in the packed buffer, in bytes, and its end: ``[bs + 1]``
    (rows of ``q`` queries over ``seq_lens`` KV positions)."""
    offsets = [0]
    for kv in seq_lens:
        offsets.append(offsets[-1] + -(-q * kv // 8))
    return offsets


def mask_capacity(bs: int, q: int, max_kv: int) -> int:
    """Bytes a packed mask of ``bs`` rows of ``q`` queries over at most ``max_kv`` positions
    takes, one more for the writes that ``pack_tree_mask`` sends past every row."""
    return bs * -(-q * max_kv // 8) + 1


def pack_tree_mask(
    tree_mask: torch.Tensor, seq_lens: torch.Tensor, indptr: torch.Tensor, out: torch.Tensor
) -> None:
    """Write the packed mask of a tree layout into ``out`` ([capacity] uint8, its last byte
    a dump for writes past a row's end). ``tree_mask: [bs, q, block]`` bool: each row's
    block is its last ``block`` KV positions; ``seq_lens: [bs]`` the rows' KV lengths;
    ``indptr: [bs + 1]`` the rows' byte offsets (``mask_offsets``), on the device."""
    bs, q, block = tree_mask.shape
    device = tree_mask.device
    out.fill_(ALL_SET)
    bits = torch.arange(8, device=device)  # a byte's bit places, little-endian
    kv = seq_lens.to(torch.int64).view(bs, 1, 1, 1)
    context = kv - block  # [bs, 1, 1, 1]: positions before the block
    # Query i's block bits start at bit i * kv + context and take ``block`` bits: they touch
    # at most block // 8 + 2 bytes from the byte holding the first.
    spread = block // 8 + 2
    query = torch.arange(q, device=device).view(1, q, 1, 1)
    byte = (query * kv + context) // 8 + torch.arange(spread, device=device).view(1, 1, spread, 1)
    bit = byte * 8 + bits  # [bs, q, spread, 8]
    row_of_bit, column = bit // kv, bit % kv
    place = column - context  # the bit's place in the block; negative: context
    rows = torch.arange(bs, device=device).view(bs, 1, 1, 1).expand_as(bit)
    seen = tree_mask[rows, row_of_bit.clamp(max=q - 1), place.clamp(min=0)]
    value = (row_of_bit < q) & ((place < 0) | seen)  # bits past the row's last are never read
    packed = (value.to(torch.int32) << bits).sum(-1)  # [bs, q, spread]
    byte = byte[..., 0]
    end = (q * kv[..., 0] + 7) // 8  # [bs, 1, 1]: the row's bytes
    start = indptr[:bs].to(torch.int64).view(bs, 1, 1)
    # A byte past the row's end belongs to the next row: it goes to the dump byte. Bytes that
    # several queries touch get the same value from each (it depends on the byte alone).
    where = torch.where(byte < end, start + byte, out.shape[0] - 1)
    out.index_put_((where.reshape(-1),), packed.reshape(-1).to(torch.uint8))
