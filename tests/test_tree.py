"""Tree pieces of a speculative decode batch: geometry, selection, accept, KV moves and the
tree mask in the torch backend (against a dense reference)."""

from __future__ import annotations

import math

import pytest
import torch

from outrider.daemon.engine.accept import accept_chain, accept_tree, check_tree, tree_geometry
from outrider.plugins.attention.torch_impl import TorchAttention
from outrider.plugins.device import AttentionShape, BatchLayout, ForwardBatch, KVCache
from outrider.plugins.speculative.tree import best, path_ranks, select_tree

# One row: the root 0; nodes 1 and 2 under it, 3 under 1, 4 under 2, 5 under 3.
#        0
#      /   \
#     1     2
#     |     |
#     3     4
#     |
#     5
PARENTS = torch.tensor([[0, 0, 1, 2, 3]])


def test_geometry_gives_depths_and_ancestors() -> None:
    depth, visible = tree_geometry(PARENTS, max_depth=3)
    assert depth.tolist() == [[0, 1, 1, 2, 2, 3]]
    assert visible[0, 5].nonzero().flatten().tolist() == [0, 1, 3, 5]
    assert visible[0, 4].nonzero().flatten().tolist() == [0, 2, 4]
    assert visible[0, 0].nonzero().flatten().tolist() == [0]


def test_the_debug_check_refuses_malformed_trees() -> None:
    drafts = torch.tensor([[10, 20, 11, 21, 12]])
    check_tree(drafts, PARENTS)
    with pytest.raises(AssertionError, match="parent does not come before it"):
        check_tree(drafts, torch.tensor([[0, 0, 4, 2, 3]]))
    with pytest.raises(AssertionError, match="siblings share a token"):
        check_tree(torch.tensor([[10, 10, 11, 21, 12]]), PARENTS)


def test_accept_walks_the_matching_children() -> None:
    drafts = torch.tensor([[10, 20, 11, 21, 12]])  # tokens of nodes 1 .. 5
    # The target's choice at each node: at the root 20 (node 2), at node 2 then 21 (node 4),
    # at node 4 anything: the bonus.
    target = torch.tensor([[20, 0, 21, 0, 7, 0]])
    lens, path = accept_tree(drafts, PARENTS, target, max_depth=3)
    assert lens.tolist() == [3]
    assert path.tolist() == [[0, 2, 4, 4]]
    # Along the other branch to the deepest node, then the bonus at node 5.
    target = torch.tensor([[10, 11, 0, 12, 0, 9]])
    lens, path = accept_tree(drafts, PARENTS, target, max_depth=3)
    assert (lens.tolist(), path.tolist()) == ([4], [[0, 1, 3, 5]])
    # No child matches at the root.
    lens, path = accept_tree(drafts, PARENTS, torch.tensor([[5, 0, 0, 0, 0, 0]]), max_depth=3)
    assert (lens.tolist(), path.tolist()) == ([1], [[0, 0, 0, 0]])


def test_accept_of_a_chain_shaped_tree_is_the_chain_rule() -> None:
    gen = torch.Generator().manual_seed(0)
    drafts = torch.randint(0, 3, (64, 5), generator=gen)
    target = torch.randint(0, 3, (64, 6), generator=gen)
    chain = torch.arange(5).expand(64, 5)
    lens, path = accept_tree(drafts, chain, target, max_depth=5)
    assert torch.equal(lens, accept_chain(drafts, target))
    assert torch.equal(path, torch.minimum(torch.arange(6), (lens - 1).unsqueeze(1)))


def test_best_breaks_ties_by_index() -> None:
    scores = torch.tensor([[-1.0, -0.5, -1.0, -0.5, -2.0]])
    assert best(scores, 4).tolist() == [[1, 3, 0, 2]]


