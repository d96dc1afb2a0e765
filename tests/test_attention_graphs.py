"""Attention as decode graphs run it: layouts over fixed input buffers, built with the graph's
KV bound. On CPU, attention over that bound equals attention over each batch's own; on a GPU,
``build`` and the layer captured in one graph and replayed over new batches equal eager
forwards."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from model_fixtures import PagedRows, torch_backend

from outrider.daemon.engine.accept import tree_geometry
from outrider.plugins.api import NoOptions
from outrider.plugins.attention.base import AttentionBackend
from outrider.plugins.device import AttentionShape, BatchLayout, ForwardBatch
from outrider.plugins.registry import discover

SHAPE = AttentionShape(
    num_q_heads=4, num_kv_heads=2, head_dim=8, scale=8**-0.5, dtype=torch.float32
)
PAGE = 4
MAX_BS = 4
MAX_LEN = 40  # a row's committed length plus its block stays below this
BUCKETS = (1, 2, 4)
# Node i's parent (node 0 is the root): a tree of six nodes and depth 3.
TREE_PARENTS = torch.tensor([0, 0, 1, 1, 3])


@dataclass(frozen=True)
class Kind:
    """One batch kind a graph is captured for: ``width`` query tokens per row."""

    name: str
    width: int
    causal: bool = True
    tree: bool = False


KINDS = [
    Kind("decode", 1),
    Kind("chain verify", 4),
    Kind("tree verify", 6, tree=True),
    Kind("dflash block", 8, causal=False),
]


class FixedInputs:
    """What the engine's decode graphs do with a layout: its inputs live in fixed buffers sized
    for ``MAX_BS`` rows, every layout views them with the graph's KV bound, and a new batch is
    written into them in place before a replay."""

    def __init__(self, kind: Kind, rows: PagedRows) -> None:
        self.kind, self.rows = kind, rows
        n, w = MAX_BS * kind.width, kind.width

        def buffer(size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.int64, device=rows.device)

        self.positions, self.out_loc, self.q_pad_index = buffer(n), buffer(n), buffer(n)
        self.slots, self.seq_lens, self.q_start = buffer(MAX_BS), buffer(MAX_BS), buffer(MAX_BS + 1)
        self.tree_mask = (
            torch.zeros(MAX_BS, w, w, dtype=torch.bool, device=rows.device) if kind.tree else None
        )

    def layout(self, bs: int) -> BatchLayout:
        n = bs * self.kind.width
        return BatchLayout(
            page_table=self.rows.page_table,
            page_size=PAGE,
            slots=self.slots[:bs],
            positions=self.positions[:n],
            out_loc=self.out_loc[:n],
            q_start=self.q_start[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            q_pad_index=self.q_pad_index[:n],
            bs=bs,
            max_q=self.kind.width,
            max_kv=MAX_LEN,
            causal=self.kind.causal,
            tree_mask=self.tree_mask[:bs] if self.tree_mask is not None else None,
        )

    def write(self, batch: BatchLayout) -> BatchLayout:
        """``batch``'s inputs into the fixed buffers, in place; the layout viewing them."""
        target = self.layout(batch.bs)
        for name in ("slots", "positions", "out_loc", "q_start", "seq_lens", "q_pad_index"):
            getattr(target, name).copy_(getattr(batch, name))
        if target.tree_mask is not None:
            assert batch.tree_mask is not None
            target.tree_mask.copy_(batch.tree_mask)
        return target


