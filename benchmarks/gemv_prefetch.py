"""The one-token GEMV's L2 prefetch before its wait, against none, behind an idle kernel (GPU
only).

    python benchmarks/gemv_prefetch.py [--idle-us 0 4 8] [--budgets-mb 0 4 8 16 32]

At one token the kernels between two GEMVs (the add and norm, attention, the sum over GPUs)
leave the memory bus idle for a few microseconds while the next GEMV, launched dependent on
them (PDL), waits. Here a kernel that spins for ``--idle-us`` stands for them: each pair
(the spin, then ``triton_kernels.gemv`` at Llama-3.1-8B's projection shapes, one and two
ranks) is timed inside a CUDA graph of 24 pairs cycling over enough weight copies that none is
read from L2, with ``triton_kernels.PREFETCH_BYTES`` at each budget (0: no prefetch). Each
line gives the pair's device time per budget and the gain over no prefetch; the pair's
floor is the spin plus the weights' bytes at the read rate.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import triton
import triton.language as tl
from fp8_gemv import copies, device_us  # benchmarks/ is sys.path[0] when run as a script

from outrider.plugins.models import triton_kernels
from outrider.plugins.triton_launch import pdl_options, wait_for_previous

SHAPES = {  # name: (N, K), Llama-3.1-8B's projections at one rank and two
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "lm_head": (128256, 4096),
    "qkv tp2": (3072, 4096),
    "o tp2": (4096, 2048),
    "gate_up tp2": (14336, 4096),
}


@triton.jit
def _spin(ns, PDL: tl.constexpr):
    wait_for_previous(PDL)
    start = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )
    now = start
    while now - start < ns:
        now = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )


def pair(x: torch.Tensor, weight: torch.Tensor, idle_ns: int) -> None:
    if idle_ns:
        _spin[(1,)](idle_ns, **pdl_options(x.device))
    triton_kernels.gemv(x, weight, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-us", type=float, nargs="+", default=[0.0, 4.0, 8.0])
    parser.add_argument("--budgets-mb", type=int, nargs="+", default=[0, 4, 8, 16, 32])
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        x = torch.randn(1, k, generator=gen, device="cuda").bfloat16()
        weights = [
            torch.randn(n, k, generator=gen, device="cuda").bfloat16()
            for _ in range(copies(n * k * 2))
        ]
        for idle in args.idle_us:
            timed = {}
            for budget in args.budgets_mb:
                triton_kernels.PREFETCH_BYTES = budget << 20
                calls = [partial(pair, x, w, int(idle * 1e3)) for w in weights]
                timed[budget] = device_us(calls)  # type: ignore[arg-type]
            base = timed[args.budgets_mb[0]]
            cells = "  ".join(f"{b} MB {us:6.1f} us ({base / us:4.2f}x)" for b, us in timed.items())
            print(f"{name:12} {n:>6} x {k:<5} idle {idle:3.0f} us: {cells}", flush=True)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