def test_selected_trees_are_ancestor_closed_under_ties() -> None:
    # Candidates 0, 1: the root's children; 2 .. 5: children of 0 and 1 with log-prob 0, so
    # they tie with their parents. The chosen nodes' parents are always chosen.
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15]])
    scores = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -1.0, -1.0]])
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1]])
    for size in range(1, 7):
        drafts, node_parents, ranks = select_tree(tokens, scores, parents, size)
        assert drafts.tolist() == [tokens[0, :size].tolist()]
        assert ranks.tolist() == [list(range(size))]  # ties: by candidate index
        chosen = drafts[0].tolist()
        for node, parent in enumerate(node_parents[0].tolist(), start=1):
            assert parent < node
            expected = parents[0, tokens[0].tolist().index(chosen[node - 1])].item()
            assert parent == (0 if expected < 0 else chosen.index(10 + expected) + 1)
    # Distinct scores: the best three are 1, its child 4, then 0; nodes in generation order.
    scores = torch.tensor([[-0.2, -0.1, -0.9, -0.8, -0.15, -0.7]])
    drafts, node_parents, ranks = select_tree(tokens, scores, parents, 3)
    assert drafts.tolist() == [[10, 11, 14]]
    assert node_parents.tolist() == [[0, 0, 2]]
    assert ranks.tolist() == [[2, 0, 1]]  # 10 third, 11 best, 14 second


def test_path_ranks_are_the_worst_rank_so_far_along_the_path() -> None:
    """Nodes ranked 2, 0, 1, 3 by score; a path root -> 2 -> 3 -> 4 meets ranks 0, 1, 3, and
    root -> 1 -> 2 ranks 2, 0: worst so far 2, 2 (a tree of the best two nodes lacks node 1,
    so it accepts nothing of that path)."""
    ranks = torch.tensor([[2, 0, 1, 3], [2, 0, 1, 3]])
    path = torch.tensor([[0, 2, 3, 4], [0, 1, 2, 2]])
    assert path_ranks(ranks, path).tolist() == [[0, 1, 3], [2, 2, 2]]


def test_kv_move_reads_every_source_before_writing() -> None:
    kv = KVCache.allocate(
        2, 3, 4, AttentionShape(1, 1, 2, 1.0, torch.float32), torch.float32, torch.device("cpu")
    )
    for cache in (*kv.k, *kv.v):
        cache.copy_(torch.arange(24.0).view(3, 4, 1, 2))
    # 5 -> 4 and 6 -> 5: slot 5 is both a source and a destination.
    kv.move(torch.tensor([5, 6]), torch.tensor([4, 5]))
    for cache in (*kv.k, *kv.v):
        flat = cache.view(12, 2)[:, 0].tolist()
        assert flat[4:7] == [10.0, 12.0, 12.0]


def test_kv_move_takes_the_window_layers_through_their_map() -> None:
    """Layer 1 (a window of 2) keeps its K/V in two window pages: page 1 sits in window page
    1, page 2 in window page 0 (the scratch: behind every window); a move of page 1's
    positions lands in each layer's own space."""
    shape = AttentionShape(1, 1, 2, 1.0, torch.float32, windows=(0, 2))
    kv = KVCache.allocate(2, 3, 4, shape, torch.float32, torch.device("cpu"), window_pages=2)
    assert kv.window_map is not None and kv.num_pages == 3
    kv.window_map.copy_(torch.tensor([0, 1, 0]))
    assert [c.shape[0] for c in kv.k] == [3, 2]
    full, window = kv.k
    full.copy_(torch.arange(24.0).view(3, 4, 1, 2))
    window.copy_(100 + torch.arange(16.0).view(2, 4, 1, 2))
    kv.move(torch.tensor([5, 6]), torch.tensor([4, 5]))  # within page 1
    assert full.view(12, 2)[4:7, 0].tolist() == [10.0, 12.0, 12.0]
    assert window.view(8, 2)[4:7, 0].tolist() == [110.0, 112.0, 112.0]
    assert kv.translate(torch.tensor([4, 9])).tolist() == [4, 1]


