"""The loop's turn on the embedded family, in process: ms a turn and tok/s with the overlap loop
and with the serial one, for one request at a time, optionally with a cProfile of the turns.

    python benchmarks/host_turn.py --device cuda
    python benchmarks/host_turn.py --device cuda --algorithm eagle3 --plain-only --profile 25
    python benchmarks/host_turn.py --device cuda --algorithm eagle3 --plain-only --trace 20

``--plain-only`` holds a speculative engine to plain steps (its drafting policy's break-even is
set out of reach: only its probes draft), so its turns compare with ``none``'s step for step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from outrider.daemon.config import ServeConfig
from outrider.daemon.engine.build import Engine, build_engine
from outrider.daemon.family import embedded_family
from outrider.daemon.internal import own_request
from outrider.plugins.sampling_spec import SamplingSpec

PROMPT = [5, 6, 7, 8] * 8
OUT_OF_REACH = 100.0  # an acceptance length no draft reaches


def family_settings(device: str, algorithm: str) -> dict[str, object]:
    """``serve``'s settings for the embedded family with ``algorithm`` and its draft."""
    family = embedded_family()
    if family is None:
        raise SystemExit("the outrider-family package is not installed (pip install ./family)")
    settings: dict[str, object] = {
        "model": str(family.target),
        "device": device,
        "speculative_algorithm": algorithm,
    }
    if algorithm in family.drafts:
        settings["draft_model"] = str(family.drafts[algorithm])
    return settings


def build(device: str, algorithm: str, plain_only: bool) -> Engine:
    settings = family_settings(device, algorithm)
    if algorithm != "none":
        settings["speculative_min_acceptance"] = OUT_OF_REACH if plain_only else 0.0
    return build_engine(ServeConfig(**settings))  # type: ignore[arg-type]  # typed above


def serve(engine: Engine, rid: int, new_tokens: int, temperature: float) -> int:
    """One request to its end; the loop turns it took."""
    loop = engine.loop
    sampling = SamplingSpec(temperature, 1.0, 0, rid, 0)
    loop.scheduler.add(own_request(rid, f"turn-{rid}", PROMPT, new_tokens, sampling))
    turns = 0
    while loop.has_work:
        loop.iterate()
        turns += 1
    loop.scheduler.take_updates()
    return turns


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--algorithm", default="none")
    parser.add_argument("--plain-only", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=400)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--profile", type=int, default=0, help="print the N costliest functions")
    parser.add_argument(
        "--trace", type=int, default=0, help="print the N costliest ops of a serial request's trace"
    )
    args = parser.parse_args()
    engine = build(args.device, args.algorithm, args.plain_only)
    serve(engine, 0, 64, args.temperature)  # warm: first-use paths
    for overlap in (True, False):
        engine.loop.overlap = overlap
        synchronize(args.device)
        started = time.perf_counter()
        turns = serve(engine, 1 if overlap else 2, args.new_tokens, args.temperature)
        synchronize(args.device)
        elapsed = time.perf_counter() - started
        print(
            f"{args.algorithm}{' plain-only' if args.plain_only else ''} "
            f"{'overlap' if overlap else 'serial'}: {turns} turns, "
            f"{elapsed / turns * 1e3:.3f} ms a turn, {args.new_tokens / elapsed:,.1f} tok/s",
            flush=True,
        )
    if args.profile:
        engine.loop.overlap = True
        profiler = cProfile.Profile()
        profiler.enable()
        serve(engine, 3, args.new_tokens, args.temperature)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.profile)
        print(text.getvalue())
    if args.trace:
        trace(engine, args)


def trace(engine: Engine, args: argparse.Namespace) -> None:
    """A serial request under the torch profiler: the ops costliest on the host and on the
    device, per turn (every device op or runtime call a turn adds shows as its count)."""
    engine.loop.overlap = False
    activities = [ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        turns = serve(engine, 4, args.new_tokens, args.temperature)
        synchronize(args.device)
    print(f"traced {turns} serial turns; counts below are for all of them")
    averages = prof.key_averages()
    for key in ("self_cpu_time_total", "self_device_time_total"):
        if key == "self_device_time_total" and args.device != "cuda":
            continue
        print(averages.table(sort_by=key, row_limit=args.trace, max_name_column_width=60))


if __name__ == "__main__":
    main()
