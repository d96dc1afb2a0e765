"""The ``flashinfer`` attention backend: its page lists (CPU), its kernels against the torch
backend over the same paged cache, and the engine under CUDA graphs (GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_harness import engine_for, request, run, tokens_of
from model_fixtures import PagedRows, torch_backend

from outrider.daemon.family import embedded_family
from outrider.plugins.api import NoOptions
from outrider.plugins.attention.flashinfer_impl import PageLists, _HostPlan, fill_page_lists
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


# GPU --------------------------------------------------------------------------------------

CUDA = torch.device("cuda")
SHAPE = AttentionShape(32, 8, 128, 128**-0.5, torch.bfloat16)


def _with_host(fb: ForwardBatch, backend: object, q_lens: list[int]) -> ForwardBatch:
    lens = fb.layout.seq_lens.tolist()
    layout = dataclasses.replace(fb.layout, host=HostLengths(tuple(q_lens), tuple(lens)))
    return ForwardBatch.bind(layout, backend, fb.kv)  # type: ignore[arg-type]


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
        _, fb = rows.batch(reference, batch)
        tokens = fb.layout.num_tokens
        q, k, v = (
            torch.randn(tokens, heads, 128, generator=gen, device=CUDA).bfloat16()
            for heads in (32, 8, 8)
        )
        want = reference.forward(0, q, k, v, fb)
        got = fused.forward(0, q, k, v, _with_host(fb, fused, list(step.values())))
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


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_flashinfer_verifies_speculative_chains(
    overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded family with DFlash in bf16, flashinfer verifying (the draft on torch):
    cycles replayed from graphs, each planned from the exact lengths the host waited for, give
    exactly the tokens of eager cycles with the same kernels, for batches of changing size."""
    pytest.importorskip("flashinfer")
    # The same kernels: the layers' plain torch ops in both (graphs being built would run the
    # Triton GEMV where eager batches run cuBLAS, which round differently).
    monkeypatch.setenv("OUTRIDER_DEBUG_TORCH_KERNELS", "1")
    family = embedded_family()
    assert family is not None, "the family package is installed with the test extra"
    prompts = [[3 + (5 * i + 7 * j) % 4000 for j in range(4 + 11 * i)] for i in range(8)]
    requests = [request(i, p, max_new_tokens=24 + 5 * i) for i, p in enumerate(prompts)]

    def serve(**overrides: object) -> dict[int, list[int]]:
        engine = engine_for(
            str(family.target), device="cuda", dtype="bfloat16", attention_backend="flashinfer",
            draft_attention_backend="torch", speculative_algorithm="dflash",
            draft_model=str(family.drafts["dflash"]), no_overlap=not overlap, max_running=8,
            **overrides,
        )  # fmt: skip
        assert engine.loop.runner.host_starts is not None
        return tokens_of(run(engine, requests, stagger=2))

    graphed = serve()
    assert graphed == serve(disable_cuda_graph=True)
    assert {rid: len(t) for rid, t in graphed.items()} == {i: 24 + 5 * i for i in range(8)}
