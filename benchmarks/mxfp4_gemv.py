"""gpt-oss's mxfp4 experts at decode sizes, the GEMVs alone over a grid of tiles (GPU only).

    python benchmarks/mxfp4_gemv.py [--tokens 1 4]

Per shape (gpt-oss-20b: 32 experts, gpt-oss-120b: 128; hidden and intermediate 2,880, 4 a
token; random mxfp4 blocks and scales, bfloat16 activations and biases) and batch, the device
time of ``mxfp4_decode_moe`` (both GEMVs) with each tile of ``TILES``, and the rate of the
bytes its tokens' experts hold (blocks and scales). Timed as ``fp8_gemv.py`` times: a CUDA
graph of 24 calls cycling over routings of disjoint experts, so that no call finds its
experts in L2. The last lines name the fastest tile per shape and batch.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from functools import partial

import torch
from fp8_gemv import device_us  # benchmarks/ is sys.path[0] when run as a script

from outrider.plugins.models.moe.mxfp4_kernels import (
    DECODE_TILES,
    Mxfp4ExpertWeights,
    mxfp4_decode_moe,
)
from outrider.plugins.models.moe.tiles import GemvTiles
from outrider.plugins.models.mxfp4 import BLOCK

HIDDEN = WIDTH = 2880
TOPK = 4
SHAPES = {"gpt-oss-20b": 32, "gpt-oss-120b": 128}  # experts
TILES = [
    GemvTiles(n, k, w, s)
    for n, k, w, s in itertools.product((2, 4, 8, 16), (64, 256, 1024), (4, 8), (2, 3, 4))
]


def experts_of(count: int, gen: torch.Generator) -> Mxfp4ExpertWeights:
    """``count`` random mxfp4 experts of gpt-oss's shape (scales near 2^0), drawn on the GPU
    (``gen``: a CUDA generator)."""

    def stored(out: int, into: int) -> tuple[torch.Tensor, torch.Tensor]:
        bytes_of = partial(torch.randint, generator=gen, device="cuda", dtype=torch.uint8)
        blocks = bytes_of(0, 256, (count, out, into // BLOCK, 16))
        return blocks, bytes_of(120, 128, (count, out, into // BLOCK))

    gate_up, down = stored(2 * WIDTH, HIDDEN), stored(HIDDEN, WIDTH)
    bias = [0.1 * torch.randn(count, n, generator=gen, device="cuda") for n in (2 * WIDTH, HIDDEN)]
    return Mxfp4ExpertWeights(
        *gate_up, bias[0].bfloat16(), *down, bias[1].bfloat16(),
        first=0, held=count, alpha=1.702, limit=7.0,
    )  # fmt: skip


def expert_bytes(experts: Mxfp4ExpertWeights) -> int:
    """The blocks and scales one expert holds."""
    parts = (experts.gate_up_blocks, experts.gate_up_scales, experts.down_blocks,
             experts.down_scales)  # fmt: skip
    return sum(part[0].numel() * part.element_size() for part in parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    gen = torch.Generator(device="cuda").manual_seed(0)
    best: list[str] = []
    for name, count in SHAPES.items():
        experts = experts_of(count, gen)
        for tokens in args.tokens:
            # Routings over disjoint experts where there are enough; each token its own.
            order = torch.randperm(count, generator=gen, device="cuda").cpu()
            per_call = tokens * TOPK
            routings = [
                order.roll(-i * per_call)[:per_call].view(tokens, TOPK)
                for i in range(max(1, count // per_call))
            ]
            x = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").bfloat16()
            weights = torch.full((tokens, TOPK), 1 / TOPK, device="cuda")
            read = len({int(e) for e in routings[0].flatten()}) * expert_bytes(experts)
            timed = {}
            for tiles in [DECODE_TILES, *TILES]:
                run = partial(mxfp4_decode_moe, x, experts, weights, tiles=tiles)
                calls: list[Callable[[], object]] = [
                    partial(run, topk_ids=ids.to("cuda", torch.int32)) for ids in routings
                ]
                timed[tiles] = device_us(calls)
            for tiles, us in timed.items():
                default = " (default)" if tiles == DECODE_TILES else ""
                print(f"{name} tokens {tokens} {tiles}: {us:7.1f} us "
                      f"{read / us / 1e3:6.0f} GB/s{default}")  # fmt: skip
            fastest = min(timed, key=timed.__getitem__)
            best.append(
                f"fastest, {name} at {tokens} tokens: {fastest}, {timed[fastest]:.1f} us "
                f"against the default's {timed[DECODE_TILES]:.1f}"
            )
        del experts
    print("\n".join(best))


if __name__ == "__main__":
    main()
