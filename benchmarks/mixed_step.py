"""A prompt batch that decoding rows ride (``--mixed-batches``) next to the two steps it
replaces: the prompt batch alone and a decode step of those rows. In process with dummy
weights, under the serial loop, so a turn's wall time is its step's.

For each budget (``--chunked-prefill-tokens``): ``--batch`` requests decode, then
``--arrivals`` prompts of ``--prompt`` tokens arrive at once. Each turn is timed and sorted by
its plan: ``decode`` (its rows, its width), ``prompt`` (an EXTEND without riders), ``mixed``
(an EXTEND with riders). Two engines per budget, riding off then on. The report, one JSON line
per budget, gives each kind's mean milliseconds and prompt tokens, and ``split_ms``: what the
mixed step's work costs as two steps, a prompt batch of its prompt tokens (the prompt steps'
time per token) plus one plain decode step of its riders. A mixed step under ``split_ms``
saves time; its own time is every rider's ITL while prompts wait. ``--profile`` prints the
top operations of each wave's first turn (untimed): a prompt batch, then a mixed one.

    python benchmarks/mixed_step.py --batch 256 --budget 512 1024 2048 --prompt 512 \\
        --arrivals 64 --model tests/fixtures/configs/Llama-3.1-8B-Instruct.config.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections import defaultdict

import torch

from outrider.daemon.bench.latency import benchmark_request, random_prompts
from outrider.daemon.config import ServeConfig
from outrider.daemon.engine.build import Engine, build_engine
from outrider.daemon.engine.plan import StepPlan

DECODE_TURNS = 8  # timed decode turns before the arrivals


def _engine(args: argparse.Namespace, budget: int, mixed: bool) -> Engine:
    spec = args.algorithm != "none"
    rows = args.batch + args.arrivals
    return build_engine(
        ServeConfig(
            model=args.model,
            load_format="dummy",
            device=args.device,
            dtype=args.dtype,
            max_running=rows,
            kv_cache_tokens=rows * (args.prompt + args.outputs + 64) + 4096,
            context_length=args.prompt + args.outputs + 64,
            chunked_prefill_tokens=budget,
            mixed_batches=mixed,
            no_overlap=True,
            cuda_graph_max_bs=max(args.batch, 1),
            speculative_algorithm=args.algorithm,
            draft_model=args.draft_model if spec else "",
            speculative_num_steps=args.num_steps if spec else 0,
            speculative_simulate_acceptance=args.simulate_acceptance if spec else 0.0,
            attention_backend=args.attention_backend,
        )
    )


def _kind(plan: StepPlan) -> str:
    if plan.kind == "decode":
        return "decode"
    return "mixed" if plan.relay_rows else "prompt"


def turns(engine: Engine, args: argparse.Namespace) -> dict[str, list[tuple[float, StepPlan]]]:
    """The timed turns, by kind: ``DECODE_TURNS`` over ``args.batch`` decoding rows, then one
    wave of arrivals until every arrival decodes."""
    loop, scheduler = engine.loop, engine.scheduler
    prompts = random_prompts(args.batch + args.arrivals, args.prompt, engine.facts.vocab_size, 0)
    for rid, ids in enumerate(prompts[: args.batch]):
        scheduler.add(benchmark_request(rid, ids, args.outputs))
    while any(not r.decoding for r in scheduler.running) or scheduler.waiting:
        loop.iterate()
    for _ in range(3):  # every decode graph this batch uses is warm
        loop.iterate()
    plans: list[StepPlan] = []
    launch = loop.runner.launch

    def recorded(plan: StepPlan, *rest: object, **named: object) -> object:
        plans.append(plan)
        return launch(plan, *rest, **named)  # type: ignore[arg-type]  # passed through

    loop.runner.launch = recorded  # type: ignore[method-assign]
    timed: dict[str, list[tuple[float, StepPlan]]] = defaultdict(list)

    def turn() -> None:
        start = time.perf_counter()
        loop.iterate()
        if engine.config.device == "cuda":
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) * 1e3
        while plans:
            plan = plans.pop()
            timed[_kind(plan)].append((elapsed, plan))

    for _ in range(DECODE_TURNS):
        turn()
    for rid, ids in enumerate(prompts[args.batch :], start=args.batch):
        scheduler.add(benchmark_request(rid, ids, args.outputs))
    if args.profile:  # the wave's first turn, untimed
        _profiled(engine, plans)
    while scheduler.waiting or any(not r.decoding for r in scheduler.running):
        turn()
    loop.runner.launch = launch  # type: ignore[method-assign]
    return timed


def _profiled(engine: Engine, plans: list[StepPlan]) -> None:
    """One turn under the profiler: its top operations by device time (CPU: host time)."""
    cuda = engine.config.device == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        engine.loop.iterate()
        if cuda:
            torch.cuda.synchronize()
    plan = plans.pop()
    plans.clear()
    print(f"profile of a {_kind(plan)} turn: {_prompt_tokens(plan)} prompt tokens, "
          f"{len(plan.relay_rows)} riders", flush=True)  # fmt: skip
    order = "cuda_time_total" if cuda else "cpu_time_total"
    print(prof.key_averages().table(sort_by=order, row_limit=20), flush=True)


def _prompt_tokens(plan: StepPlan) -> int:
    return plan.num_tokens - len(plan.relay_rows)


def _mean(values: list[float]) -> float:
    return round(statistics.mean(values), 3)


def report(
    budget: int,
    apart: dict[str, list[tuple[float, StepPlan]]],
    riding: dict[str, list[tuple[float, StepPlan]]],
) -> dict[str, object]:
    """The means of each kind, and the mixed step's work as two steps (module docstring)."""
    decode = apart["decode"]
    plain = [ms for ms, p in decode if not p.drafting] or [ms for ms, _ in decode]
    prompt, mixed = apart["prompt"], riding["mixed"]
    per_token = sum(ms for ms, _ in prompt) / sum(_prompt_tokens(p) for _, p in prompt)
    mixed_tokens = statistics.mean(_prompt_tokens(p) for _, p in mixed)
    return {
        "budget": budget,
        "decode_ms": _mean(plain),
        "prompt_ms": _mean([ms for ms, _ in prompt]),
        "prompt_tokens": round(statistics.mean(_prompt_tokens(p) for _, p in prompt), 1),
        "prompt_steps": len(prompt),
        "mixed_ms": _mean([ms for ms, _ in mixed]),
        "mixed_tokens": round(mixed_tokens, 1),
        "mixed_steps": len(mixed),
        "riders": round(statistics.mean(len(p.relay_rows) for _, p in mixed), 1),
        "split_ms": round(per_token * mixed_tokens + statistics.mean(plain), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="target config.json (dummy weights)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=64, help="rows decoding when prompts come")
    parser.add_argument("--budget", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--arrivals", type=int, default=32)
    parser.add_argument("--outputs", type=int, default=512, help="each request's output length")
    parser.add_argument("--algorithm", default="none")
    parser.add_argument("--draft-model", default="")
    parser.add_argument("--num-steps", type=int, default=0)
    parser.add_argument("--simulate-acceptance", type=float, default=0.0)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument(
        "--profile", action="store_true", help="print a profile of each wave's first turn"
    )
    args = parser.parse_args()
    for budget in args.budget:
        timed = []
        for mixed in (False, True):
            engine = _engine(args, budget, mixed)
            timed.append(turns(engine, args))
            del engine
            gc.collect()  # the engine's cycles hold its KV cache
            if args.device == "cuda":
                torch.cuda.empty_cache()
        print(json.dumps(report(budget, *timed)), flush=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(json.dumps({"device": device, "torch": torch.__version__, "model": args.model}))


if __name__ == "__main__":
    main()
