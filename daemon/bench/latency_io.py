"""What ``outrider bench latency`` takes and gives, with no heavy import: its flags, the
configuration they resolve to, and its row (``bench sweep`` reads all three)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass

from outrider.daemon.config import ServeConfig
from outrider.daemon.flags import SERVING_ONLY, add_serve_arguments, resolve


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
    # The timed runs of this row; the fields above are the median run's (by step time, the
    # lower middle for an even count), these the spread of step times over all of them.
    runs: int
    step_ms_min: float
    step_ms_max: float


def add_latency_arguments(latency: argparse.ArgumentParser) -> None:
    """``serve``'s flags but those only a serving daemon uses, then the bench's own."""
    add_serve_arguments(latency, leave_out=SERVING_ONLY)
    latency.add_argument("--batch-size", type=int, nargs="+", default=[1], metavar="B")
    latency.add_argument(
        "--input-len",
        type=int,
        nargs="+",
        default=[32],
        metavar="L",
        help="prompt lengths: a row per batch size and length (default: 32)",
    )
    latency.add_argument("--output-len", type=int, default=128, metavar="O")
    latency.add_argument(
        "--runs",
        type=int,
        default=1,
        metavar="R",
        help="timed runs per row; the row is the run of median step time (default: 1)",
    )
    latency.add_argument("--json", action="store_true", help="one JSON object per line")
    latency.add_argument(
        "--profile",
        action="store_true",
        help="after each row's timed runs, profile one more and print its top operations "
        "by device time to stderr",
    )


def resolve_latency(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> ServeConfig:
    """The configuration of ``add_latency_arguments``' flags and their ``OUTRIDER_*`` values;
    the serve flags it leaves out keep their defaults (their variables are not read)."""
    return resolve(args, environ, leave_out=SERVING_ONLY)
