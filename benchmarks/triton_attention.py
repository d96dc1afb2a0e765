"""The ``triton`` attention backend alone over a grid of its launch settings (GPU only): per
batch shape and setting, the device time of one layer's attention and the KV read rate it
reaches, against the device's read rate measured on the spot.

    python benchmarks/triton_attention.py [--block-n 32 64] [--num-warps 4 8] \\
        [--num-stages 0 2 3 4] [--programs-per-sm 0 4]

0 in a list is the backend's default (``TritonOptions``). Each case: random paged K/V of one
layer (32 q heads, 8 KV heads, head dim 128, bfloat16, pages of 16 handed out shuffled, as a
long-running pool hands them), each row ``context`` long after the step. Timed as
``fp8_gemv.py`` times: a CUDA graph of 24 forwards (the new K/V's store included, as in a
layer), cycling over enough copies of the batch's KV that none is read from L2. The rate
counts each row's K and V once.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from importlib.metadata import version

import torch
from fp8_gemv import copies, device_us  # benchmarks/ is sys.path[0] when run as a script

from outrider.daemon.bench.roofline import read_bandwidth
from outrider.plugins.attention.base import AttentionBackend
from outrider.plugins.attention.triton_backend import SPEC, TritonOptions
from outrider.plugins.device import AttentionShape, BatchLayout, ForwardBatch, KVCache

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
SHAPE = AttentionShape(Q_HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, torch.bfloat16)
# (rows, context after the step, queries a row): decode at 1, 32, 256 rows; a chain's verify.
CASES = [(1, 1024, 1), (1, 8192, 1), (32, 1024, 1), (256, 640, 1), (256, 2048, 1), (32, 1024, 4)]


def layout(
    rows: int,
    context: int,
    queries: int,
    pages: torch.Tensor,
    device: torch.device,
    page: int = PAGE,
) -> BatchLayout:
    """Each row's last ``queries`` positions are this step's queries, over ``pages`` of
    ``page`` tokens (as many as the rows' contexts take, in the order they are handed out)."""
    per_row = -(-context // page)
    table = pages.view(rows, per_row).to(device, torch.int32)
    positions = torch.arange(context - queries, context).repeat(rows)  # [T]
    row_of = torch.arange(rows).repeat_interleave(queries)
    flat = table.cpu()[row_of, positions // page].long() * page + positions % page

    def on(values: torch.Tensor) -> torch.Tensor:
        return values.to(device, torch.int64)

    return BatchLayout(
        page_table=table,
        page_size=page,
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


def attend(fb: ForwardBatch, qkv: tuple[torch.Tensor, ...]) -> None:
    fb.attend(0, *qkv)


def kv_bytes(rows: int, context: int) -> int:
    """One layer's K and V over ``rows`` rows of ``context`` positions, in bfloat16."""
    return rows * context * KV_HEADS * HEAD_DIM * 2 * 2


@dataclass(frozen=True)
class Case:
    """One case's KV (one layer), its batch over each copy of it, and the new tokens' q/k/v."""

    kv: KVCache
    batches: list[BatchLayout]
    qkv: tuple[torch.Tensor, ...]

    def us(self, backend: AttentionBackend) -> float:
        """One layer's attention by ``backend`` over the case's batch: microseconds."""
        calls: list[Callable[[], object]] = [
            partial(attend, ForwardBatch.bind(batch, backend, self.kv), self.qkv)
            for batch in self.batches
        ]
        return device_us(calls)


def case(rows: int, context: int, queries: int, page: int = PAGE) -> Case:
    """Random paged K/V for the batch, copied until the copies outgrow L2 twice over."""
    device = torch.device("cuda")
    per_copy = rows * -(-context // page)
    n = copies(kv_bytes(rows, context))
    kv = KVCache.allocate(1, 1 + n * per_copy, page, SHAPE, SHAPE.dtype, device)
    for cache in (*kv.k, *kv.v):
        cache.normal_()
    shuffled = 1 + torch.randperm(n * per_copy, generator=torch.Generator().manual_seed(0))
    batches = [
        layout(rows, context, queries, shuffled[i * per_copy : (i + 1) * per_copy], device, page)
        for i in range(n)
    ]
    tokens = rows * queries
    q = torch.randn(tokens, Q_HEADS, HEAD_DIM, device=device, dtype=SHAPE.dtype)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device=device, dtype=SHAPE.dtype)
    return Case(kv, batches, (q, k, torch.randn_like(k)))  # page 0 (scratch) is never read


def case_us(rows: int, context: int, queries: int, options: list[TritonOptions]) -> list[float]:
    """One layer's attention over the case's batch with each of ``options``: microseconds."""
    device = torch.device("cuda")
    one = case(rows, context, queries)
    return [one.us(SPEC.load()(SHAPE, setting, device)) for setting in options]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("block-n", "num-warps", "num-stages", "programs-per-sm"):
        parser.add_argument(f"--{flag}", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {version('triton')}")
    peak = read_bandwidth("cuda") / 1e9  # GB/s
    print(f"read rate (a 4 GiB sum): {peak:,.0f} GB/s")
    options = [
        TritonOptions(block_n=n, num_warps=w, num_stages=s, programs_per_sm=p)
        for n, w, s, p in itertools.product(
            args.block_n, args.num_warps, args.num_stages, args.programs_per_sm
        )
    ]
    print("rows context queries | block_n warps stages programs/SM | us | GB/s | % of read")
    for rows, context, queries in CASES:
        read = kv_bytes(rows, context)
        for setting, us in zip(options, case_us(rows, context, queries, options), strict=True):
            rate = read / us / 1e3
            print(
                f"{rows:4} {context:7} {queries:7} | {setting.block_n:7} {setting.num_warps:5} "
                f"{setting.num_stages:6} {setting.programs_per_sm:12} | {us:8.1f} | "
                f"{rate:7,.0f} | {100 * rate / peak:5.1f}"
            )


if __name__ == "__main__":
    main()
