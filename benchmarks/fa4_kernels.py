"""FlashAttention-4's paged varlen kernel alone, eager and inside a CUDA graph (GPU only).

    python benchmarks/fa4_kernels.py

Per case: random paged K/V (32 q heads, 8 KV heads, head dim 128, bf16), the host time of an
eager call (the mean over 50 calls in a loop: it cannot fall below the device time), the device
time of a call inside a graph of 20 calls replayed 10 times, and the KV read rate it reaches.
"""

from __future__ import annotations

import time
from importlib.metadata import version

import torch
from flash_attn.cute import flash_attn_varlen_func

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
# (batch, context, queries per row, page size, causal)
CASES = [
    (1, 1024, 1, 16, True),
    (8, 1024, 1, 16, True),
    (32, 2048, 1, 16, True),
    (32, 2048, 1, 128, True),
    (1, 4096, 1, 16, True),
    (8, 1024, 16, 16, True),  # a 16-token verify
    (8, 1024, 16, 16, False),  # a DFlash block
    (1, 2048, 2048, 16, True),  # a prompt
]


def case(batch: int, context: int, queries: int, page: int, causal: bool) -> str:
    device = torch.device("cuda")
    pages = batch * context // page + 1  # page 0 unused, as the engine's scratch page
    k = torch.randn(pages, page, KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    v = torch.randn_like(k)
    table = torch.arange(1, pages, device=device, dtype=torch.int32).view(batch, -1)
    q = torch.randn(batch * queries, Q_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    cu_q = torch.arange(batch + 1, device=device, dtype=torch.int32) * queries
    used_k = torch.full((batch,), context, device=device, dtype=torch.int32)

    def call() -> None:
        flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_q, max_seqlen_q=queries, seqused_k=used_k,
            page_table=table, causal=causal,
        )  # fmt: skip

    call()  # compiles the variant
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(50):
        call()
    eager_us = (time.perf_counter() - started) / 50 * 1e6
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    graph_us = start.elapsed_time(end) * 1e3 / 200
    kv_tb_s = batch * context * KV_HEADS * HEAD_DIM * 2 * 2 / graph_us / 1e6
    return (
        f"batch {batch} context {context} queries {queries} page {page} causal {causal}: "
        f"eager {eager_us:.0f} us/call, in a graph {graph_us:.1f} us/call, "
        f"KV read {kv_tb_s:.2f} TB/s"
    )


def main() -> None:
    packages = ("flash-attn-4", "nvidia-cutlass-dsl")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, *map(version, packages))
    for args in CASES:
        print(case(*args))


if __name__ == "__main__":
    main()
