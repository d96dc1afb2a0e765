"""Several engines of the embedded family side by side in one process: the overlap loop serves
the family's held-out prompts (through the chat template) one request at a time, each engine
in turn, pass after pass; the report is each engine's median time a request and its ratio to
the first engine's. No sockets and no other process, so the ratios move less than the
daemon's (``family_temperatures.py``), and every pass counts its turns by kind.

    python benchmarks/family_in_process.py --device cuda --temperature 0 \
        --engines none eagle3 eagle3:plain dflash

An engine is an algorithm, or ``ALGORITHM:plain`` for the same engine held to plain steps
(its drafting policy's break-even out of reach: only its probes draft, and past its kind's
first request only the probe requests feed the draft). Turn kinds are
``request_turns.py``'s (``+cu``: an eager catch-up ran first). Pass 0 is a warm-up (prompts
miss the prefix cache) and is not counted.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from host_turn import OUT_OF_REACH, family_settings  # benchmarks/ is sys.path[0] as a script
from request_turns import held_out_prompts, label_turns

from outrider.daemon.config import ServeConfig
from outrider.daemon.engine.build import Engine, build_engine
from outrider.daemon.internal import own_request
from outrider.plugins.sampling_spec import SamplingSpec


def build(device: str, engine: str) -> Engine:
    algorithm, _, mode = engine.partition(":")
    settings = family_settings(device, algorithm)
    if mode == "plain":
        settings["speculative_min_acceptance"] = OUT_OF_REACH
    elif mode:
        raise SystemExit(f"unknown engine mode {mode!r} (only ALGORITHM:plain)")
    return build_engine(ServeConfig(**settings))  # type: ignore[arg-type]  # typed above


def serve_pass(
    engine: Engine, label: list[str], prompts: list[list[int]], args: argparse.Namespace, rid: int
) -> tuple[float, collections.Counter[str]]:
    """One pass over ``prompts`` (request ids from ``rid``): its seconds and turns by kind."""
    loop, kinds = engine.loop, collections.Counter[str]()
    if args.device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for seed, prompt in enumerate(prompts):
        sampling = SamplingSpec(args.temperature, 1.0, 0, seed, 0)
        loop.scheduler.add(own_request(rid + seed, "pass", prompt, args.new_tokens, sampling))
        while loop.has_work:
            label[0] = ""
            loop.iterate()
            kinds[label[0]] += 1
        loop.scheduler.take_updates()
    if args.device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started, kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--engines", nargs="+", default=["none", "eagle3", "dflash"])
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    engines = {name: build(args.device, name) for name in args.engines}
    labels = {name: label_turns(engine) for name, engine in engines.items()}
    target = str(family_settings(args.device, "none")["model"])
    prompts = held_out_prompts(target)[: args.prompts]
    seconds: dict[str, list[float]] = collections.defaultdict(list)
    rid = 0
    for pass_ in range(args.passes + 1):
        for name, engine in engines.items():
            engine.loop.overlap = True
            elapsed, kinds = serve_pass(engine, labels[name], prompts, args, rid)
            rid += len(prompts)
            if pass_:
                seconds[name].append(elapsed)
            per_request = elapsed / len(prompts) * 1e3
            turns = ", ".join(f"{kind or 'idle'} {n}" for kind, n in sorted(kinds.items()))
            print(f"pass {pass_} {name}: {per_request:.2f} ms a request; turns: {turns}")
    first = statistics.median(seconds[args.engines[0]])
    print(f"T = {args.temperature}, {len(prompts)} prompts x {args.new_tokens} new tokens:")
    for name in args.engines:
        median = statistics.median(seconds[name])
        print(
            f"  {name:14s} {median / len(prompts) * 1e3:7.2f} ms a request (median of "
            f"{args.passes}), ratio to {args.engines[0]} {first / median:.3f}"
        )


if __name__ == "__main__":
    main()
