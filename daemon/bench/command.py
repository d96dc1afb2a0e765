"""``outrider bench latency``: batches of identical requests through the in-process engine
(scheduler, runner, overlap loop; no sockets), built from ``outrider serve``'s flags but those
only a serving daemon uses (flags.py ``SERVING_ONLY``). Per row: prefill time, decode step
time and tok/s next to the memory-bandwidth roofline (every weight except the input
embeddings, of a mixture of experts only the experts the batch reaches (roofline.py), plus the
batch's KV at its mean context, over the read bandwidth measured on the spot), and for
speculative decoding the tokens each row commits per step and the device time of a cycle's
draft, verify and catch-up. A row per batch size and prompt length; with
``--runs R`` each row is the run of median step time.

    outrider bench latency --model Llama-3.1-8B.config.json --load-format dummy \\
        --device cuda --batch-size 1 32 --input-len 1024 8192 --output-len 128 --runs 5

``outrider bench sweep`` (bench/sweep.py) runs a matrix of such commands, one process each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from outrider.daemon.bench.latency_io import (
    LatencyRow,
    add_latency_arguments,
    latency_sampling,
    resolve_latency,
)
from outrider.daemon.bench.serve import add_serve_bench_arguments, run_serve_bench
from outrider.daemon.config import EXIT_CONFIG, ConfigError, ServeConfig


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    benches = parser.add_subparsers(dest="bench", required=True)
    latency = benches.add_parser(
        "latency", help="prefill and decode step times of fixed batches, in process"
    )
    add_latency_arguments(latency)
    add_serve_bench_arguments(
        benches.add_parser(
            "serve", help="a serving benchmark against a running server (ZeroMQ or OpenAI HTTP)"
        )
    )
    add_sweep_arguments(
        benches.add_parser(
            "sweep",
            help="the attention backend x speculative algorithm matrix of bench latency runs, "
            "resumable",
        )
    )


def add_sweep_arguments(sweep: argparse.ArgumentParser) -> None:
    sweep.add_argument(
        "--results",
        metavar="PATH",
        help="the JSONL file a line per cell is appended to; cells in it are skipped",
    )
    sweep.add_argument(
        "--report", metavar="PATH", help="print the Markdown table of a results file and exit"
    )
    sweep.add_argument("--list", action="store_true", help="print the cells and which are done")
    sweep.add_argument(
        "--only",
        nargs="+",
        default=[],
        metavar="NAME",
        help="backend sets and algorithms to run (a configuration is kept when it matches one "
        "of the given names in each dimension named)",
    )
    sweep.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        metavar="S",
        help="start no configuration once S seconds have passed (0: no limit)",
    )
    sweep.add_argument(
        "--timeout-s",
        type=float,
        default=0.0,
        metavar="S",
        help="stop a configuration's process after S seconds, recording its cells as failed "
        "(0: no limit)",
    )
    sweep.add_argument(
        "--runs", type=int, default=5, metavar="R", help="bench latency --runs (default: 5)"
    )
    sweep.add_argument(
        "--retry-failed", action="store_true", help="run the cells recorded as failed again"
    )
    sweep.add_argument(
        "--configs",
        default="tests/fixtures/configs",
        metavar="DIR",
        help="where the models' config.json files are (default: tests/fixtures/configs)",
    )


def run_bench(args: argparse.Namespace) -> int:
    if args.bench == "serve":
        return run_serve_bench(args)
    if args.bench == "sweep":
        return run_sweep_command(args)
    if min(args.batch_size) < 1 or min(args.input_len) < 1 or args.output_len < 2 or args.runs < 1:
        print(
            "outrider bench latency: batch sizes, --input-len and --runs >= 1, --output-len >= 2",
            file=sys.stderr,
        )
        return 2
    try:
        config = bench_config(resolve_latency(args), args)
        sampling = latency_sampling(args)
    except ConfigError as exc:
        print(f"outrider bench latency: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    from outrider.daemon.bench.latency import measure_latency

    try:
        rows, facts = measure_latency(
            config,
            args.batch_size,
            args.input_len,
            args.output_len,
            runs=args.runs,
            profile=args.profile,
            sampling=sampling,
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


def run_sweep_command(args: argparse.Namespace) -> int:
    from outrider.daemon.bench.sweep import SweepOptions, read_results, run_sweep, select
    from outrider.daemon.bench.sweep_report import format_report, list_cells

    def fail(message: str) -> int:
        print(f"outrider bench sweep: {message}", file=sys.stderr)
        return 2

    if args.runs < 1 or args.budget_s < 0 or args.timeout_s < 0:
        return fail("--runs must be at least 1, --budget-s and --timeout-s >= 0")
    path = Path(args.report or args.results or "")
    if not args.report and not args.results:
        return fail("--results PATH is required (or --report PATH)")
    try:
        matrix = select(args.only)
        results = read_results(path) if args.report or path.exists() else []
    except (OSError, ValueError) as exc:
        return fail(str(exc))
    if args.report:
        print(format_report(results, args.configs), end="")
        return 0
    if args.list:
        print(list_cells(matrix, results, args.configs), end="")
        return 0
    options = SweepOptions(
        args.runs, args.configs, args.budget_s, args.timeout_s, args.retry_failed
    )
    outcome = run_sweep(matrix, path, options)
    print(
        f"outrider bench sweep: {len(outcome.ran)} configurations run ({outcome.failed_cells} "
        f"cells failed), {len(outcome.refused)} refused, {len(outcome.left)} left past "
        f"--budget-s; the cells: outrider bench sweep --list --results {path}",
        file=sys.stderr,
    )
    return 0


def bench_config(config: ServeConfig, args: argparse.Namespace) -> ServeConfig:
    """The serving configuration, sized for the largest batch (every request of a batch
    runs at once) and, unless given, a context of just the longest prompt and
    the output. Speculative
    batches draft at every step (``--speculative-min-acceptance 0``): a cycle's times are what
    is measured, whatever the dummy drafts would earn."""
    context = config.context_length or max(args.input_len) + args.output_len + 64
    return dataclasses.replace(
        config,
        max_running=max(args.batch_size),
        context_length=context,
        chunked_prefill_tokens=max(config.chunked_prefill_tokens, config.page_size),
        speculative_min_acceptance=0.0,
    )


def print_table(rows: list[LatencyRow], facts: dict[str, object]) -> None:
    print(", ".join(f"{k}: {v}" for k, v in facts.items()))
    spread = any(r.runs > 1 for r in rows)
    print(
        f"{'batch':>5} {'input':>6} {'prefill ms':>10} {'step ms':>8} "
        + (f"{'min-max ms':>13} " if spread else "")
        + f"{'tok/s':>9} {'tok/step':>8} {'% roofline':>10} {'draft ms':>8} {'verify ms':>9} "
        f"{'catch-up ms':>11} {'graph ms':>8}"
    )
    for r in rows:
        print(
            f"{r.batch:>5} {r.input_len:>6} {r.prefill_ms:>10.2f} {r.step_ms:>8.2f} "
            + (f"{f'{r.step_ms_min:.2f}-{r.step_ms_max:.2f}':>13} " if spread else "")
            + f"{r.decode_tok_s:>9.1f} {r.tokens_per_step:>8.2f} "
            f"{r.percent_of_roofline:>9.1f}% {r.draft_ms:>8.2f} {r.verify_ms:>9.2f} "
            f"{r.catch_up_ms:>11.2f} {r.graph_ms:>8.2f}"
        )
    if spread:
        print(f"(each row: the median of {rows[0].runs} runs by step time)")
