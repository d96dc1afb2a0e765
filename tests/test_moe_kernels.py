"""The fused MoE kernels (``plugins/models/moe/kernels.py``) against a plain torch reference,
the expert alignment's invariants, the config tables and the tuning command's enumeration and
file writing. Without a GPU the kernels run in Triton's interpreter on CPU tensors (tiny
shapes, float32 and bfloat16); the GPU tests take a realistic shape and a CUDA graph."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from specialization import CLASS_TOKENS, classes_by_tokens

from outrider.plugins.models.moe import tiles as moe_tiles
from outrider.plugins.models.moe.tiles import (
    CONFIG_DIR,
    DecodePath,
    GemmTiles,
    GemvTiles,
    MoeKernelConfig,
    MoeShape,
    config_from_table,
    heuristic_config,
    load_decode,
    load_table,
    table_file_for_gpu,
    table_for_gpu,
)

CUDA = torch.cuda.is_available()  # without one, conftest.py runs Triton's interpreter
DEVICE = torch.device("cuda" if CUDA else "cpu")
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="Triton is not installed (pip install 'outrider[triton]')",
)

# Sizes off the tiles' multiples, so that every mask is exercised.
SMALL = MoeShape(experts=6, hidden=40, intermediate=36, topk=2)
QWEN3_30B = MoeShape(experts=128, hidden=2048, intermediate=768, topk=8)
# Row blocks of 16, two of them per column group; steps that leave partial tiles.
SMALL_CONFIG = MoeKernelConfig(
    16,
    GemmTiles(block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2),
    GemmTiles(block_n=32, block_k=16, group_m=1, num_warps=4, num_stages=2),
)
# Rows past a program's 16, two reduction steps with a partial second one.
SMALL_DECODE = GemvTiles(block_n=16, block_k=32, num_warps=4, num_stages=2)
# bfloat16: torch's bfloat16 rtol (about two units in the last place) on outputs of order 1;
# the paths round the intermediate and the output once each, as the reference does, so they
# differ from it only where float32 sums in another order round to another bfloat16.
BF16_TOL = {"rtol": 1.6e-2, "atol": 1e-2}
F32_TOL = {"rtol": 1e-5, "atol": 1e-5}

Routed = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def routed_batch(shape: MoeShape, tokens: int, dtype: torch.dtype, seed: int = 0) -> Routed:
    """Random ``(x, w13, w2, topk_weights, topk_ids)`` routed as Qwen3's and Mixtral's routers
    do: softmax, top k, weights renormalised to sum to 1 (outputs of order 1)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    e, h, i = shape.experts, shape.hidden, shape.intermediate

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=DEVICE)

    weights, ids = torch.topk(randn(tokens, e).softmax(-1), shape.topk)
    weights /= weights.sum(dim=-1, keepdim=True)
    return (
        randn(tokens, h).to(dtype),
        (randn(e, 2 * i, h) / h**0.5).to(dtype),
        (randn(e, h, i) / i**0.5).to(dtype),
        weights,
        ids.to(torch.int32),
    )


def reference_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The contract in plain torch, expert by expert: float32 products, the intermediate
    rounded to x's dtype, the weighted sum in float32 rounded once."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in topk_ids.unique().tolist():
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        gate, up = (x[token].float() @ w13[expert].float().T).chunk(2, dim=-1)
        h = (F.silu(gate) * up).to(x.dtype).float()
        y = h @ w2[expert].float().T
        out.index_add_(0, token, topk_weights[token, slot, None] * y)
    return out.to(x.dtype)


