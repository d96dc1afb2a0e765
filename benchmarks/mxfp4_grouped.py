"""gpt-oss's mxfp4 experts past decode sizes: the grouped GEMMs over a grid of tiles (GPU only).

    python benchmarks/mxfp4_grouped.py [--tokens 512 4096] [--experts 32]

Per batch of tokens (gpt-oss's hidden and intermediate 2,880, 4 experts a token routed at
random over ``--experts``; random mxfp4 blocks and scales, bfloat16 activations), the device
time of ``mxfp4_grouped_moe`` with each tile of ``TILES`` and its rate in TFLOP/s (both
projections: 2 x 2,880 x 8,640 a routed pair), beside a bfloat16 ``torch.mm`` of the same
FLOPs as the limit (the tensor cores' measured rate). Timed as ``fp8_gemv.py`` times: a CUDA
graph of calls. The last lines name the fastest tile per batch.
"""

from __future__ import annotations

import argparse
import itertools
from functools import partial

import torch
from fp8_gemv import device_us  # benchmarks/ is sys.path[0] when run as a script
from mxfp4_gemv import HIDDEN, TOPK, WIDTH, experts_of

from outrider.plugins.models.moe.mxfp4_kernels import (
    GROUP_TILES,
    GroupTiles,
    mxfp4_grouped_moe,
)

TILES = [
    GroupTiles(rows, cols, step, warps, stages)
    for rows, cols, step, warps, stages in itertools.product(
        (16, 32, 64, 128), (32, 64, 128), (64, 128), (4, 8), (3,)
    )
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--experts", type=int, default=32)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts = experts_of(args.experts, gen)
    best: list[str] = []
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").bfloat16()
        draws = torch.rand(tokens, args.experts, generator=gen, device="cuda")
        ids = draws.argsort(dim=1)[:, :TOPK].int()  # distinct experts a token
        weights = torch.full((tokens, TOPK), 1 / TOPK, device="cuda")
        flops = 2 * tokens * TOPK * HIDDEN * (2 * WIDTH + WIDTH)
        a = torch.randn(tokens * TOPK, HIDDEN, generator=gen, device="cuda").bfloat16()
        b = torch.randn(HIDDEN, 3 * WIDTH, generator=gen, device="cuda").bfloat16()
        limit_us = device_us([partial(torch.mm, a, b)])
        print(f"tokens {tokens}: bfloat16 mm of the same FLOPs {limit_us:8.1f} us "
              f"{flops / limit_us / 1e6:6.0f} TFLOP/s")  # fmt: skip
        timed = {}
        for tiles in [GROUP_TILES, *TILES]:
            try:
                run = partial(mxfp4_grouped_moe, x, experts, weights, ids, tiles)
                timed[tiles] = device_us([run])
            except Exception as error:  # a tile past the shared memory: named, skipped
                print(f"tokens {tokens} {tiles}: failed ({type(error).__name__})")
        for tiles, us in timed.items():
            default = " (default)" if tiles == GROUP_TILES else ""
            print(f"tokens {tokens} {tiles}: {us:8.1f} us {flops / us / 1e6:6.0f} TFLOP/s{default}")
        fastest = min(timed, key=timed.__getitem__)
        best.append(
            f"fastest at {tokens} tokens: {fastest}, {timed[fastest]:.1f} us against the "
            f"default's {timed[GROUP_TILES]:.1f} and the mm's {limit_us:.1f}"
        )
    print("\n".join(best))


if __name__ == "__main__":
    main()
