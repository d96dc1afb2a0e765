"""The all-reduce over peer memory (plugins/models/peer_reduce.py): which messages it takes, and
on two GPUs the sums it gives, eagerly and replayed from a CUDA graph, against NCCL's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from daemon_harness import free_port

from outrider.plugins.models.parallel import init_tensor_parallel
from outrider.plugins.models.peer_reduce import PeerAllReduce, one_shot_max_bytes

WORLD = 2
LIMIT = one_shot_max_bytes(WORLD)
DTYPES = (torch.bfloat16, torch.float32)
# Element counts: the smallest message, a decode step's at batch 1 and 256 (hidden 4096,
# bf16), one that is not a multiple of the kernel's vector, and past the limit.
NUMELS = (8, 4096, 256 * 4096, 4100, LIMIT)


def _peer(device: str = "cpu") -> PeerAllReduce:
    return PeerAllReduce(torch.empty(LIMIT, dtype=torch.uint8, device=device), "0")


def test_takes_small_aligned_contiguous_messages_only() -> None:
    peer = _peer()
    assert peer.takes(torch.zeros(4, dtype=torch.float32))
    assert peer.takes(torch.zeros(LIMIT // 2, dtype=torch.bfloat16))
    assert not peer.takes(torch.zeros(LIMIT // 2 + 8, dtype=torch.bfloat16))
    assert not peer.takes(torch.zeros(3, dtype=torch.float32))  # 12 bytes: not a vector
    assert not peer.takes(torch.zeros(0, dtype=torch.float32))
    assert not peer.takes(torch.zeros(8, 4, dtype=torch.float32).t())  # not contiguous
    assert not peer.takes(torch.zeros(9, dtype=torch.float32)[1:5])  # 4 bytes off alignment


def _sums(tp_all_reduce: object, rank: int) -> dict[tuple[torch.dtype, int], torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(rank)
    sums = {}
    for dtype in DTYPES:
        for numel in NUMELS:
            x = torch.randn(numel, generator=generator, device="cuda").to(dtype)
            sums[dtype, numel] = tp_all_reduce(x).cpu()  # type: ignore[operator]
    return sums


def _graph_sums(tp_all_reduce: object, rank: int) -> list[torch.Tensor]:
    """Three chained all-reduces of a decode-sized message captured once, replayed on two
    inputs."""
    static = torch.zeros(2, 4096, dtype=torch.bfloat16, device="cuda")

    def step() -> torch.Tensor:
        y = tp_all_reduce(static.clone())  # type: ignore[operator]
        y = tp_all_reduce(y * 0.5)  # type: ignore[operator]
        return tp_all_reduce(y - 1.0)  # type: ignore[operator]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    replayed = []
    for seed in (10 + rank, 20 + rank):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        static.copy_(torch.randn(static.shape, generator=generator, device="cuda"))
        graph.replay()
        replayed.append(out.clone().cpu())
    return replayed


def _rank_main(rank: int, port: int, root: Path) -> None:
    torch.cuda.set_device(rank)
    tp = init_tensor_parallel(rank, WORLD, f"tcp://127.0.0.1:{port}", "nccl", range(WORLD))
    assert tp.peer is not None, "two GPUs of one host without peer access"

    def nccl(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    peer = tp.peer
    seen = {
        "taken": {
            (d, n): peer.takes(torch.empty(n, dtype=d, device="cuda"))
            for d in DTYPES
            for n in NUMELS
        },
        "peer": _sums(tp.all_reduce, rank),
        "nccl": _sums(nccl, rank),
        "peer_graph": _graph_sums(tp.all_reduce, rank),
        "nccl_graph": _graph_sums(nccl, rank),
    }
    torch.save(seen, root / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs two GPUs")
def test_two_gpus_sum_as_nccl_does(tmp_path: Path) -> None:
    mp.spawn(_rank_main, args=(free_port(), tmp_path), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    taken = ranks[0]["taken"]
    assert taken == {
        (d, n): n * d.itemsize <= LIMIT and n * d.itemsize % 16 == 0 for d in DTYPES for n in NUMELS
    }
    assert sum(taken.values()) == 6  # of 10: past the limit, or not whole vectors
    for seen in ranks:
        # Two parts: either order of one addition rounds alike, so NCCL's bits are the rule.
        for key, total in seen["peer"].items():
            assert torch.equal(total, seen["nccl"][key]), key
        for replayed, reference in zip(seen["peer_graph"], seen["nccl_graph"], strict=True):
            assert torch.equal(replayed, reference)
        for key, total in seen["peer"].items():
            assert torch.equal(total, ranks[0]["peer"][key]), f"the ranks' sums differ: {key}"
    first, second = ranks[0]["peer_graph"]
    assert not torch.equal(first, second), "the graph replayed its capture's inputs"
