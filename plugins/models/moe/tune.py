"""``python -m outrider.plugins.models.moe.tune``: time the fused MoE GEMMs' candidate tiles on
this GPU for one MoE shape and a list of batch sizes, and write the fastest per batch size into
a table file (``moe/tiles.py``), by default ``moe/configs/<device name>.json`` in the package.

For each batch size and each row block ``block_m`` the two GEMMs are timed apart over one
random routing (their tiles are independent once the rows are aligned): a config is the
``block_m`` whose alignment plus best gate/up plus best down is the least, with those tiles.
A candidate's compiled kernel serves every batch size (the batch's counts are not specialized
on: triton_launch.py's ``batch_jit``): the grid is what a batch size changes. The decode path
(the GEMVs) is timed at its candidate tiles beside the grouped path's, up to
``4 * DEFAULT_DECODE_PAIRS`` pairs: the table's ``DecodePath`` for the shape serves the
batch sizes, from the smallest timed, where the GEMVs were faster, with the tiles fastest
at the smallest.

    python -m outrider.plugins.models.moe.tune --experts 128 --hidden 2048 \\
        --intermediate 768 --topk 8

A batch size times some hundreds of candidates at its largest sizes, each compiled once
(about a second). Before timing, ``--jobs`` processes compile every grouped candidate of the
run at once (each launches its share once on the same GPU; Triton's disk cache keeps the
kernels, and the timing loads them); the decode path's GEMVs compile as they are timed.
``--block-m`` times only the row blocks it names, and the table's source says so, since a
row block left out may have been the fastest.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import triton

from outrider.plugins.models.moe import align
from outrider.plugins.models.moe import kernels as mk
from outrider.plugins.models.moe.memory import MAX_CHUNK_PAIRS
from outrider.plugins.models.moe.tiles import (
    CONFIG_DIR,
    DEFAULT_DECODE_PAIRS,
    DecodePath,
    GemmTiles,
    GemvTiles,
    MoeKernelConfig,
    MoeShape,
    device_file_stem,
)

BLOCK_MS = (16, 32, 64, 128)
BLOCK_NS = (32, 64, 128, 256)
BLOCK_KS = (64, 128, 256)
GROUP_MS = (1, 16)
WARPS = (4, 8)
STAGES = (3, 4, 5)
GEMV_BLOCK_NS = (4, 8, 16, 32)
GEMV_BLOCK_KS = (256, 512, 1024)
GEMV_STAGES = (2, 3, 4)
DEFAULT_TOKENS = (16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
Tiles = TypeVar("Tiles", GemmTiles, GemvTiles)
# Hopper's shared memory a program may use (227 KiB), which the pipeline stages fill.
SHARED_MEMORY_BYTES = 227 * 1024


def block_m_candidates(shape: MoeShape, tokens: int, only: Sequence[int] = ()) -> list[int]:
    """Row blocks up to twice the average rows an expert receives (rounded up to a power of
    two; at least 16, the smallest ``tl.dot``), those in ``only`` where given."""
    rows = triton.cdiv(tokens * shape.topk, shape.experts)
    limit = max(16, 2 * triton.next_power_of_2(rows))
    return [m for m in BLOCK_MS if m <= limit and (not only or m in only)]


def shared_memory_bytes(block_m: int, tiles: GemmTiles, weight_tiles: int, elem: int) -> int:
    """The pipeline's buffers: ``num_stages`` copies of the row tile and the weight tiles."""
    step = block_m * tiles.block_k + weight_tiles * tiles.block_k * tiles.block_n
    return tiles.num_stages * step * elem


def tile_candidates(block_m: int, n: int, k: int, weight_tiles: int, elem: int) -> list[GemmTiles]:
    """The tiles worth timing for a GEMM of ``n`` output columns reducing over ``k``, whose
    programs load ``weight_tiles`` weight tiles a step (gate/up: 2)."""
    found = []
    for bn, bk, group, warps, stages in itertools.product(
        BLOCK_NS, BLOCK_KS, GROUP_MS, WARPS, STAGES
    ):
        tiles = GemmTiles(bn, bk, group, warps, stages)
        if bn > max(32, triton.next_power_of_2(n)) or bk > max(64, triton.next_power_of_2(k)):
            continue
        if shared_memory_bytes(block_m, tiles, weight_tiles, elem) <= SHARED_MEMORY_BYTES:
            found.append(tiles)
    return found


