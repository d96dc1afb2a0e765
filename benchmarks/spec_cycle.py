"""One speculative decode step (draft + verify + accept + draft catch-up) next to one plain
decode step, in process on the GPU, with dummy weights.

First a short pass with any host synchronisation inside a step raising
(``OUTRIDER_DEBUG_SYNC_CHECK``), then steady-state timing: ``batch`` requests decoding, the
overlap loop, the mean wall time of one loop turn (= one step) over ``--steps`` turns.

    python benchmarks/spec_cycle.py --model Llama-3.1-8B-Instruct.config.json \\
        --algorithm eagle3 --draft-model Llama-3.1-8B-EAGLE3.config.json --batch 1 32
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch

from outrider.daemon.bench.latency import benchmark_request, random_prompts
from outrider.daemon.config import ServeConfig
from outrider.daemon.engine.build import Engine, build_engine


@dataclass
class Row:
    algorithm: str
    batch: int
    step_ms: float
    tokens_per_step: float  # committed per request per step (1 + mean accepted drafts)


def _engine(args: argparse.Namespace, algorithm: str, batch: int) -> Engine:
    spec = algorithm != "none"
    config = ServeConfig(
        model=args.model,
        load_format="dummy",
        device="cuda",
        dtype="bfloat16",
        max_running=max(batch, 1),
        kv_cache_tokens=batch * (args.prompt + args.steps * 16 + 256) + 4096,
        context_length=args.prompt + args.steps * 16 + 128,
        page_size=args.page_size,
        speculative_algorithm=algorithm,
        draft_model=args.draft_model if spec else "",
        speculative_num_draft_tokens=args.num_draft_tokens if spec else 0,
        speculative_num_steps=args.num_steps if spec else 0,
        speculative_topk=args.topk if spec else 0,
    )
    return build_engine(config)


def _add(engine: Engine, batch: int, prompt: int, rid0: int) -> None:
    prompts = random_prompts(batch, prompt, engine.facts.vocab_size, seed=rid0)
    for rid, ids in enumerate(prompts, start=rid0):
        engine.scheduler.add(benchmark_request(rid, ids, None))


def _drain(engine: Engine) -> None:
    for rid in list(engine.scheduler.requests):
        engine.scheduler.abort(rid, "benchmark done")
    while engine.loop.has_work:
        engine.loop.iterate()


def measure(
    engine: Engine, algorithm: str, batch: int, steps: int, prompt: int, profile: bool = False
) -> Row:
    loop = engine.loop
    # Correctness pass: every launch under the sync check.
    loop.runner.enable_sync_check(True)
    _add(engine, batch, prompt, 0)
    for _ in range(8):
        loop.iterate()
    _drain(engine)
    loop.runner.enable_sync_check(False)

    _add(engine, batch, prompt, 10_000)
    while any(not r.decoding for r in engine.scheduler.running) or engine.scheduler.waiting:
        loop.iterate()
    for _ in range(3):
        loop.iterate()
    before = engine.scheduler.counters()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        loop.iterate()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    after = engine.scheduler.counters()
    if profile:
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            for _ in range(3):
                loop.iterate()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25), flush=True)
    drafts = after.spec_drafts - before.spec_drafts
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    _drain(engine)
    return Row(
        algorithm=algorithm,
        batch=batch,
        step_ms=1000 * elapsed / steps,
        tokens_per_step=1 + accepted / drafts if drafts else 1.0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="target config.json (dummy weights)")
    parser.add_argument("--algorithm", required=True)
    parser.add_argument("--draft-model", default="")
    parser.add_argument("--num-draft-tokens", type=int, default=0)
    parser.add_argument("--num-steps", type=int, default=0)
    parser.add_argument("--topk", type=int, default=0, help="> 1: a tree (needs the two above)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--profile", action="store_true", help="print a profile of 3 turns")
    args = parser.parse_args()
    rows = []
    for algorithm in ("none", args.algorithm):
        for batch in args.batch:
            engine = _engine(args, algorithm, batch)
            rows.append(measure(engine, algorithm, batch, args.steps, args.prompt, args.profile))
            print(json.dumps(asdict(rows[-1])), flush=True)
            del engine
            torch.cuda.empty_cache()
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "model": args.model,
                "draft_model": args.draft_model,
            }
        )
    )


if __name__ == "__main__":
    main()
