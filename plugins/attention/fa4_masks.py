"""The ``fa4`` backend's tree mask: a CuTe DSL ``mask_mod`` that FA4 compiles into its kernel
(imported only where FA4 runs: it needs ``cutlass``).

FA4 calls a mask_mod per score with the row (``batch``), the query's index within its row and
the KV position, and keeps the score where it returns True. A tree row attends (the torch
backend's ``_tree_mask``):

    kv <  seq_len - block                                  its prefix, every position
    kv == seq_len - block + j, j < block                   where tree[row, query, j]

and in a layer of a sliding window of ``W`` positions, of those only the keys whose position
is more than ``query position - W``: a prefix key's position is its index, block cell ``j``'s
its node's, the position of the row's query ``j`` (FA4 applies no window of its own where a
mask_mod is given).

``block`` and ``window`` are compile-time constants (one kernel per block width, a verify's N
and each tree drafting step's nodes so far, and per window); ``tree`` (``aux_tensors[0]``,
int32 ``[bs, max_q, block]``), the query positions (``aux_tensors[1]``, int32 ``[bs,
max_q]``, where windowed) and ``seq_len`` (``seqused_k``) are read on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import cutlass
import cutlass.cute as cute
from flash_attn.cute import utils


@cache
def tree_mask_mod(block: int, window: int = 0) -> Callable[..., Any]:
    """The mask_mod of trees whose blocks hold ``block`` positions, within a sliding window
    of ``window`` positions (0: none); one function per pair (FA4 keys its compiled kernels by
    the function's code and closure)."""

    @cute.jit
    def tree_mask(
        batch: cute.TensorSSA,
        head: cute.TensorSSA,
        q_idx: cute.TensorSSA,
        kv_idx: cute.TensorSSA,
        seqlen_info: Any,
        aux_tensors: list[cute.Tensor],
    ) -> cute.TensorSSA:
        tree = aux_tensors[0]
        prefix = seqlen_info.seqlen_k - block
        # NOTE: FA4 asks about whole tiles, past the row's queries and KV too (their scores are
        # dropped): clamp both indices into the tree before reading it.
        query = cutlass.min(q_idx[0], seqlen_info.seqlen_q - 1)
        cell = cutlass.min(cutlass.max(kv_idx[0] - prefix, 0), block - 1)
        opened = cute.make_rmem_tensor(1, cutlass.Int32)
        opened[0] = tree[batch[0], query, cell]
        in_prefix = kv_idx < utils.scalar_to_ssa(prefix, cutlass.Int32)
        return in_prefix | (opened.load() > utils.scalar_to_ssa(0, cutlass.Int32))

    @cute.jit
    def windowed_tree_mask(
        batch: cute.TensorSSA,
        head: cute.TensorSSA,
        q_idx: cute.TensorSSA,
        kv_idx: cute.TensorSSA,
        seqlen_info: Any,
        aux_tensors: list[cute.Tensor],
    ) -> cute.TensorSSA:
        tree, positions = aux_tensors[0], aux_tensors[1]
        prefix = seqlen_info.seqlen_k - block
        query = cutlass.min(q_idx[0], seqlen_info.seqlen_q - 1)  # clamped as tree_mask's
        cell = cutlass.min(cutlass.max(kv_idx[0] - prefix, 0), block - 1)
        opened = cute.make_rmem_tensor(1, cutlass.Int32)
        opened[0] = tree[batch[0], query, cell]
        # The first key position the query sees, and the position of the block cell asked.
        first = cute.make_rmem_tensor(1, cutlass.Int32)
        first[0] = positions[batch[0], query] - (window - 1)
        node = cute.make_rmem_tensor(1, cutlass.Int32)
        node[0] = positions[batch[0], cell]
        start = utils.scalar_to_ssa(prefix, cutlass.Int32)
        near_prefix = (kv_idx < start) & (kv_idx >= first.load())
        is_open = opened.load() > utils.scalar_to_ssa(0, cutlass.Int32)
        near_block = (kv_idx >= start) & is_open & (node.load() >= first.load())
        return near_prefix | near_block

    return windowed_tree_mask if window else tree_mask
