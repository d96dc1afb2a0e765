"""The figures of ``outrider bench serve`` (bench/serve.py): one ``Outcome`` per request in,
the result record and the report in ``vllm bench serve``'s layout out."""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

WIDTH = 50  # the report's width, as vllm bench serve's


@dataclass
class Outcome:
    """What one request measured (seconds, from its start)."""

    prompt_len: int
    expected_output_len: int
    success: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    spec_drafts: int = 0
    spec_accepted: int = 0


def _percentile(values: list[float], p: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _stats(name: str, values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values] or [0.0]
    return {
        f"mean_{name}_ms": statistics.fmean(ms),
        f"median_{name}_ms": statistics.median(ms),
        f"p99_{name}_ms": _percentile(ms, 99),
    }


def summarize(outcomes: list[Outcome], duration: float) -> dict[str, Any]:
    done = [o for o in outcomes if o.success]
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_tokens for o in done)
    drafts = sum(o.spec_drafts for o in done)
    accepted = sum(o.spec_accepted for o in done)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    result |= _stats("ttft", [o.ttft for o in done])
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in done if o.output_tokens > 1]
    result |= _stats("tpot", tpots)
    result |= _stats("itl", [gap for o in done for gap in o.itl])
    result |= _stats("e2el", [o.latency for o in done])
    if drafts:
        result["spec_decode_acceptance_length"] = 1 + accepted / drafts
        result["spec_decode_num_drafts"] = drafts
        result["spec_decode_accepted_tokens"] = accepted
    result["input_lens"] = [o.prompt_len for o in outcomes]
    result["output_lens"] = [o.output_tokens for o in outcomes]
    result["expected_output_lens"] = [o.expected_output_len for o in outcomes]
    result["ttfts"] = [o.ttft for o in outcomes]
    result["itls"] = [o.itl for o in outcomes]
    result["latencies"] = [o.latency for o in outcomes]
    result["errors"] = [o.error for o in outcomes]
    return result


def print_report(result: dict[str, Any], args: argparse.Namespace) -> None:
    def row(label: str, value: float | int, fmt: str = ".2f") -> None:
        print(f"{label:<40} {value:<10{fmt}}")

    def section(title: str, name: str, metric: str) -> None:
        print(title.center(WIDTH, "-"))
        row(f"Mean {name} (ms):", result[f"mean_{metric}_ms"])
        row(f"Median {name} (ms):", result[f"median_{metric}_ms"])
        row(f"P99 {name} (ms):", result[f"p99_{metric}_ms"])

    print(" Serving Benchmark Result ".center(WIDTH, "="))
    row("Successful requests:", result["completed"], "")
    row("Failed requests:", result["failed"], "")
    if args.max_concurrency:
        row("Maximum request concurrency:", args.max_concurrency, "")
    if math.isfinite(args.request_rate):
        row("Request rate configured (RPS):", args.request_rate)
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"], "")
    row("Total generated tokens:", result["total_output_tokens"], "")
    row("Request throughput (req/s):", result["request_throughput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    section("Time to First Token", "TTFT", "ttft")
    section("Time per Output Token (excl. 1st token)", "TPOT", "tpot")
    section("Inter-token Latency", "ITL", "itl")
    section("End-to-end Latency", "E2EL", "e2el")
    if "spec_decode_acceptance_length" in result:
        print("Speculative Decoding".center(WIDTH, "-"))
        row("Acceptance length:", result["spec_decode_acceptance_length"])
        row("Drafts:", result["spec_decode_num_drafts"], "")
        row("Accepted tokens:", result["spec_decode_accepted_tokens"], "")
    print("=" * WIDTH)
