"""The ``flashinfer`` attention backend: its page lists (CPU), its kernels against the torch
backend over the same paged cache, and the engine under CUDA graphs (GPU)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from engine_harness import engine_for, request, run, tokens_of
from model_fixtures import PagedRows, torch_backend

from outrider.daemon.engine.build import Engine
from outrider.daemon.family import embedded_family
from outrider.plugins.api import NoOptions
from outrider.plugins.attention.flashinfer_impl import PageLists, _HostPlan, fill_page_lists
from outrider.plugins.attention.flashinfer_masks import (
    mask_capacity,
    mask_offsets,
    pack_tree_mask,
)
from outrider.plugins.device import AttentionShape, BatchLayout, ForwardBatch, HostLengths

PAGE = 4
# Slot -> its pages; row r of the batch runs slot SLOTS[r].
TABLE = torch.tensor(
    [[9, 8, 7, 6, 5], [1, 2, 3, 4, 10], [11, 12, 13, 14, 15], [16, 17, 18, 19, 20]],
    dtype=torch.int32,
)
SLOTS = [2, 0, 3]
SEQ_LENS = [5, 1, 16]


def _layout(seq_lens: list[int], slots: list[int]) -> BatchLayout:
    def longs(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long)

    bs = len(slots)
    return BatchLayout(
        page_table=TABLE,
        page_size=PAGE,
        slots=longs(slots),
        positions=longs([n - 1 for n in seq_lens]),
        out_loc=longs([0] * bs),
        q_start=longs(list(range(bs + 1))),
        seq_lens=longs(seq_lens),
        q_pad_index=longs(list(range(bs))),
        bs=bs,
        max_q=1,
        max_kv=max(seq_lens),
        host=HostLengths((1,) * bs, tuple(seq_lens)),
    )


def _lists(capacity: int, bs: int) -> PageLists:
    return PageLists(
        indptr=torch.full((bs + 1,), -1, dtype=torch.int32),
        indices=torch.full((capacity,), -1, dtype=torch.int32),
        last_page_len=torch.full((bs,), -1, dtype=torch.int32),
    )


def test_page_lists_are_each_rows_pages_in_order() -> None:
    layout = _layout(SEQ_LENS, SLOTS)
    lists = _lists(7, 3)
    fill_page_lists(layout, lists)
    assert lists.indptr.tolist() == [0, 2, 3, 7]
    assert lists.indices.tolist() == [11, 12, 9, 16, 17, 18, 19]
    assert lists.last_page_len.tolist() == [1, 1, 4]
    host = _HostPlan.of(HostLengths((1, 1, 1), tuple(SEQ_LENS)), PAGE)
    assert torch.equal(host.kv_indptr, lists.indptr)
    assert torch.equal(host.last_page_len, lists.last_page_len)
    assert host.qo_indptr.tolist() == [0, 1, 2, 3]


def test_graph_page_lists_past_the_last_row_repeat_valid_pages() -> None:
    """A graph's index buffer is sized for its bound; the entries past ``indptr[-1]`` are
    never read, but they must still be page ids of the table (no garbage gathers)."""
    lists = _lists(12, 2)
    fill_page_lists(_layout([6, 3], [1, 0]), lists)
    assert lists.indptr.tolist() == [0, 2, 3]
    assert lists.indices.tolist()[:3] == [1, 2, 9]
    assert set(lists.indices.tolist()[3:]) <= set(TABLE.flatten().tolist())


def test_host_plan_counts_queries_for_prompt_chunks() -> None:
    host = _HostPlan.of(HostLengths((3, 5), (7, 5)), PAGE)
    assert host.qo_indptr.tolist() == [0, 3, 8]
    assert host.kv_indptr.tolist() == [0, 2, 4]
    assert host.last_page_len.tolist() == [3, 1]


@pytest.mark.parametrize(("queries", "block"), [(1, 1), (6, 6), (3, 9), (16, 16), (5, 21)])
def test_packed_tree_masks_are_each_rows_bits_from_a_byte_of_its_own(
    queries: int, block: int
) -> None:
    """``pack_tree_mask`` writes, for each row, the ``queries x kv`` matrix (context all set,
    then the row's tree mask) as numpy packs it little-endian, from the row's byte offset on;
    rows of lengths that are and are not multiples of 8 side by side."""
    gen = torch.Generator().manual_seed(queries * 100 + block)
    seq_lens = [block, block + 1, block + 7, block + 8, block + 37]
    tree = torch.rand(len(seq_lens), queries, block, generator=gen) < 0.5
    offsets = mask_offsets(queries, seq_lens)
    out = torch.zeros(mask_capacity(len(seq_lens), queries, max(seq_lens) + 5), dtype=torch.uint8)
    indptr = torch.tensor(offsets, dtype=torch.int32)
    pack_tree_mask(tree, torch.tensor(seq_lens), indptr, out)
    for row, kv in enumerate(seq_lens):
        full = torch.ones(queries, kv, dtype=torch.bool)
        full[:, kv - block :] = tree[row]
        want = np.packbits(full.flatten().numpy(), bitorder="little")
        assert offsets[row + 1] - offsets[row] == len(want)
        assert out[offsets[row] : offsets[row + 1]].tolist() == want.tolist(), row


# GPU --------------------------------------------------------------------------------------

CUDA = torch.device("cuda")
SHAPE = AttentionShape(32, 8, 128, 128**-0.5, torch.bfloat16)


def _qkv(tokens: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Random q, k and v of ``tokens`` tokens in ``SHAPE``'s heads, bfloat16, on the GPU."""
    return [
        torch.randn(tokens, heads, 128, generator=gen, device=CUDA).bfloat16()
        for heads in (32, 8, 8)
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_attention_matches_torch(page_size: int) -> None:
    """Prompt chunks over a cached prefix, then decode steps, for rows of different lengths:
    FlashInfer's output against SDPA's over the same cache, within bf16 rounding."""
    pytest.importorskip("flashinfer")
    from outrider.plugins.attention.flashinfer_impl import FlashInferAttention

    fused = FlashInferAttention(SHAPE, NoOptions(), CUDA)
    reference = torch_backend(SHAPE, CUDA)
    rows = PagedRows(
        num_layers=1, shape=SHAPE, page_size=page_size, max_len=600, dtype=torch.bfloat16,
        device=CUDA,
    )  # fmt: skip
    gen = torch.Generator(device=CUDA).manual_seed(0)
    prompts = {0: 37, 3: 300, 5: 9}
    steps: list[dict[int, int]] = [
        {slot: n // 2 for slot, n in prompts.items()},  # first chunks
        {slot: n - n // 2 for slot, n in prompts.items()},  # the rest, over the cached prefix
    ] + [dict.fromkeys(prompts, 1)] * 4  # decode steps
    for step in steps:
        batch = [(slot, [5] * count) for slot, count in step.items()]
        _, fb = rows.batch(reference, batch, exact=True)
        q, k, v = _qkv(fb.layout.num_tokens, gen)
        want = reference.forward(0, q, k, v, fb)
        got = fused.forward(0, q, k, v, ForwardBatch.bind(fb.layout, fused, fb.kv))
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("riders", ["flashinfer", "triton"])
def test_a_prompt_batch_and_its_riders_match_torch(riders: str) -> None:
    """Prompt chunks (one over a cached prefix) with 40 riders of one token over contexts of
    20 to 600 behind them: FlashInfer's prefill over the prompt rows and the riders' own
    backend (FlashInfer's decode, or Triton's) against SDPA over the batch whole, within bf16
    rounding."""
    pytest.importorskip("flashinfer")
    from outrider.plugins.attention.flashinfer_impl import FlashInferAttention
    from outrider.plugins.attention.triton_backend import TritonOptions
    from outrider.plugins.attention.triton_impl import TritonAttention

    fused = FlashInferAttention(SHAPE, NoOptions(), CUDA)
    decode = fused if riders == "flashinfer" else TritonAttention(SHAPE, TritonOptions(), CUDA)
    reference = torch_backend(SHAPE, CUDA)
    rows = PagedRows(
        num_layers=1, shape=SHAPE, page_size=16, max_len=700, max_slots=48,
        dtype=torch.bfloat16, device=CUDA,
    )  # fmt: skip
    gen = torch.Generator(device=CUDA).manual_seed(0)

    contexts = {slot: 20 + 15 * (slot - 8) for slot in range(8, 48)}
    _, fb = rows.batch(reference, [(1, [5] * 100), *((s, [5] * n) for s, n in contexts.items())])
    reference.forward(0, *_qkv(fb.layout.num_tokens, gen), fb)  # the contexts' K/V
    batch = [(0, [5] * 77), (1, [5] * 33), *((slot, [5]) for slot in contexts)]
    _, fb = rows.batch(reference, batch, exact=True)
    q, k, v = _qkv(fb.layout.num_tokens, gen)
    want = reference.forward(0, q, k, v, fb)
    split = ForwardBatch.bind(fb.layout, fused, fb.kv, riders=decode)
    assert split.parts is not None and split.parts[1].layout.bs == len(contexts)
    got = split.attend(0, q, k, v)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(("queries", "block"), [(6, 6), (3, 9)], ids=["verify", "draft step"])
def test_flashinfer_trees_and_blocks_match_torch(queries: int, block: int) -> None:
    """Rows of ``queries`` tokens at the end of their KV: under a tree mask over their last
    ``block`` positions (a tree's verify, and a tree draft step seeing earlier steps' nodes),
    and non-causally (DFlash's block), FlashInfer's output against SDPA's, batch after batch
    (the eager tree sites are reused and grown), within bf16 rounding."""
    pytest.importorskip("flashinfer")
    from outrider.plugins.attention.flashinfer_impl import FlashInferAttention

    fused = FlashInferAttention(SHAPE, NoOptions(), CUDA)
    reference = torch_backend(SHAPE, CUDA)
    rows = PagedRows(
        num_layers=1, shape=SHAPE, page_size=16, max_len=900, dtype=torch.bfloat16,
        device=CUDA,
    )  # fmt: skip
    gen = torch.Generator(device=CUDA).manual_seed(0)

    prompts = {0: 37, 3: 300, 5: 9 + block, 6: 700}
    _, fb = rows.batch(reference, [(slot, [5] * n) for slot, n in prompts.items()])
    reference.forward(0, *_qkv(fb.layout.num_tokens, gen), fb)  # the context's K/V
    for step in range(3):
        # The block's earlier nodes (block > queries: a draft step's) are stored already.
        batch = [(slot, [5] * queries) for slot in prompts]
        _, fb = rows.batch(reference, batch, kv_slack=400 * step, exact=True)
        q, k, v = _qkv(fb.layout.num_tokens, gen)
        bs = len(prompts)
        lower = torch.ones(queries, block, dtype=torch.bool, device=CUDA).tril(block - queries)
        seen = torch.rand(bs, queries, block, generator=gen, device=CUDA) < 0.5
        itself = torch.arange(queries, device=CUDA)
        diagonal = torch.zeros(queries, block, dtype=torch.bool, device=CUDA)
        diagonal[itself, block - queries + itself] = True
        tree = (seen & lower) | diagonal  # ancestors and itself
        for layout in (
            dataclasses.replace(fb.layout, tree_mask=tree),
            dataclasses.replace(fb.layout, causal=False),
        ):
            want = reference.forward(0, q, k, v, ForwardBatch.bind(layout, reference, fb.kv))
            got = fused.forward(0, q, k, v, ForwardBatch.bind(layout, fused, fb.kv))
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_the_engine_serves_with_flashinfer_graphs_as_eagerly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The embedded target in bf16 with flashinfer for prompts and decode, every launch under
    the sync check: decode graphs (planned on the host before each replay) give exactly the
    tokens of eager decoding with the same kernels, for batches of changing size."""
    pytest.importorskip("flashinfer")
    monkeypatch.setenv("OUTRIDER_DEBUG_SYNC_CHECK", "1")
    family = embedded_family()
    assert family is not None, "the family package is installed with the test extra"
    target = str(family.target)
    prompts = [[3 + (7 * i + 3 * j) % 4000 for j in range(5 + 9 * i)] for i in range(10)]
    requests = [request(i, p, max_new_tokens=20 + 3 * i) for i, p in enumerate(prompts)]

    def serve(**overrides: object) -> dict[int, list[int]]:
        engine = engine_for(
            target, device="cuda", dtype="bfloat16", attention_backend="flashinfer",
            speculative_algorithm="none", max_running=12, **overrides,
        )  # fmt: skip
        return tokens_of(run(engine, requests, stagger=2))

    graphed = serve()
    assert graphed == serve(disable_cuda_graph=True)
    assert {rid: len(tokens) for rid, tokens in graphed.items()} == {
        i: 20 + 3 * i for i in range(10)
    }


# Speculative engines wholly on FlashInfer: DFlash (its chains' verify and its drafts'
# non-causal blocks), an EAGLE-3 tree (custom masks in the verify and the draft's steps), and
# an EAGLE-3 chain whose acceptance policy runs plain steps between drafting ones (the
# draft's deferred catch-ups, graphed whole or in pieces).
CYCLES: dict[str, dict[str, object]] = {
    "dflash": {"speculative_algorithm": "dflash"},
    "eagle3 tree": {"speculative_algorithm": "eagle3", "speculative_num_steps": 3,
                    "speculative_topk": 2, "speculative_num_draft_tokens": 6},
    "eagle3 chain, plain steps": {"speculative_algorithm": "eagle3",
                                  "speculative_min_acceptance": 2.5},
}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("cycle", CYCLES)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_flashinfer_runs_speculative_cycles_graphed_as_eagerly(
    overlap: bool, cycle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded family in bf16, FlashInfer in the cycle (module ``CYCLES``), every launch
    under the sync check: cycles replayed from graphs, each forward planned from the exact
    lengths the host waited for, give exactly the tokens of eager cycles with the same
    kernels, for batches of changing size."""
    pytest.importorskip("flashinfer")
    # The same kernels: the layers' plain torch ops in both (graphs being built would run the
    # Triton GEMV where eager batches run cuBLAS, which round differently).
    monkeypatch.setenv("OUTRIDER_DEBUG_TORCH_KERNELS", "1")
    monkeypatch.setenv("OUTRIDER_DEBUG_SYNC_CHECK", "1")
    family = embedded_family()
    assert family is not None, "the family package is installed with the test extra"
    settings = CYCLES[cycle]
    draft = family.drafts[str(settings["speculative_algorithm"])]
    prompts = [[3 + (5 * i + 7 * j) % 4000 for j in range(4 + 11 * i)] for i in range(8)]
    requests = [request(i, p, max_new_tokens=24 + 5 * i) for i, p in enumerate(prompts)]

    def serve(**overrides: object) -> tuple[dict[int, list[int]], Engine]:
        engine = engine_for(
            str(family.target), device="cuda", dtype="bfloat16", attention_backend="flashinfer",
            draft_model=str(draft), no_overlap=not overlap, max_running=8,
            **settings, **overrides,
        )  # fmt: skip
        assert engine.loop.runner.host_starts is not None
        return tokens_of(run(engine, requests, stagger=2)), engine

    graphed, engine = serve()
    assert graphed == serve(disable_cuda_graph=True)[0]
    assert {rid: len(t) for rid, t in graphed.items()} == {i: 24 + 5 * i for i in range(8)}
    graphs = engine.loop.runner.graphs
    assert graphs is not None
    if "speculative_min_acceptance" in settings:  # deferred catch-ups replayed from graphs
        assert graphs.catch_up_replays > 0