@dataclass(frozen=True)
class Candidate:
    """One grouped kernel a run times: a GEMM (``gate_up`` or ``down``) at a row block."""

    gemm: str
    block_m: int
    tiles: GemmTiles


def gemm_candidates(shape: MoeShape, block_m: int, elem: int) -> list[Candidate]:
    """Both GEMMs' candidates at ``block_m`` (gate/up loads two weight tiles a step)."""
    gate_up = tile_candidates(block_m, shape.intermediate, shape.hidden, 2, elem)
    down = tile_candidates(block_m, shape.hidden, shape.intermediate, 1, elem)
    return [Candidate("gate_up", block_m, t) for t in gate_up] + [
        Candidate("down", block_m, t) for t in down
    ]


def run_candidates(
    shape: MoeShape, tokens: Sequence[int], elem: int, only: Sequence[int] = ()
) -> list[Candidate]:
    """Every grouped kernel a run over ``tokens`` times, once each: a kernel serves every batch
    size (its counts are not specialized on), so sizes sharing a row block share kernels."""
    block_ms = sorted({m for t in tokens for m in block_m_candidates(shape, t, only)})
    return [c for m in block_ms for c in gemm_candidates(shape, m, elem)]


def shares(candidates: Sequence[Candidate], jobs: int) -> list[list[Candidate]]:
    """``candidates`` dealt to at most ``jobs`` processes, none empty."""
    dealt = [list(candidates[i::jobs]) for i in range(jobs)]
    return [share for share in dealt if share]


def _compile_share(shape: MoeShape, tokens: int, dtype: torch.dtype, share: list[Candidate]) -> int:
    """Launch each of ``share`` once on random inputs of ``tokens`` (a worker process: the
    launch compiles into Triton's disk cache); how many ran."""
    inputs = TuneInputs.random(shape, tokens, dtype, torch.Generator(device="cuda"))
    aligned = {
        m: align.align_pairs(inputs.topk_ids, shape.experts, m) for m in {c.block_m for c in share}
    }
    for c in share:
        config = MoeKernelConfig(c.block_m, c.tiles, c.tiles)
        pairs = aligned[c.block_m]
        if c.gemm == "gate_up":
            mk.gate_up(inputs.x, inputs.w13, pairs, config)
        else:
            h = torch.zeros((pairs.num_pairs, shape.intermediate), dtype=dtype, device="cuda")
            mk.down(h, inputs.w2, inputs.topk_weights, pairs, config)
    torch.cuda.synchronize()
    return len(share)


def precompile(
    shape: MoeShape, tokens: int, dtype: torch.dtype, candidates: list[Candidate], jobs: int
) -> None:
    """Compile ``candidates`` in ``jobs`` processes on this GPU (spawned: CUDA does not survive
    a fork), each on its own inputs of ``tokens``."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=context) as pool:
        done = sum(
            pool.map(partial(_compile_share, shape, tokens, dtype), shares(candidates, jobs))
        )
    print(f"compiled {done} grouped kernels in {jobs} processes", flush=True)


def gemv_candidates() -> list[GemvTiles]:
    """The decode path's tiles worth timing."""
    product = itertools.product(GEMV_BLOCK_NS, GEMV_BLOCK_KS, WARPS, GEMV_STAGES)
    return [GemvTiles(*tiles) for tiles in product]


def table_document(
    existing: dict[str, Any] | None,
    shape: MoeShape,
    configs: dict[int, MoeKernelConfig],
    source: str,
    decode: DecodePath | None = None,
) -> dict[str, Any]:
    """``existing`` (a table file's JSON, or None) with ``shape``'s buckets replaced by
    ``configs`` and its decode path by ``decode`` (where given); other shapes kept. A file
    stays untuned if it was."""
    doc = existing or {"tuned": True, "note": "timed by moe.tune", "shapes": {}, "sources": {}}
    doc.setdefault("sources", {})[shape.key] = source
    doc["shapes"][shape.key] = {str(t): configs[t].to_json() for t in sorted(configs)}
    if decode is not None:
        doc.setdefault("decode", {})[shape.key] = decode.to_json()
    return doc