@pytest.mark.parametrize(
    ("window", "mapped"), [(0, False), (2, False), (2, True)],
    ids=["full", "window-2", "window-2-in-window-pages"],
)  # fmt: skip
@pytest.mark.parametrize("page_size", [1, 4])
def test_torch_backend_tree_mask_matches_dense(page_size: int, window: int, mapped: bool) -> None:
    """Two rows of different committed lengths verify the same 6-node tree: each node's
    output equals dense attention over the prefix, its ancestors and itself; in a sliding
    window of 2 only over those at most one position back (a node at its depth's position:
    a grandparent is out of it though its KV slot may be near). ``mapped``: the layer in
    window pages (``KVCache.window_map``), shuffled, those behind the window the scratch."""
    heads, dim, width = 2, 8, 6
    seqs = [5, 9]
    gen = torch.Generator().manual_seed(1)
    depth, visible = tree_geometry(PARENTS.expand(2, -1), max_depth=3)
    max_pages = (max(seqs) + width + page_size - 1) // page_size
    shape = AttentionShape(heads, heads, dim, dim**-0.5, torch.float32, windows=(window,))
    num_pages = 1 + 2 * max_pages
    kv = KVCache.allocate(
        1, num_pages, page_size, shape, torch.float32, torch.device("cpu"),
        window_pages=num_pages if mapped else None,
    )  # fmt: skip
    table = torch.zeros(2, max_pages, dtype=torch.int32)
    table[0] = torch.arange(1, 1 + max_pages)
    table[1] = torch.arange(1 + max_pages, 1 + 2 * max_pages).flip(0)  # scattered pages
    if kv.window_map is not None:
        kv.window_map[1:] = torch.randperm(num_pages - 1, generator=gen) + 1
        for row, seq in enumerate(seqs):  # pages wholly before the first position read
            kv.window_map[table[row, : (seq - window + 1) // page_size].long()] = 0
    prefix_k = [torch.randn(s, heads, dim, generator=gen) for s in seqs]
    prefix_v = [torch.randn(s, heads, dim, generator=gen) for s in seqs]
    for row, seq in enumerate(seqs):
        pos = torch.arange(seq)
        loc = table[row, pos // page_size].long() * page_size + pos % page_size
        if kv.window_map is not None:
            loc = kv.translate(loc)
        kv.k[0].view(-1, heads, dim)[loc] = prefix_k[row]
        kv.v[0].view(-1, heads, dim)[loc] = prefix_v[row]
    seq_t = torch.tensor(seqs)
    slots_kv = seq_t.unsqueeze(1) + torch.arange(width)  # [2, W]: KV slots
    out_loc = table[torch.arange(2).unsqueeze(1), slots_kv // page_size].long() * page_size
    out_loc = (out_loc + slots_kv % page_size).view(-1)
    q = torch.randn(2 * width, heads, dim, generator=gen)
    k = torch.randn(2 * width, heads, dim, generator=gen)
    v = torch.randn(2 * width, heads, dim, generator=gen)
    layout = BatchLayout(
        page_table=table,
        page_size=page_size,
        slots=torch.arange(2),
        positions=(seq_t.unsqueeze(1) + depth).view(-1),
        out_loc=out_loc,
        q_start=torch.arange(3) * width,
        seq_lens=seq_t + width,
        q_pad_index=torch.arange(2 * width),
        bs=2,
        max_q=width,
        max_kv=max(seqs) + width,
        tree_mask=visible,
    )
    fb = ForwardBatch.bind(layout, TorchAttention(shape, None, q.device), kv)
    out = fb.attend(0, q, k, v).view(2, width, heads, dim)
    for row in range(2):
        for node in range(width):
            ancestors = visible[row, node].nonzero().flatten()
            positions = torch.cat([torch.arange(seqs[row]), seqs[row] + depth[row, ancestors]])
            near = positions > seqs[row] + depth[row, node] - window if window else positions >= 0
            seen = ancestors + row * width
            keys = torch.cat([prefix_k[row], k[seen]])[near]  # [n, heads, dim]
            values = torch.cat([prefix_v[row], v[seen]])[near]
            assert window == 0 or len(keys) < seqs[row] + len(seen)  # the window cut some
            scores = torch.einsum("hd,nhd->hn", q[row * width + node], keys) / math.sqrt(dim)
            expected = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
            torch.testing.assert_close(out[row, node], expected)
