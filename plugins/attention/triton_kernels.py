"""The ``triton`` backend's kernels: paged attention that reads every length on the device.

One attention kernel serves every phase. A program attends one query tile of one row against
one KV head: the tile packs ``(query, head)`` pairs of the row's GQA group, flat index
``f = query * GROUP + head_in_group``, so each K/V tile is loaded once for the whole group.
The grid is ``(bs * kv_heads, query tiles, kv splits)``, fixed by host bounds; the row's
queries (``q_start``), KV length (``seq_lens``), positions and pages come from the device.

Split ``s`` of ``num_splits`` covers its share of the KV range the tile can see (rounded up to
``SPLIT_GRAIN`` positions): with several splits each writes a partial output and its log-sum-exp
(base 2), and the merge kernel combines them; with one the kernel writes the output itself.

What a query attends (the torch backend's masks, per row of KV length ``seq_len``):

    MODE_CAUSAL      kv <= position of the query
    MODE_NON_CAUSAL  kv <  seq_len (a DFlash block sees the whole row)
    MODE_TREE        kv <  seq_len - block, and block cell j where tree[row, query, j]

and, in a layer with a sliding window of ``W`` positions (``window`` > 0; causal and tree
modes), only keys less than ``W`` positions behind the query's (a tree's block cell at its
node's position, read from ``positions``): the splits share the range from the tile's
first visible key. A layer with sinks (``SINKS``) adds ``exp(sink[head])`` to each head's
softmax denominator: at the end of the only split, or in the merge of several.

NOTE: a query that sees nothing (a row of length 0) gets zeros, never NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

from outrider.plugins.attention import triton_plan as plan
from outrider.plugins.triton_launch import wait_for_previous

# Constexpr copies of the plan's constants: a kernel reads only constexpr globals.
MODE_CAUSAL = tl.constexpr(plan.MODE_CAUSAL)
MODE_NON_CAUSAL = tl.constexpr(plan.MODE_NON_CAUSAL)
MODE_TREE = tl.constexpr(plan.MODE_TREE)
SPLIT_GRAIN = tl.constexpr(plan.SPLIT_GRAIN)
LOG2_E = tl.constexpr(plan.LOG2_E)
# Integers that vary from batch to batch, which Triton would otherwise specialize on (equal to
# 1, a multiple of 16): each class a compile of its own at its first batch, while serving. The
# split count and the strides it sets (a row's log-sum-exps: ``S`` apart; a token's: ``Hq x
# S``) and a tree's width; every other integer is fixed per engine and layer.
SPLIT_COUNTED = ("num_splits", "stride_lt", "stride_lh")


@triton.jit(do_not_specialize=(*SPLIT_COUNTED, "tree_block"))
def attend_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
    page_table_ptr, slots_ptr, seq_lens_ptr, q_start_ptr, positions_ptr, tree_ptr, sinks_ptr,
    stride_qt, stride_qh,  # q: [T, Hq, D]
    stride_kp, stride_ks, stride_kh,  # k cache: [pages, page_size, Hkv, D]
    stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_os,  # out: [T, Hq, D], or partials [T, Hq, S, D]
    stride_lt, stride_lh,  # lse: [T, Hq, S] (partials only)
    stride_table,  # page table: [max_slots, max_pages]
    stride_tree_row, stride_tree_q, stride_tree_j,  # tree: [bs, max_q, block] uint8
    num_kv_heads, page_size, tree_block, scale_log2, num_splits, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, MERGED: tl.constexpr, MODE: tl.constexpr,
    SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    row = tl.program_id(0) // num_kv_heads
    kv_head = tl.program_id(0) % num_kv_heads
    split = tl.program_id(2)

    q_first = tl.load(q_start_ptr + row)
    q_len = tl.load(q_start_ptr + row + 1) - q_first
    seq_len = tl.load(seq_lens_ptr + row)
    slot = tl.load(slots_ptr + row)

    flat = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]
    query = flat // GROUP
    q_head = kv_head * GROUP + flat % GROUP
    q_ok = query < q_len
    token = q_first + query
    dim = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + q_head[:, None] * stride_qh + dim[None, :],
        mask=q_ok[:, None],
        other=0.0,
    )  # [M, D]

    position = tl.load(positions_ptr + token, mask=q_ok, other=-1)  # [M]
    kv_hi = seq_len
    if MODE == MODE_CAUSAL:
        kv_hi = tl.minimum(seq_len, tl.max(position, 0) + 1)
    kv_hi = tl.where(tl.program_id(1) * BLOCK_M < q_len * GROUP, kv_hi, 0)  # a tile past the row
    # NOTE: a runtime branch (the window's) must keep every value's type and shape: kv_base
    # takes kv_hi's integer type, the mask its full tile, a node's position the keys' type.
    kv_base = tl.zeros_like(kv_hi)
    if MODE == MODE_CAUSAL and window > 0:  # from the tile's first visible key
        first = tl.min(tl.where(q_ok, position, 2147483647))
        kv_base = tl.minimum(tl.maximum(first - window + 1, 0), kv_hi)
    chunk = tl.cdiv(tl.cdiv(kv_hi - kv_base, num_splits), SPLIT_GRAIN) * SPLIT_GRAIN
    kv_lo = kv_base + split * chunk
    kv_hi = tl.minimum(kv_hi, kv_lo + chunk)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        kv = start + offs_n  # [N]
        kv_ok = kv < kv_hi
        page = tl.load(page_table_ptr + slot * stride_table + kv // page_size, mask=kv_ok, other=0)
        within = kv % page_size
        k = tl.load(
            k_ptr
            + page[:, None].to(tl.int64) * stride_kp
            + within[:, None] * stride_ks
            + kv_head * stride_kh
            + dim[None, :],
            mask=kv_ok[:, None],
            other=0.0,
        )  # [N, D]
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2

        seen = tl.broadcast_to(kv_ok[None, :], (BLOCK_M, BLOCK_N))
        key_position = kv
        if MODE == MODE_CAUSAL:
            seen = seen & (kv[None, :] <= position[:, None])
        if MODE == MODE_TREE:
            offset = kv - (seq_len - tree_block)  # position within the block
            in_block = offset >= 0
            opened = tl.load(
                tree_ptr
                + row * stride_tree_row
                + query[:, None] * stride_tree_q
                + offset[None, :] * stride_tree_j,
                mask=q_ok[:, None] & (in_block & kv_ok)[None, :],
                other=0,
            )
            seen = seen & ((offset < 0)[None, :] | (opened != 0))
            if window > 0:  # a block cell sits at its node's position
                node = tl.load(positions_ptr + q_first + offset, mask=in_block & kv_ok, other=0)
                key_position = tl.where(in_block, node.to(tl.int32), kv)
        if window > 0:
            seen = seen & (key_position[None, :] > position[:, None] - window)
        scores = tl.where(seen, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr
            + page[:, None].to(tl.int64) * stride_vp
            + within[:, None] * stride_vs
            + kv_head * stride_vh
            + dim[None, :],
            mask=kv_ok[:, None],
            other=0.0,
        )  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(
            p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION
        )
        m_i = m_new

    if SINKS and not MERGED:  # the sink's share of the denominator (merged: in the merge)
        sink = tl.load(sinks_ptr + q_head, mask=q_ok, other=0.0).to(tl.float32) * LOG2_E
        l_i += tl.where(m_i == float("-inf"), 0.0, tl.exp2(sink - m_i))  # nothing seen: 0
    seen_any = l_i > 0
    out = acc / tl.where(seen_any, l_i, 1.0)[:, None]
    out_at = out_ptr + token[:, None] * stride_ot + q_head[:, None] * stride_oh + dim[None, :]
    if MERGED:
        tl.store(out_at + split * stride_os, out, mask=q_ok[:, None])
        lse = tl.where(seen_any, m_i + tl.log2(tl.where(seen_any, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + token * stride_lt + q_head * stride_lh + split, lse, mask=q_ok)
    else:
        tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=q_ok[:, None])


@triton.jit(do_not_specialize=SPLIT_COUNTED)
def merge_kernel(
    part_ptr, lse_ptr, out_ptr, sinks_ptr,
    stride_pt, stride_ph, stride_ps,  # partials: [T, Hq, S, D] float32
    stride_lt, stride_lh,  # lse: [T, Hq, S] float32, base 2
    stride_ot, stride_oh,  # out: [T, Hq, D]
    num_splits,
    HEAD_DIM: tl.constexpr, SINKS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)
    dim = tl.arange(0, HEAD_DIM)
    part_at = part_ptr + token * stride_pt + head * stride_ph + dim
    lse_at = lse_ptr + token * stride_lt + head * stride_lh
    top = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for split in range(num_splits):
        lse = tl.load(lse_at + split)  # -inf: the split saw nothing
        new_top = tl.maximum(top, lse)
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)
        scale, weight = tl.exp2(top - safe), tl.exp2(lse - safe)
        total = total * scale + weight
        acc = acc * scale + weight * tl.load(part_at + split * stride_ps)
        top = new_top
    if SINKS:  # one more split, of the sink's logit, attending to nothing
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2_E
        new_top = tl.maximum(top, sink)
        scale, weight = tl.exp2(top - new_top), tl.exp2(sink - new_top)
        total = total * scale + weight
        acc = acc * scale
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dim, out.to(out_ptr.dtype.element_ty))