def check_alignment(topk_ids: torch.Tensor, experts: int, block_m: int) -> None:
    from outrider.plugins.models.moe import align

    aligned = align.align_pairs(topk_ids, experts, block_m)
    ids = topk_ids.flatten().tolist()
    num_pairs = len(ids)
    blocks = align.max_blocks(num_pairs, experts, block_m)
    sorted_pairs = aligned.sorted_pairs.tolist()
    block_experts = aligned.block_experts.tolist()
    assert len(sorted_pairs) == blocks * block_m and len(block_experts) == blocks
    # Every pair exactly once; everything else is the sentinel.
    placed = [p for p in sorted_pairs if p != num_pairs]
    assert sorted(placed) == list(range(num_pairs))
    # The used blocks are a prefix; past them, sentinels and -1 only.
    used = sum(1 for e in block_experts if e >= 0)
    assert all(e == -1 for e in block_experts[used:])
    assert all(p == num_pairs for p in sorted_pairs[used * block_m :])
    for expert in range(experts):
        mine = [b for b, e in enumerate(block_experts) if e == expert]
        rows = [p for b in mine for p in sorted_pairs[b * block_m : (b + 1) * block_m]]
        real = [p for p in rows if p != num_pairs]
        # One expert's blocks are adjacent, hold only its pairs in pair order, and are as
        # few as its pairs allow: the padding is its last block's tail.
        assert mine == list(range(mine[0], mine[0] + len(mine)) if mine else [])
        assert real == [p for p, e in enumerate(ids) if e == expert]
        assert len(mine) == -(-len(real) // block_m)
        assert rows[: len(real)] == real
    assert block_experts[:used] == sorted(block_experts[:used])


def test_alignment_places_every_pair_once_in_blocks_of_one_expert() -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    # Experts without pairs, more pairs than one counting program takes (64), all pairs on
    # one expert, a block larger than any expert's share, a non-power-of-two expert count.
    spread = torch.randint(0, 6, (40, 2), generator=gen, device=DEVICE, dtype=torch.int32)
    check_alignment(spread, experts=6, block_m=16)
    check_alignment(spread[:3], experts=6, block_m=16)
    check_alignment(torch.full((17, 2), 4, dtype=torch.int32, device=DEVICE), 5, block_m=16)
    check_alignment(spread[:9], experts=8, block_m=64)
    # More chunks and blocks than the offsets program takes at a time.
    from outrider.plugins.models.moe import align

    tokens = (align._ALIGN_TILE + 2) * align._ALIGN_CHUNK // 2
    many = torch.randint(0, 6, (tokens, 2), generator=gen, device=DEVICE, dtype=torch.int32)
    assert -(-many.numel() // align._ALIGN_CHUNK) > align._ALIGN_TILE
    check_alignment(many, experts=6, block_m=16)


@pytest.fixture(scope="module")
def float32_batches() -> dict[int, Routed]:
    return {tokens: routed_batch(SMALL, tokens, torch.float32) for tokens in (1, 3, 17)}


@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_both_paths_are_the_reference_in_float32(
    tokens: int, float32_batches: dict[int, Routed]
) -> None:
    from outrider.plugins.models.moe import kernels as mk

    batch = float32_batches[tokens]
    x = batch[0]
    ref = reference_moe(*batch)
    decoded = mk.decode_moe(*batch, torch.empty_like(x), SMALL_DECODE)
    grouped = mk.grouped_moe(*batch, SMALL_CONFIG, torch.empty_like(x))
    torch.testing.assert_close(decoded, ref, **F32_TOL)
    torch.testing.assert_close(grouped, ref, **F32_TOL)
    if tokens == 1:  # the GEMVs at their GPU tiles
        torch.testing.assert_close(mk.fused_moe(*batch), ref, **F32_TOL)


@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_both_paths_match_the_reference_in_bfloat16(tokens: int) -> None:
    from outrider.plugins.models.moe import kernels as mk

    batch = routed_batch(SMALL, tokens, torch.bfloat16, seed=1)
    x = batch[0]
    ref = reference_moe(*batch)
    decoded = mk.decode_moe(*batch, torch.empty_like(x), SMALL_DECODE)
    grouped = mk.grouped_moe(*batch, SMALL_CONFIG, torch.empty_like(x))
    assert decoded.dtype == grouped.dtype == torch.bfloat16
    torch.testing.assert_close(decoded, ref, **BF16_TOL)
    torch.testing.assert_close(grouped, ref, **BF16_TOL)


def test_fused_moe_takes_the_gemvs_up_to_the_pair_limit_then_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from outrider.plugins.models.moe import kernels as mk

    calls: list[tuple[str, int]] = []

    def record(path: str) -> Callable[..., torch.Tensor]:
        def run(x: torch.Tensor, *args: object) -> torch.Tensor:
            calls.append((path, x.shape[0]))
            return x

        return run

    monkeypatch.setattr(mk, "decode_moe", record("decode"))
    monkeypatch.setattr(mk, "grouped_moe", record("grouped"))
    limit = DecodePath.default(SMALL).max_tokens  # the CPU's: no table
    assert limit == moe_tiles.DEFAULT_DECODE_PAIRS // SMALL.topk
    for tokens in (limit, limit + 1):
        mk.fused_moe(*routed_batch(SMALL, tokens, torch.float32))
    monkeypatch.setattr(mk, "MAX_CHUNK_PAIRS", 2 * limit)
    mk.fused_moe(*routed_batch(SMALL, 2 * limit + 1, torch.float32))
    assert calls == [
        ("decode", limit),
        ("grouped", limit + 1),
        ("grouped", limit),
        ("grouped", limit),
        ("grouped", 1),
    ]


@pytest.mark.skipif(CUDA, reason="reads the launches of Triton's interpreter")
def test_every_batch_size_of_a_config_runs_the_kernels_the_first_compiled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The grouped path at token counts of every class (under SMALL_CONFIG: 2 pairs and 3 row
    blocks, 16 and 7, 26 and 8, 160 and 16): each kernel (the alignment's, the two GEMMs, the
    sum) launches with the same classes, so a batch of a new size never compiles while
    serving."""
    from outrider.plugins.models.moe import kernels as mk

    def run_at(tokens: int) -> Callable[[], object]:
        x, w13, w2, weights, ids = routed_batch(SMALL, tokens, torch.float32)
        out = torch.empty_like(x)
        return lambda: mk.grouped_moe(x, w13, w2, weights, ids, SMALL_CONFIG, out)

    found = classes_by_tokens(monkeypatch, run_at, CLASS_TOKENS)
    assert set(found[1]) == {
        "_count_kernel", "_offsets_kernel", "_place_kernel", "_gate_up_kernel", "_down_kernel",
        "_sum_slots_kernel",
    }  # fmt: skip
    assert found == dict.fromkeys(CLASS_TOKENS, found[1])


def test_fused_moe_chunks_add_up_to_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    from outrider.plugins.models.moe import kernels as mk

    # Two chunks of the grouped path at the heuristic's config (the CPU's).
    monkeypatch.setattr(moe_tiles, "DEFAULT_DECODE_PAIRS", 8)
    monkeypatch.setattr(mk, "MAX_CHUNK_PAIRS", 16)
    batch = routed_batch(SMALL, 11, torch.float32, seed=2)
    torch.testing.assert_close(mk.fused_moe(*batch), reference_moe(*batch), **F32_TOL)


def test_fused_moe_names_each_breach_of_its_contract() -> None:
    from outrider.plugins.models.moe import kernels as mk

    x, w13, w2, weights, ids = routed_batch(SMALL, 2, torch.float32)
    with pytest.raises(ValueError, match=r"topk_ids \(2, 2\) torch.int64 is not int32"):
        mk.fused_moe(x, w13, w2, weights, ids.long())
    with pytest.raises(ValueError, match=r"w2 \(6, 36, 40\) is not \[E, H, I\]"):
        mk.fused_moe(x, w13, w2.transpose(1, 2), weights, ids)
    with pytest.raises(ValueError, match=r"dtypes differ.*; topk_weights \(2, 2\) is not"):
        mk.fused_moe(x.half(), w13, w2, weights.half(), ids)
    assert mk.fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, SMALL.hidden)


def _table_json(configs: dict[int, MoeKernelConfig]) -> dict[str, object]:
    return {"shapes": {SMALL.key: {str(t): c.to_json() for t, c in configs.items()}}}


def test_configs_come_from_the_device_file_then_the_generation_then_the_heuristic(
    tmp_path: Path,
) -> None:
    small, large = heuristic_config(SMALL, 1), heuristic_config(SMALL, 10_000)
    assert small != large
    (tmp_path / "sm90.json").write_text(json.dumps(_table_json({64: small})))
    (tmp_path / "NVIDIA_H100_80GB_HBM3.json").write_text(
        json.dumps(_table_json({16: large, 256: small}))
    )
    exact = table_for_gpu("NVIDIA H100 80GB HBM3", (9, 0), tmp_path)
    generation = table_for_gpu("NVIDIA H200", (9, 0), tmp_path)
    assert table_for_gpu("NVIDIA A100-SXM4-80GB", (8, 0), tmp_path) == {}
    # The smallest bucket at or above the batch, else the largest.
    assert config_from_table(exact, SMALL, 16) == large
    assert config_from_table(exact, SMALL, 17) == small
    assert config_from_table(exact, SMALL, 5000) == small
    assert config_from_table(generation, SMALL, 5000) == small
    other = MoeShape(experts=8, hidden=4096, intermediate=14336, topk=2)
    assert config_from_table(exact, other, 5000) == heuristic_config(other, 5000)
    assert config_from_table({"default": {1: large}}, other, 5000) == large


def test_a_table_file_names_each_shapes_decode_path(tmp_path: Path) -> None:
    """The device file's decode paths, none from a file that names none; a shape no file
    names takes the default (the pair limit over its slots, at least one token)."""
    path = tmp_path / "NVIDIA_H200.json"
    reach = DecodePath(16, GemvTiles(block_n=4, block_k=1024, num_warps=4, num_stages=2))
    doc = _table_json({64: SMALL_CONFIG}) | {"decode": {SMALL.key: reach.to_json()}}
    path.write_text(json.dumps(doc))
    assert table_file_for_gpu("NVIDIA H200", (9, 0), tmp_path) == path
    assert table_file_for_gpu("NVIDIA H100 80GB HBM3", (9, 0), tmp_path) is None
    assert load_decode(path) == {SMALL.key: reach}
    (tmp_path / "sm90.json").write_text(json.dumps(_table_json({64: SMALL_CONFIG})))
    assert load_decode(tmp_path / "sm90.json") == {}
    wide = MoeShape(experts=8, hidden=64, intermediate=32, topk=128)
    assert DecodePath.default(wide).max_tokens == 1
    assert DecodePath.default(SMALL).tiles == moe_tiles.DEFAULT_DECODE_TILES


def test_the_tuner_places_the_decode_paths_reach_where_the_gemvs_stop_winning() -> None:
    from outrider.plugins.models.moe import tune

    fast, slow = GemvTiles(4, 1024, 4, 3), GemvTiles(8, 512, 8, 2)

    def timed(grouped: float, decode: float | None, tiles: GemvTiles = slow) -> tune.Timed:
        return tune.Timed(SMALL_CONFIG, grouped, None if decode is None else (decode, tiles))

    # Faster through 8 tokens, slower at 16, faster again at 32: the reach stops at 8.
    sizes = {1: timed(0.09, 0.04, fast), 8: timed(0.24, 0.14), 16: timed(0.24, 0.25)}
    sizes |= {32: timed(0.30, 0.29), 64: timed(0.38, None)}
    assert tune.decode_path(sizes) == DecodePath(8, fast)
    assert tune.decode_path({1: timed(0.28, 0.30, fast)}) == DecodePath(0, fast)
    assert tune.decode_path({512: timed(0.5, None)}) is None


def test_the_shipped_table_and_the_heuristic_give_configs_that_compile_on_hopper() -> None:
    from outrider.plugins.models.moe.tune import SHARED_MEMORY_BYTES, shared_memory_bytes

    path = CONFIG_DIR / "sm90.json"
    assert json.loads(path.read_text())["tuned"] is False
    table = load_table(path)
    assert "experts=128,hidden=2048,intermediate=768,topk=8" in table
    configs = [c for buckets in table.values() for c in buckets.values()]
    configs += [heuristic_config(SMALL, tokens) for tokens in (1, 100, 400, 10_000)]
    assert len(set(configs)) >= 6
    for config in configs:
        assert config.block_m >= 16  # the smallest tl.dot
        for tiles, weight_tiles in ((config.gate_up, 2), (config.down, 1)):
            for size in (config.block_m, tiles.block_n, tiles.block_k, tiles.num_warps):
                assert size & (size - 1) == 0
            bf16_bytes = shared_memory_bytes(config.block_m, tiles, weight_tiles, 2)
            assert bf16_bytes <= SHARED_MEMORY_BYTES


def test_the_tuner_enumerates_distinct_tiles_that_fit_shared_memory() -> None:
    from outrider.plugins.models.moe import tune

    assert tune.block_m_candidates(QWEN3_30B, 16) == [16]  # one row an expert
    assert tune.block_m_candidates(QWEN3_30B, 256) == [16, 32]  # 16 rows an expert
    assert tune.block_m_candidates(QWEN3_30B, 4096) == [16, 32, 64, 128]
    assert tune.block_m_candidates(QWEN3_30B, 4096, only=(64, 128)) == [64, 128]
    assert tune.block_m_candidates(QWEN3_30B, 16, only=(64,)) == []  # past its twice the rows
    down = tune.tile_candidates(128, QWEN3_30B.hidden, QWEN3_30B.intermediate, 1, 2)
    gate_up = tune.tile_candidates(128, QWEN3_30B.intermediate, QWEN3_30B.hidden, 2, 2)
    assert len(set(down)) == len(down) and set(gate_up) < set(down)
    big = GemmTiles(block_n=256, block_k=256, group_m=1, num_warps=8, num_stages=3)
    assert big not in down  # 3 * (128 * 256 + 256 * 256) * 2 bytes: 576 KiB
    for tiles in gate_up:
        assert tune.shared_memory_bytes(128, tiles, 2, 2) <= tune.SHARED_MEMORY_BYTES
    # A narrow GEMM takes no tiles wider than its power of two.
    narrow = tune.tile_candidates(16, 40, 36, 1, 2)
    assert {t.block_n for t in narrow} == {32, 64} and {t.block_k for t in narrow} == {64}


def test_the_tuners_compile_processes_share_each_kernel_of_the_run_once() -> None:
    from outrider.plugins.models.moe import tune

    # 1,024 and 2,048 tokens share the row blocks 64 and 128: their kernels compile once.
    run = tune.run_candidates(QWEN3_30B, [1024, 2048], 2, only=(64, 128))
    per_block = [tune.gemm_candidates(QWEN3_30B, m, 2) for m in (64, 128)]
    assert len(run) == len(set(run)) == sum(map(len, per_block)) == 64 + 92 + 44 + 68
    assert set(run) == set(per_block[0]) | set(per_block[1])
    assert {c.gemm for c in run} == {"gate_up", "down"}
    # Sizes below a row block's reach add none of its kernels.
    assert {c.block_m for c in tune.run_candidates(QWEN3_30B, [16, 256], 2)} == {16, 32}
    dealt = tune.shares(run, 8)
    dealt_once = [c for share in dealt for c in share]
    assert len(dealt) == 8 and len(dealt_once) == len(run) and set(dealt_once) == set(run)
    assert max(map(len, dealt)) - min(map(len, dealt)) <= 1
    assert tune.shares(run[:3], 8) == [[run[0]], [run[1]], [run[2]]]


def test_the_tuner_merges_its_configs_into_the_table_file(tmp_path: Path) -> None:
    from outrider.plugins.models.moe import tune

    other = MoeShape(experts=8, hidden=64, intermediate=32, topk=2)
    path = tmp_path / "configs" / "NVIDIA_H100_80GB_HBM3.json"
    configs = {256: heuristic_config(SMALL, 256), 16: heuristic_config(SMALL, 16)}
    tune.write_table(path, SMALL, configs, source="run one")
    tune.write_table(path, other, {8: SMALL_CONFIG}, source="run two")
    tune.write_table(path, SMALL, {32: SMALL_CONFIG}, source="run three")
    doc = json.loads(path.read_text())
    assert doc["tuned"] is True
    assert doc["sources"] == {SMALL.key: "run three", other.key: "run two"}
    assert load_table(path) == {SMALL.key: {32: SMALL_CONFIG}, other.key: {8: SMALL_CONFIG}}
    # Buckets in order, one line each.
    tune.write_table(path, SMALL, configs, source="run four")
    lines = [line for line in path.read_text().splitlines() if '"block_m"' in line]
    assert [line.split(":")[0].strip() for line in lines] == ['"16"', '"256"', '"8"']
    # A decode path goes beside the buckets and survives a later run that times none.
    reach = DecodePath(4, GemvTiles(4, 1024, 4, 3))
    tune.write_table(path, other, {8: SMALL_CONFIG}, source="run five", decode=reach)
    tune.write_table(path, SMALL, {32: SMALL_CONFIG}, source="run six")
    assert load_decode(path) == {other.key: reach}
    assert load_table(path) == {SMALL.key: {32: SMALL_CONFIG}, other.key: {8: SMALL_CONFIG}}
    # Tuning into the shipped, untuned generation file keeps it marked untuned.
    untuned = tmp_path / "sm90.json"
    untuned.write_text((CONFIG_DIR / "sm90.json").read_text())
    tune.write_table(untuned, SMALL, configs, source="run five")
    assert json.loads(untuned.read_text())["tuned"] is False


@pytest.mark.skipif(CUDA, reason="the tuner's refusal without a GPU")
def test_the_tuner_refuses_to_run_without_a_gpu() -> None:
    from outrider.plugins.models.moe import tune

    argv = ["--experts", "8", "--hidden", "64", "--intermediate", "32", "--topk", "2"]
    assert tune.parse_args([*argv, "--tokens", "1,8"]).tokens == "1,8"
    assert tune.parse_args([*argv, "--block-m", "64", "128"]).block_m == [64, 128]
    with pytest.raises(SystemExit, match="on a CUDA device"):
        tune.main(argv)
    with pytest.raises(SystemExit, match=r"^--jobs 0: at least one process compiles$"):
        tune.main([*argv, "--jobs", "0"])
    # A row block no batch size can take is refused before any device is needed.
    with pytest.raises(SystemExit) as refused:
        tune.main([*argv, "--tokens", "1,64", "--block-m", "64"])
    assert str(refused.value) == (
        "--block-m 64 leaves no row block to time at 1 tokens (its candidates: [16])"
    )


@pytest.mark.gpu
def test_the_tuner_compiles_in_processes_then_times(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from outrider.plugins.models.moe import tune

    argv = ["--experts", "8", "--hidden", "64", "--intermediate", "32", "--topk", "2"]
    out = tmp_path / "table.json"
    tune.main([*argv, "--tokens", "16,64", "--jobs", "2", "--out", str(out)])
    compiled = len(tune.run_candidates(MoeShape(8, 64, 32, 2), [16, 64], 2))
    assert f"compiled {compiled} grouped kernels in 2 processes" in capsys.readouterr().out
    assert set(load_table(out)["experts=8,hidden=64,intermediate=32,topk=2"]) == {16, 64}


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 9, 64, 300, 2500])
def test_fused_moe_matches_the_reference_at_a_real_shape(tokens: int) -> None:
    from outrider.plugins.models.moe import kernels as mk

    # Qwen3-30B-A3B's layer: the GEMVs up to 8 tokens, one grouped chunk, two chunks.
    batch = routed_batch(QWEN3_30B, tokens, torch.bfloat16)
    torch.testing.assert_close(mk.fused_moe(*batch), reference_moe(*batch), **BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 2500])
def test_fused_moe_never_waits_for_the_device_on_the_host(tokens: int) -> None:
    """The GEMVs, one grouped chunk and two: a prompt batch's MoE layers launch without a host
    synchronisation (the reference's grouping reads the experts hit on the host; this path
    must not)."""
    from outrider.daemon.engine.sync_check import sync_checked
    from outrider.plugins.models.moe import kernels as mk

    batch = routed_batch(QWEN3_30B, tokens, torch.bfloat16)
    mk.fused_moe(*batch)  # compile outside the check
    torch.cuda.synchronize()
    with sync_checked(True):
        out = mk.fused_moe(*batch)
    torch.testing.assert_close(out, reference_moe(*batch), **BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [4, 64])
def test_fused_moe_replays_in_a_cuda_graph(tokens: int) -> None:
    from outrider.plugins.models.moe import kernels as mk

    x, w13, w2, weights, ids = routed_batch(QWEN3_30B, tokens, torch.bfloat16)
    mk.fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mk.fused_moe(x, w13, w2, weights, ids)
    # New tokens and a new routing in the captured buffers.
    fresh = routed_batch(QWEN3_30B, tokens, torch.bfloat16, seed=7)
    for buffer, value in zip((x, weights, ids), (fresh[0], fresh[3], fresh[4]), strict=True):
        buffer.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, reference_moe(x, w13, w2, weights, ids), **BF16_TOL)
