"""The all-reduce over peer memory (plugins/models/peer_reduce.py) and the sum fused with the
residual add and norm (plugins/models/peer_norm.py): which messages they take, and on two GPUs
what they give, eagerly and replayed from a CUDA graph, against NCCL's sums."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from daemon_harness import free_port

from outrider.daemon.engine.graph_capture import GraphPool
from outrider.plugins.models.parallel import init_tensor_parallel
from outrider.plugins.models.peer_norm import MAX_ROWS, PeerSumNorm
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


def test_fused_norm_takes_rows_the_flags_and_a_parity_hold() -> None:
    world, hidden = 2, 64
    parity = 8 * hidden * 2  # eight bf16 rows a rank
    buffer = torch.empty(PeerSumNorm.buffer_bytes(parity, world), dtype=torch.uint8)
    norm = PeerSumNorm(buffer, torch.zeros(world, dtype=torch.int64), rank=0)
    assert norm.parity_bytes == parity

    def rows(n: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.zeros(n, hidden, dtype=dtype)

    assert norm.takes(rows(1), rows(1))
    assert norm.takes(rows(8), rows(8))
    assert not norm.takes(rows(9), rows(9))  # past a parity
    assert not norm.takes(rows(0), rows(0))
    assert norm.takes(rows(4, torch.float32), rows(4, torch.float32))  # eight bf16 rows of bytes
    assert not norm.takes(rows(5, torch.float32), rows(5, torch.float32))
    assert not norm.takes(rows(2), rows(2, torch.float32))  # the residual's dtype differs
    assert not norm.takes(rows(2), rows(3))
    assert not norm.takes(rows(2).t().contiguous().t(), rows(2))  # not contiguous
    assert not norm.takes(torch.zeros(hidden, dtype=torch.bfloat16), torch.zeros(hidden))
    big = PeerSumNorm(  # room for more rows than the flags: the flags bound them
        torch.empty(PeerSumNorm.buffer_bytes(2 * MAX_ROWS * 8 * 4, world), dtype=torch.uint8),
        torch.zeros(world, dtype=torch.int64),
        rank=1,
    )
    assert big.takes(torch.zeros(MAX_ROWS, 8), torch.zeros(MAX_ROWS, 8))
    assert not big.takes(torch.zeros(MAX_ROWS + 1, 8), torch.zeros(MAX_ROWS + 1, 8))


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

    graph, out, _ = GraphPool().capture(step)
    replayed = []
    for seed in (10 + rank, 20 + rank):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        static.copy_(torch.randn(static.shape, generator=generator, device="cuda"))
        graph.replay()
        replayed.append(out.clone().cpu())
    return replayed


EPS = 1e-5
# (dtype, rows, hidden): a decode step's at batch 1 and 256, gpt-oss's hidden (not a power of
# two: masked), float32.
NORM_CASES = (
    (torch.bfloat16, 1, 4096),
    (torch.bfloat16, 256, 4096),
    (torch.bfloat16, 8, 2880),
    (torch.float32, 3, 1024),
)


def _norm_inputs(
    rank: int, dtype: torch.dtype, rows: int, hidden: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rank's part, and the residual and weight every rank shares."""
    own = torch.Generator(device="cuda").manual_seed(seed + rank)
    shared = torch.Generator(device="cuda").manual_seed(seed + 100)
    part = torch.randn(rows, hidden, generator=own, device="cuda").to(dtype)
    residual = torch.randn(rows, hidden, generator=shared, device="cuda").to(dtype)
    weight = (torch.rand(hidden, generator=shared, device="cuda") + 0.5).to(dtype)
    return part, residual, weight


def _fused_norms(norm: PeerSumNorm, rank: int) -> dict[tuple, tuple[torch.Tensor, ...]]:
    """Per case: the fused kernel's (normed, residual) and NCCL's sum of the same parts."""
    seen = {}
    for dtype, rows, hidden in NORM_CASES:
        part, residual, weight = _norm_inputs(rank, dtype, rows, hidden, seed=7)
        nccl, before = part.clone(), residual.cpu()
        dist.all_reduce(nccl)
        normed, summed = norm(part, residual, weight, EPS)  # in place of both
        seen[dtype, rows, hidden] = (normed.cpu(), summed.cpu(), nccl.cpu(), before)
    return seen


def _fused_norm_graph(norm: PeerSumNorm, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two chained fused calls captured once and replayed on two inputs, each beside the
    same calls run eagerly on those inputs."""
    part, residual, weight = _norm_inputs(rank, torch.bfloat16, 2, 4096, seed=9)
    static_part, static_residual = part.clone(), residual.clone()

    def step() -> torch.Tensor:
        h, r = norm(static_part.clone(), static_residual.clone(), weight, EPS)
        h, r = norm(h * 0.5, r, weight, EPS)
        return torch.cat((h, r))

    graph, out, _ = GraphPool().capture(step)
    pairs = []
    for seed in (10, 20):
        part, residual, _ = _norm_inputs(rank, torch.bfloat16, 2, 4096, seed)
        static_part.copy_(part)
        static_residual.copy_(residual)
        graph.replay()
        replayed = out.clone().cpu()
        pairs.append((replayed, step().cpu()))
    return pairs


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
    assert peer.norm is not None
    seen["norm"] = _fused_norms(peer.norm, rank)
    seen["norm_graph"] = _fused_norm_graph(peer.norm, rank)
    torch.save(seen, root / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """What each of two ranks on two GPUs saw (``_rank_main``), in rank order."""
    root = tmp_path_factory.mktemp("peer")
    mp.spawn(_rank_main, args=(free_port(), root), nprocs=WORLD, join=True)
    return [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs two GPUs")
def test_two_gpus_sum_as_nccl_does(two_ranks: list[dict]) -> None:
    ranks = two_ranks
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


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs two GPUs")
def test_two_gpus_sum_add_and_norm_in_one_kernel(two_ranks: list[dict]) -> None:
    ranks = two_ranks
    for seen in ranks:
        for case, (normed, summed, nccl, residual) in seen["norm"].items():
            dtype = case[0]
            # The residual stream: NCCL's sum of the parts plus the residual, rounded once.
            assert torch.equal(summed, (nccl.float() + residual.float()).to(dtype)), case
            stream = nccl.float() + residual.float()
            weight = _norm_inputs(0, *case, seed=7)[2].float().cpu()
            want = stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + EPS) * weight
            tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(normed.float(), want, atol=tolerance, rtol=tolerance)
            other = ranks[0]["norm"][case]
            assert torch.equal(normed, other[0]) and torch.equal(summed, other[1]), case
        for replayed, eager in seen["norm_graph"]:
            assert torch.equal(replayed, eager)
        assert torch.equal(seen["norm_graph"][0][0], ranks[0]["norm_graph"][0][0])
    first, second = ranks[0]["norm_graph"]
    assert not torch.equal(first[0], second[0]), "the graph replayed its capture's inputs"
