"""The bfloat16 one-token GEMV (``triton_kernels.gemv``, and ``silu_mul_gemv`` for the down
projection) over its tile grid, per projection of Llama-3.1-8B and Qwen3-8B at one and two
tensor-parallel ranks (GPU only).

    python benchmarks/gemv_tiles.py [--top 3]

Each time is a call's device time inside a CUDA graph of calls cycling over enough copies of
the weights that none is read from L2 (``fp8_gemv.device_us``); the rate is the weight bytes
over that time. Per shape: the kernel's own tiles, then the ``--top`` fastest of the grid;
last, the tiles whose summed time over a model's shapes at each rank count is least.
"""

from __future__ import annotations

import argparse
import itertools
from collections import defaultdict
from functools import partial

import torch
from fp8_gemv import copies, device_us, rate

from outrider.plugins.models import triton_kernels as tk
from outrider.plugins.models.moe.tiles import GemvTiles

# (model, ranks, projection): (N, K, gated). A column-parallel projection (q/k/v, gate/up, the
# LM head) splits N over the ranks, a row-parallel one (o, down) K; down's input is gate and up.
SHAPES = {
    ("llama", 1, "qkv"): (6144, 4096, False),
    ("llama", 1, "o"): (4096, 4096, False),
    ("llama", 1, "gate_up"): (28672, 4096, False),
    ("llama", 1, "down"): (4096, 14336, True),
    ("llama", 1, "lm_head"): (128256, 4096, False),
    ("llama", 2, "qkv"): (3072, 4096, False),
    ("llama", 2, "o"): (4096, 2048, False),
    ("llama", 2, "gate_up"): (14336, 4096, False),
    ("llama", 2, "down"): (4096, 7168, True),
    ("llama", 2, "lm_head"): (64128, 4096, False),
    ("qwen3", 1, "gate_up"): (24576, 4096, False),
    ("qwen3", 1, "down"): (4096, 12288, True),
    ("qwen3", 1, "lm_head"): (151936, 4096, False),
}
TILES = [
    GemvTiles(n, k, w, s)
    for n, k, w, s in itertools.product((4, 8, 16), (512, 1024, 2048), (4, 8), (2, 3, 4))
]
OWN = tk.GEMV_TILES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=3)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    summed: dict[tuple[str, int], dict[GemvTiles, float]] = defaultdict(lambda: defaultdict(float))
    for (model, ranks, name), (n, k, gated) in SHAPES.items():
        x = torch.randn(1, 2 * k if gated else k, generator=gen, device="cuda").bfloat16()
        weights = [
            torch.randn(n, k, generator=gen, device="cuda").bfloat16()
            for _ in range(copies(2 * n * k))
        ]
        kernel = tk.silu_mul_gemv if gated else tk.gemv
        times = {}
        for tiles in dict.fromkeys([*TILES, OWN]):
            calls = [partial(kernel, x, w, None, tiles) for w in weights]
            times[tiles] = device_us(calls)
            summed[(model, ranks)][tiles] += times[tiles]
        print(f"{model} tp{ranks} {name} {n} x {k}: own {rate(times[OWN], 2 * n * k)}")
        for tiles in sorted(TILES, key=times.__getitem__)[: args.top]:
            print(f"    {tiles}: {rate(times[tiles], 2 * n * k)}")
        del weights
        torch.cuda.empty_cache()
    for (model, ranks), by_tiles in summed.items():
        best = min(TILES, key=by_tiles.__getitem__)
        print(f"{model} tp{ranks}: best over its shapes {best} {by_tiles[best]:.1f} us, "
              f"own {by_tiles[OWN]:.1f} us")  # fmt: skip


if __name__ == "__main__":
    main()
