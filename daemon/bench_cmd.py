"""``outrider bench latency``: batches of identical requests through the in-process engine
(scheduler, runner, overlap loop; no sockets), built from the same flags as ``outrider
serve``. Per batch size: prefill time, decode step time and tok/s next to the memory-bandwidth
roofline (every weight except the input embeddings, plus the batch's KV at its mean context,
over the read bandwidth measured on the spot), and for speculative decoding the tokens each
row commits per step and the device time of a cycle's draft, verify and catch-up.

    outrider bench latency --model Llama-3.1-8B.config.json --load-format dummy \\
        --device cuda --batch-size 1 32 --input-len 32 --output-len 128
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass

from outrider.daemon.bench_serve import add_serve_bench_arguments, run_serve_bench
from outrider.daemon.config import (
    EXIT_CONFIG,
    ConfigError,
    ServeConfig,
    add_serve_arguments,
    resolve,
)


@dataclass(frozen=True)
class LatencyRow:
    batch: int
    input_len: int
    output_len: int
    prefill_ms: float
    decode_steps: int
    step_ms: float  # wall time per decode step
    decode_tok_s: float  # tokens after each request's first, over the decode time
    tokens_per_step: float  # committed per row per decode step (1 without speculation)
    roofline_tok_s: float  # one token per row per step at the read bandwidth
    percent_of_roofline: float
    # Device time per decode step of its phases (plain decoding: verify is the whole step);
    # a step replayed from a CUDA graph counts whole, as graph_ms.
    draft_ms: float
    verify_ms: float
    catch_up_ms: float
    graph_ms: float


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    benches = parser.add_subparsers(dest="bench", required=True)
    latency = benches.add_parser(
        "latency", help="prefill and decode step times of fixed batches, in process"
    )
    add_serve_arguments(latency)
    latency.add_argument("--batch-size", type=int, nargs="+", default=[1], metavar="B")
    latency.add_argument("--input-len", type=int, default=32, metavar="L")
    latency.add_argument("--output-len", type=int, default=128, metavar="O")
    latency.add_argument("--json", action="store_true", help="one JSON object per line")
    latency.add_argument(
        "--profile",
        action="store_true",
        help="after each batch size's timed run, profile one more and print its top operations "
        "by device time to stderr",
    )
    add_serve_bench_arguments(
        benches.add_parser(
            "serve", help="a serving benchmark against a running server (ZeroMQ or OpenAI HTTP)"
        )
    )


def run_bench(args: argparse.Namespace) -> int:
    if args.bench == "serve":
        return run_serve_bench(args)
    if min(args.batch_size) < 1 or args.input_len < 1 or args.output_len < 2:
        print(
            "outrider bench latency: batch sizes and --input-len >= 1, --output-len >= 2",
            file=sys.stderr,
        )
        return 2
    try:
        config = bench_config(resolve(args), args)
    except ConfigError as exc:
        print(f"outrider bench latency: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    from outrider.daemon.bench_latency import measure_latency

    try:
        rows, facts = measure_latency(
            config, args.batch_size, args.input_len, args.output_len, profile=args.profile
        )
    except ConfigError as exc:
        print(f"outrider bench latency: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.json:
        print(json.dumps(facts))
        for row in rows:
            print(json.dumps(dataclasses.asdict(row)))
    else:
        print_table(rows, facts)
    return 0


def bench_config(config: ServeConfig, args: argparse.Namespace) -> ServeConfig:
    """The serving configuration, sized for the largest batch (every request of a batch
    runs at once) and, unless given, a context of just the benchmark's length. Speculative
    batches draft at every step (``--speculative-min-acceptance 0``): a cycle's times are what
    is measured, whatever the dummy drafts would earn."""
    context = config.context_length or args.input_len + args.output_len + 64
    return dataclasses.replace(
        config,
        max_running=max(args.batch_size),
        context_length=context,
        chunked_prefill_tokens=max(config.chunked_prefill_tokens, config.page_size),
        speculative_min_acceptance=0.0,
    )


def print_table(rows: list[LatencyRow], facts: dict[str, object]) -> None:
    print(", ".join(f"{k}: {v}" for k, v in facts.items()))
    print(
        f"{'batch':>5} {'prefill ms':>10} {'step ms':>8} {'tok/s':>9} {'tok/step':>8} "
        f"{'% roofline':>10} {'draft ms':>8} {'verify ms':>9} {'catch-up ms':>11} "
        f"{'graph ms':>8}"
    )
    for r in rows:
        print(
            f"{r.batch:>5} {r.prefill_ms:>10.2f} {r.step_ms:>8.2f} {r.decode_tok_s:>9.1f} "
            f"{r.tokens_per_step:>8.2f} {r.percent_of_roofline:>9.1f}% {r.draft_ms:>8.2f} "
            f"{r.verify_ms:>9.2f} {r.catch_up_ms:>11.2f} {r.graph_ms:>8.2f}"
        )