def make_batch(kind: Kind, rows: PagedRows, bs: int, gen: torch.Generator) -> BatchLayout:
    """``bs`` rows of random committed lengths, each verifying ``kind.width`` tokens, with the
    tight KV bound an eager batch gets."""
    w = kind.width
    table = rows.page_table.cpu()
    slots = torch.randperm(MAX_BS, generator=gen)[:bs]
    starts = torch.randint(1, MAX_LEN - w, (bs,), generator=gen)
    offsets = torch.arange(w).expand(bs, w)
    depth, tree_mask = offsets, None
    if kind.tree:
        depth, tree_mask = tree_geometry(TREE_PARENTS.expand(bs, -1), max_depth=3)
    kv_slots = starts.unsqueeze(1) + offsets  # [bs, W]
    pages = table[slots.unsqueeze(1), kv_slots // PAGE].long()
    seq_lens = starts + w

    def on(t: torch.Tensor) -> torch.Tensor:
        return t.to(rows.device)

    return BatchLayout(
        page_table=rows.page_table,
        page_size=PAGE,
        slots=on(slots),
        positions=on((starts.unsqueeze(1) + depth).reshape(-1)),
        out_loc=on((pages * PAGE + kv_slots % PAGE).reshape(-1)),
        q_start=on(torch.arange(bs + 1) * w),
        seq_lens=on(seq_lens),
        q_pad_index=on(torch.arange(bs * w)),
        bs=bs,
        max_q=w,
        max_kv=int(seq_lens.max()),
        causal=kind.causal,
        tree_mask=on(tree_mask) if tree_mask is not None else None,
    )


Device = torch.device | str


def paged_rows(
    gen: torch.Generator, device: Device = "cpu", shape: AttentionShape = SHAPE
) -> PagedRows:
    """Every slot holds ``MAX_LEN`` positions of random K/V, pages of ``PAGE``."""
    rows = PagedRows(
        num_layers=1, shape=shape, page_size=PAGE, max_len=MAX_LEN, max_slots=MAX_BS,
        dtype=shape.dtype, device=device,
    )  # fmt: skip
    rows.batch(torch_backend(shape, device), [(slot, [0] * MAX_LEN) for slot in range(MAX_BS)])
    for cache in (*rows.kv.k, *rows.kv.v):
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return rows


def qkv(
    n: int, gen: torch.Generator, device: Device = "cpu", shape: AttentionShape = SHAPE
) -> list[torch.Tensor]:
    """Random q, k and v of ``n`` tokens in ``shape``'s heads and dtype."""
    heads = (shape.num_q_heads, shape.num_kv_heads, shape.num_kv_heads)
    return [torch.randn(n, h, shape.head_dim, generator=gen).to(device, shape.dtype) for h in heads]


def graph_replays(
    kind: Kind, rows: PagedRows, attention: AttentionBackend, gen: torch.Generator
) -> Iterator[tuple[BatchLayout, torch.Tensor, list[torch.Tensor]]]:
    """As the engine captures decode graphs: ``build`` and the layer in one graph per bucket
    (after a warm-up on a side stream, which also compiles JIT kernels), each replayed three
    times over a new batch written into the fixed inputs. Yields each replayed batch, the
    graph's output and the q, k, v it read, for the caller to compare with eager forwards."""
    device, shape = rows.device, attention.shape
    fixed = FixedInputs(kind, rows)
    static = qkv(MAX_BS * kind.width, gen, device, shape)
    for bs in BUCKETS:
        n = bs * kind.width
        inputs = [t[:n] for t in static]
        layout = fixed.write(make_batch(kind, rows, bs, gen))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ForwardBatch.bind(layout, attention, rows.kv).attend(0, *inputs)  # the warm-up
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ForwardBatch.bind(layout, attention, rows.kv).attend(0, *inputs)
        for _ in range(3):
            batch = make_batch(kind, rows, bs, gen)
            fixed.write(batch)
            for buffer, value in zip(inputs, qkv(n, gen, device, shape), strict=True):
                buffer.copy_(value)
            graph.replay()
            yield batch, out, inputs


def backend(name: str, device: str = "cpu") -> AttentionBackend:
    spec = discover().get("attention", name)
    assert spec.attention is not None and spec.attention.cuda_graphs, name
    built: AttentionBackend = spec.load()(SHAPE, NoOptions(), torch.device(device))
    return built


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_attention_over_the_graph_bound_equals_the_batchs_own(kind: Kind) -> None:
    """A graph builds every layout with its KV bound, past each row's length: the torch
    backend's result must not depend on it."""
    gen = torch.Generator().manual_seed(7)
    rows = paged_rows(gen)
    torch_attention = backend("torch")
    fixed = FixedInputs(kind, rows)
    for bs in BUCKETS:
        for _ in range(3):
            batch = make_batch(kind, rows, bs, gen)
            q, k, v = qkv(bs * kind.width, gen)
            bound = ForwardBatch.bind(fixed.write(batch), torch_attention, rows.kv)
            own = ForwardBatch.bind(batch, torch_attention, rows.kv)
            torch.testing.assert_close(
                bound.attend(0, q, k, v), own.attend(0, q, k, v), atol=1e-5, rtol=1e-5
            )


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_cuda_graph_replays_equal_eager_attention(kind: Kind) -> None:
    """Replays over new batches written into the fixed inputs give what an eager forward over
    each batch gives."""
    gen = torch.Generator().manual_seed(11)
    rows = paged_rows(gen, "cuda")
    torch_attention = backend("torch", "cuda")
    for batch, out, inputs in graph_replays(kind, rows, torch_attention, gen):
        own = ForwardBatch.bind(batch, torch_attention, rows.kv).attend(0, *inputs)
        torch.testing.assert_close(out, own, atol=1e-4, rtol=1e-4)
