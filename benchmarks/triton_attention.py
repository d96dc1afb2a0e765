"""The ``triton`` attention backend alone over a grid of its launch settings (GPU only): per
batch shape and setting, the device time of one layer's attention and the KV read rate it
reaches, against the device's read rate measured on the spot.

    python benchmarks/triton_attention.py [--block-n 32 64] [--num-warps 4 8] \\
        [--num-stages 0 2 3 4] [--programs-per-sm 0 4]

0 in a list is the backend's default (``TritonOptions``). Each case: random paged K/V of one
layer (32 q heads, 8 KV heads, head dim 128, bfloat16, pages of 16 handed out shuffled, as a
long-running pool hands them), each row ``context`` long after the step; a graph of 20
forwards (the new K/V's store included, as in a layer) replayed 10 times, the median of 5
such replays. The rate counts each row's K and V once.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable
from importlib.metadata import version

import torch

from outrider.plugins.attention.triton_backend import SPEC, TritonOptions
from outrider.plugins.device import AttentionShape, BatchLayout, ForwardBatch, KVCache

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
SHAPE = AttentionShape(Q_HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, torch.bfloat16)
# (rows, context after the step, queries a row): decode at 1, 32, 256 rows; a chain's verify.
CASES = [(1, 1024, 1), (1, 8192, 1), (32, 1024, 1), (256, 640, 1), (256, 2048, 1), (32, 1024, 4)]


def layout(
    rows: int, context: int, queries: int, gen: torch.Generator, device: torch.device
) -> BatchLayout:
    """Each row's last ``queries`` positions are this step's queries, over shuffled pages."""
    per_row = -(-context // PAGE)
    pages = 1 + torch.randperm(rows * per_row, generator=gen)  # page 0: the scratch page
    table = pages.view(rows, per_row).to(device, torch.int32)
    positions = torch.arange(context - queries, context).repeat(rows)  # [T]
    row_of = torch.arange(rows).repeat_interleave(queries)
    flat = table.cpu()[row_of, positions // PAGE].long() * PAGE + positions % PAGE

    def on(values: torch.Tensor) -> torch.Tensor:
        return values.to(device, torch.int64)

    return BatchLayout(
        page_table=table,
        page_size=PAGE,
        slots=on(torch.arange(rows)),
        positions=on(positions),
        out_loc=on(flat),
        q_start=on(torch.arange(rows + 1) * queries),
        seq_lens=on(torch.full((rows,), context)),
        q_pad_index=on(torch.arange(rows * queries)),
        bs=rows,
        max_q=queries,
        max_kv=context,
    )


def device_ms(run: Callable[[], object], calls: int = 20, replays: int = 10) -> float:
    """A call's device time: a graph of ``calls`` calls replayed ``replays`` times, median of 5."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run()  # compiles and warms outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            run()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / (calls * replays))
    return statistics.median(times)


def attention_ms(
    batch: BatchLayout,
    kv: KVCache,
    options: TritonOptions,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> float:
    """One layer's attention over ``batch`` (its K/V stored first) with ``options``."""
    backend = SPEC.load()(SHAPE, options, batch.positions.device)
    fb = ForwardBatch.bind(batch, backend, kv)
    return device_ms(lambda: fb.attend(0, *qkv))


def read_rate_gbs() -> float:
    """The device's read rate: a 4 GiB sum."""
    data = torch.ones(1 << 31, dtype=torch.bfloat16, device="cuda")
    return data.numel() * 2 / device_ms(lambda: data.sum(), calls=5, replays=4) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("block-n", [0]), ("num-warps", [0]), ("num-stages", [0]),
                          ("programs-per-sm", [0])):  # fmt: skip
        parser.add_argument(f"--{flag}", type=int, nargs="+", default=default)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {version('triton')}")
    peak = read_rate_gbs()
    print(f"read rate (4 GiB sum): {peak:,.0f} GB/s")
    settings = [
        TritonOptions(block_n=n, num_warps=w, num_stages=s, programs_per_sm=p)
        for n, w, s, p in itertools.product(
            args.block_n, args.num_warps, args.num_stages, args.programs_per_sm
        )
    ]
    gen = torch.Generator().manual_seed(0)
    print("rows context queries | block_n warps stages programs/SM | us | GB/s | % of read rate")
    for rows, context, queries in CASES:
        batch = layout(rows, context, queries, gen, torch.device("cuda"))
        kv = KVCache.allocate(1, rows * -(-context // PAGE) + 1, PAGE, SHAPE, SHAPE.dtype,
                              torch.device("cuda"))  # fmt: skip
        for cache in (*kv.k, *kv.v):
            cache.normal_()
        tokens = rows * queries
        q = torch.randn(tokens, Q_HEADS, HEAD_DIM, device="cuda", dtype=SHAPE.dtype)
        k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda", dtype=SHAPE.dtype)
        v = torch.randn_like(k)
        read = rows * context * KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bfloat16
        for options in settings:
            ms = attention_ms(batch, kv, options, (q, k, v))
            rate = read / ms / 1e6
            print(
                f"{rows:4} {context:7} {queries:7} | {options.block_n:7} {options.num_warps:5} "
                f"{options.num_stages:6} {options.programs_per_sm:12} | {ms * 1e3:8.1f} | "
                f"{rate:7,.0f} | {100 * rate / peak:5.1f}"
            )


if __name__ == "__main__":
    main()
