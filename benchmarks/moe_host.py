"""One fused MoE layer on the GPU: how long the host takes to launch it against how long the
device takes to run it, piece by piece, and the device time of the grouped path under other
configs (``--config``, JSON as in ``moe/configs``) beside the table's.

    python benchmarks/moe_host.py --tokens 1024 2048 \\
        --config '{"block_m": 64, "gate_up": {...}, "down": {...}}'

Host time: the device is first given a long sleep, so every launch returns without waiting;
the mean over ``--calls`` calls. Device time: ``triton.testing.do_bench``. A layer whose
host time exceeds its device time is launch-bound in an eager (prompt) step.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import triton

from outrider.plugins.models.moe import align
from outrider.plugins.models.moe import kernels as mk
from outrider.plugins.models.moe.tiles import MoeKernelConfig, MoeShape, config_for
from outrider.plugins.models.moe.tune import TuneInputs

# About 0.5 s of device sleep at H200 clocks: longer than any piece's launches.
SLEEP_CYCLES = 1_000_000_000


def host_us(fn: Callable[[], object], calls: int) -> float:
    """Mean host microseconds of ``fn`` while the device is asleep."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def device_us(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=50)) * 1e3


def pieces(
    shape: MoeShape, inputs: TuneInputs, config: MoeKernelConfig
) -> dict[str, Callable[[], object]]:
    """The grouped path's steps at ``config``, each runnable alone, and the whole layer."""
    aligned = align.align_pairs(inputs.topk_ids, shape.experts, config.block_m)
    h = mk.gate_up(inputs.x, inputs.w13, aligned, config)
    parts = mk.down(h, inputs.w2, inputs.topk_weights, aligned, config)
    out = torch.empty_like(inputs.x)
    layer = (inputs.x, inputs.w13, inputs.w2, inputs.topk_weights, inputs.topk_ids)
    return {
        "fused_moe": lambda: mk.fused_moe(*layer),
        "config_for": lambda: config_for(shape, inputs.x.shape[0], inputs.x.device),
        "align_pairs": lambda: align.align_pairs(inputs.topk_ids, shape.experts, config.block_m),
        "gate_up": lambda: mk.gate_up(inputs.x, inputs.w13, aligned, config),
        "down": lambda: mk.down(h, inputs.w2, inputs.topk_weights, aligned, config),
        "sum_slots": lambda: mk.sum_slots(parts, out, shape.topk),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--config", action="append", default=[], help="a config's JSON")
    args = parser.parse_args()
    shape = MoeShape(args.experts, args.hidden, args.intermediate, args.topk)
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{shape.key} on {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}")  # fmt: skip
    for tokens in args.tokens:
        inputs = TuneInputs.random(shape, tokens, torch.bfloat16, gen)
        table = config_for(shape, tokens, inputs.x.device)
        print(f"tokens {tokens}, the table's {table}")
        for name, fn in pieces(shape, inputs, table).items():
            print(f"  {name:12s} host {host_us(fn, args.calls):8.1f} us  "
                  f"device {device_us(fn):8.1f} us")  # fmt: skip
        for raw in args.config:
            config = MoeKernelConfig.from_json(json.loads(raw))
            run = pieces(shape, inputs, config)
            grouped = sum(
                device_us(run[n]) for n in ("align_pairs", "gate_up", "down", "sum_slots")
            )
            print(f"  grouped at {config}: device {grouped:.1f} us")


if __name__ == "__main__":
    main()