def format_table(doc: dict[str, Any]) -> str:
    """JSON with one line a config."""
    lines = ["{"]
    for key, value in doc.items():
        if key not in ("shapes", "decode"):
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)},")
    lines.append('  "shapes": {')
    shapes = list(doc["shapes"].items())
    for i, (shape, buckets) in enumerate(shapes):
        lines.append(f"    {json.dumps(shape)}: {{")
        rows = [f"      {json.dumps(b)}: {json.dumps(cfg)}" for b, cfg in buckets.items()]
        lines.append(",\n".join(rows))
        lines.append("    }" + ("," if i + 1 < len(shapes) else ""))
    lines.append("  }")
    if "decode" in doc:
        lines[-1] += ","
        paths = [f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in doc["decode"].items()]
        lines.extend(['  "decode": {', ",\n".join(paths), "  }"])
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_table(
    path: Path,
    shape: MoeShape,
    configs: dict[int, MoeKernelConfig],
    source: str,
    decode: DecodePath | None = None,
) -> None:
    """Write ``configs`` (and ``decode``) for ``shape`` into the table file at ``path``
    (merged)."""
    existing = json.loads(path.read_text()) if path.exists() else None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(format_table(table_document(existing, shape, configs, source, decode)))


def _time_ms(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=40))


@dataclass(frozen=True)
class TuneInputs:
    """One random batch and layer of ``shape``, on the current GPU."""

    x: torch.Tensor  # [T, H]
    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    topk_weights: torch.Tensor  # [T, k] float32
    topk_ids: torch.Tensor  # [T, k] int32

    @classmethod
    def random(
        cls, shape: MoeShape, tokens: int, dtype: torch.dtype, gen: torch.Generator
    ) -> TuneInputs:
        e, h, i = shape.experts, shape.hidden, shape.intermediate

        def randn(*size: int) -> torch.Tensor:
            return torch.randn(*size, generator=gen, device="cuda")

        weights, ids = torch.topk(randn(tokens, e).softmax(-1), shape.topk)
        return cls(
            randn(tokens, h).to(dtype),
            (randn(e, 2 * i, h) / h**0.5).to(dtype),
            (randn(e, h, i) / i**0.5).to(dtype),
            weights,
            ids.to(torch.int32),
        )


def fastest_tiles(candidates: list[Tiles], run: Callable[[Tiles], object]) -> tuple[float, Tiles]:
    """The least time of ``run`` over ``candidates``, and its tiles."""
    timed = [(_time_ms(partial(run, tiles)), tiles) for tiles in candidates]
    return min(timed, key=lambda pair: pair[0])


def tune_block_m(
    shape: MoeShape, inputs: TuneInputs, block_m: int
) -> tuple[float, MoeKernelConfig]:
    """The least time of the grouped path with rows aligned to ``block_m``, and its config."""
    aligned = align.align_pairs(inputs.topk_ids, shape.experts, block_m)
    align_ms = _time_ms(partial(align.align_pairs, inputs.topk_ids, shape.experts, block_m))
    candidates = gemm_candidates(shape, block_m, inputs.x.element_size())

    def of(gemm: str) -> list[GemmTiles]:
        return [c.tiles for c in candidates if c.gemm == gemm]

    def run_gate_up(tiles: GemmTiles) -> torch.Tensor:
        return mk.gate_up(inputs.x, inputs.w13, aligned, MoeKernelConfig(block_m, tiles, tiles))

    gate_up_ms, gate_up_tiles = fastest_tiles(of("gate_up"), run_gate_up)
    h = run_gate_up(gate_up_tiles)

    def run_down(tiles: GemmTiles) -> torch.Tensor:
        config = MoeKernelConfig(block_m, tiles, tiles)
        return mk.down(h, inputs.w2, inputs.topk_weights, aligned, config)

    down_ms, down_tiles = fastest_tiles(of("down"), run_down)
    return align_ms + gate_up_ms + down_ms, MoeKernelConfig(block_m, gate_up_tiles, down_tiles)


@dataclass(frozen=True)
class Timed:
    """One batch size's fastest grouped config and, where timed, decode tiles."""

    config: MoeKernelConfig
    grouped_ms: float
    decode: tuple[float, GemvTiles] | None


