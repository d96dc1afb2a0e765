"""Time one tensor-parallel all-reduce, NCCL against the peer-memory kernel, by message size.

    python benchmarks/all_reduce.py [--world 2] [--calls 64]

Each rank (a process per GPU of this host) captures a CUDA graph of ``--calls`` all-reduces of
one bfloat16 message, as a decode step's graph holds them, and replays it; rank 0 prints one JSON
line per size and path: microseconds a call (the median of 20 replays over ``--calls``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from outrider.plugins.models.parallel import init_tensor_parallel
from outrider.plugins.models.peer_reduce import join_peer_all_reduce

SIZES_KIB = (8, 32, 64, 128, 256, 512, 1024, 2048, 4096)
REPLAYS = 20


def _per_call_us(reduce: Callable[[torch.Tensor], torch.Tensor], kib: int, calls: int) -> float:
    x = torch.ones(kib * 1024 // 2, dtype=torch.bfloat16, device="cuda")

    def body() -> None:
        for _ in range(calls):
            reduce(x)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def _rank(rank: int, world: int, port: int, calls: int) -> None:
    torch.cuda.set_device(rank)
    tp = init_tensor_parallel(rank, world, f"tcp://127.0.0.1:{port}", "nccl")
    assert tp.group is not None
    device = torch.device("cuda", rank)
    # A buffer for the largest size, past the engine's limit, to find where NCCL wins.
    peer = join_peer_all_reduce(tp.group, device, range(world), max(SIZES_KIB) * 1024)
    assert peer is not None, "these GPUs have no peer access"

    def nccl(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    for kib in SIZES_KIB:
        for name, reduce in (("nccl", nccl), ("peer", peer)):
            us = _per_call_us(reduce, kib, calls)
            if rank == 0:
                print(json.dumps({"world": world, "kib": kib, "path": name, "us": round(us, 2)}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--calls", type=int, default=64)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    mp.spawn(_rank, args=(args.world, port, args.calls), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
