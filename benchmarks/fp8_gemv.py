"""The one-token projections of FP8 checkpoints against bfloat16's, alone (GPU only).

    python benchmarks/fp8_gemv.py

Per projection shape of Llama-3.1-8B and Qwen3-30B-A3B (N x K): the bfloat16 GEMV
(``triton_kernels.gemv``), ``torch._scaled_mm`` at one row, and the FP8 GEMVs of
``fp8/kernels.py`` (per channel, and block-scaled 128 x 128) at each candidate tile; then
the FP8 experts' decode path (``fp8/moe_kernels.py``) at Qwen3-30B-A3B's shape against the
bfloat16 one's. Each time is a call's device time inside a CUDA graph of 24 calls replayed
10 times, the calls cycling over enough copies of the weights that none is read from L2; the
rate is the weight bytes over that time. The last lines name the tiles whose summed time over
the shapes is least, per kernel.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable
from functools import partial

import torch

from outrider.plugins.models import triton_kernels
from outrider.plugins.models.fp8 import kernels as fk
from outrider.plugins.models.fp8 import moe_kernels as fmk
from outrider.plugins.models.fp8.reference import Fp8ExpertWeights, quantize_weight
from outrider.plugins.models.moe import kernels as mk
from outrider.plugins.models.moe.tiles import DEFAULT_DECODE_TILES, GemvTiles

SHAPES = {  # name: (N, K)
    "llama qkv": (6144, 4096),
    "llama o": (4096, 4096),
    "llama gate_up": (28672, 4096),
    "llama down": (4096, 14336),
    "qwen3-30b qkv": (5120, 2048),
    "qwen3-30b o": (2048, 4096),
}
TILES = [
    GemvTiles(n, k, w, s)
    for n, k, w, s in itertools.product((4, 8, 16), (1024, 2048, 4096), (4, 8), (2, 3, 4))
]
CALLS, REPLAYS = 24, 10
L2_BYTES = 64 << 20  # above the H100's and H200's 50 MiB
MOE = {"experts": 128, "hidden": 2048, "intermediate": 768, "topk": 8}


def device_us(calls: list[Callable[[], object]]) -> float:
    """A call's device time in a CUDA graph of ``CALLS`` calls cycling over ``calls``."""
    for call in calls:
        call()  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            calls[i % len(calls)]()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * CALLS)


def rate(us: float, weight_bytes: int) -> str:
    return f"{us:7.1f} us {weight_bytes / us / 1e3:6.0f} GB/s"


def copies(weight_bytes: int) -> int:
    return max(1, -(-2 * L2_BYTES // weight_bytes))


def dense(best: dict[str, dict[GemvTiles, float]]) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        x = torch.randn(1, k, generator=gen, device="cuda").bfloat16()
        raw = [torch.randn(n, k, generator=gen, device="cuda") for _ in range(copies(n * k))]
        bf16 = [w.bfloat16() for w in raw]
        channel = [quantize_weight(w, None) for w in raw]
        block = [quantize_weight(w, (128, 128)) for w in raw]
        del raw
        line = [f"{name:14} {n:>6} x {k:<6}"]

        us = device_us([partial(triton_kernels.gemv, x, w, None) for w in bf16])
        line.append(f"bf16 {rate(us, n * k * 2)}")
        us = device_us([partial(fk.channel_scaled_mm, x, w, None) for w in channel])
        line.append(f"scaled_mm {rate(us, n * k)}")
        defaults = {"channel": fk.CHANNEL_GEMV_TILES, "block": fk.BLOCK_GEMV_TILES}
        for kind, weights, run in (
            ("channel", channel, fk.channel_gemv),
            ("block", block, fk.block_gemv),
        ):
            timed = {}
            for tiles in TILES:
                timed[tiles] = device_us([partial(run, x, w, None, tiles) for w in weights])
                best[kind][tiles] += timed[tiles]
            fastest = min(timed, key=timed.__getitem__)
            default = timed.get(defaults[kind], float("nan"))
            line.append(f"{kind} {rate(timed[fastest], n * k)} (default {default:.1f} us)")
        print(" | ".join(line), flush=True)
        del bf16, channel, block


def experts(best: dict[str, dict[GemvTiles, float]]) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    e, h, i, topk = MOE["experts"], MOE["hidden"], MOE["intermediate"], MOE["topk"]
    w13 = torch.randn(e, 2 * i, h, generator=gen, device="cuda") / h**0.5
    w2 = torch.randn(e, h, i, generator=gen, device="cuda") / i**0.5
    up = [quantize_weight(w, (128, 128)) for w in w13]
    down = [quantize_weight(w, (128, 128)) for w in w2]
    fp8 = Fp8ExpertWeights(
        torch.stack([w.data for w in up]),
        torch.stack([w.scale for w in up]),
        torch.stack([w.data for w in down]),
        torch.stack([w.scale for w in down]),
        (128, 128),
    )
    bf13, bf2 = w13.bfloat16(), w2.bfloat16()
    del w13, w2, up, down
    for tokens in (1, 8):
        x = torch.randn(tokens, h, generator=gen, device="cuda").bfloat16()
        weights, ids = torch.topk(torch.randn(tokens, e, device="cuda").softmax(-1), topk)
        ids = ids.int()
        out = torch.empty_like(x)
        bytes_read = tokens * topk * 3 * h * i  # FP8 bytes of the chosen experts (distinct or not)
        us = device_us([partial(mk.decode_moe, x, bf13, bf2, weights, ids, out)])
        line = [f"moe decode {tokens:>2} tokens | bf16 {us:7.1f} us ({DEFAULT_DECODE_TILES})"]
        timed = {}
        for tiles in TILES:
            timed[tiles] = device_us(
                [partial(fmk.decode_moe_fp8, x, fp8, weights, ids, out, tiles)]
            )
            best[f"moe {tokens}"][tiles] += timed[tiles]
        fastest = min(timed, key=timed.__getitem__)
        gbs = bytes_read / timed[fastest] / 1e3
        line.append(f"fp8 {timed[fastest]:7.1f} us {gbs:6.0f} GB/s at {fastest}")
        line.append(f"fp8 at DECODE_TILES {timed[fmk.DECODE_TILES]:.1f} us")
        print(" | ".join(line), flush=True)


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    best: dict[str, dict[GemvTiles, float]] = defaultdict(lambda: defaultdict(float))
    dense(best)
    experts(best)
    for kind, summed in best.items():
        ranked = sorted(summed, key=summed.__getitem__)[:3]
        print(f"best {kind}: " + "; ".join(f"{t} {summed[t]:.1f} us" for t in ranked))


if __name__ == "__main__":
    main()