def tune_tokens(
    shape: MoeShape,
    tokens: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    block_ms: Sequence[int] = (),
) -> Timed:
    """The fastest configs at ``tokens`` (random inputs and routing, on the current GPU), over
    the row blocks of ``block_ms`` only where given."""
    inputs = TuneInputs.random(shape, tokens, dtype, gen)
    candidates = block_m_candidates(shape, tokens, block_ms)
    ms, config = min(
        (tune_block_m(shape, inputs, block_m) for block_m in candidates), key=lambda pair: pair[0]
    )
    line = f"tokens {tokens}: grouped {ms * 1e3:.1f} us {config}"
    decode = None
    if tokens * shape.topk <= 4 * DEFAULT_DECODE_PAIRS:
        out = torch.empty_like(inputs.x)

        def run_decode(tiles: GemvTiles) -> torch.Tensor:
            return mk.decode_moe(
                inputs.x, inputs.w13, inputs.w2, inputs.topk_weights, inputs.topk_ids, out, tiles
            )

        decode = fastest_tiles(gemv_candidates(), run_decode)
        line += f"; decode {decode[0] * 1e3:.1f} us at {decode[1]}"
    print(line, flush=True)
    return Timed(config, ms, decode)


def decode_path(timed: dict[int, Timed]) -> DecodePath | None:
    """The batch sizes, from the smallest timed on, whose decode path beat the grouped one,
    with the decode tiles fastest at the smallest; None where the smallest was not timed
    for the decode path."""
    sizes = sorted(timed)
    first = timed[sizes[0]].decode
    if first is None:
        return None
    reach = 0
    for tokens in sizes:
        decode = timed[tokens].decode
        if decode is None or decode[0] >= timed[tokens].grouped_ms:
            break
        reach = tokens
    return DecodePath(reach, first[1])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m outrider.plugins.models.moe.tune")
    parser.add_argument("--experts", type=int, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--intermediate", type=int, required=True, help="per rank under TP")
    parser.add_argument("--topk", type=int, required=True)
    parser.add_argument(
        "--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="comma-separated batch sizes"
    )
    parser.add_argument(
        "--block-m", type=int, nargs="+", choices=BLOCK_MS, default=[],
        help="time only these row blocks (default: every candidate of each batch size)",
    )  # fmt: skip
    parser.add_argument(
        "--jobs", type=int, default=8,
        help="processes compiling the grouped candidates before timing (1: each compiles as "
        "it is first timed); each holds one layer's experts on the GPU",
    )  # fmt: skip
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="default: moe/configs/<device name>.json")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    shape = MoeShape(args.experts, args.hidden, args.intermediate, args.topk)
    # fused_moe runs larger batches in chunks of this many tokens: larger sizes never occur.
    largest = MAX_CHUNK_PAIRS // shape.topk
    tokens = sorted({min(int(t), largest) for t in args.tokens.split(",")})
    if args.jobs < 1:
        sys.exit(f"--jobs {args.jobs}: at least one process compiles")
    for t in tokens:
        if not block_m_candidates(shape, t, args.block_m):
            sys.exit(
                f"--block-m {' '.join(map(str, args.block_m))} leaves no row block to time at "
                f"{t} tokens (its candidates: {block_m_candidates(shape, t)})"
            )
    if not torch.cuda.is_available():
        sys.exit("moe.tune times kernels on a CUDA device: none is available")
    device_name = torch.cuda.get_device_name()
    out = args.out or CONFIG_DIR / f"{device_file_stem(device_name)}.json"
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    print(f"moe.tune {shape.key} {args.dtype} on {device_name}: {' '.join(sys.argv)}")
    source = (
        f"moe.tune on {device_name}, {args.dtype}, seed {args.seed}, "
        f"torch {torch.__version__}, triton {triton.__version__}"
    )
    if args.block_m:
        source += f", row blocks {' '.join(map(str, args.block_m))} only"
    if args.jobs > 1:
        candidates = run_candidates(shape, tokens, dtype.itemsize, args.block_m)
        precompile(shape, tokens[-1], dtype, candidates, args.jobs)
    timed: dict[int, Timed] = {}
    for t in tokens:
        timed[t] = tune_tokens(shape, t, dtype, gen, args.block_m)
        # Written after every batch size: a run stopped part-way keeps what it timed.
        configs = {size: entry.config for size, entry in timed.items()}
        write_table(out, shape, configs, source, decode_path(timed))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
