"""What ``outrider bench latency`` takes and gives, with no heavy import: its flags, the
configuration they resolve to, and its row (``bench sweep`` reads all three)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass

from outrider.daemon.config import ConfigError, ServeConfig
from outrider.daemon.flags import SERVING_ONLY, add_serve_arguments, resolve
from outrider.plugins.sampling_spec import SamplingError, SamplingSpec, resolve_sampling
from outrider.protocol.messages import MAX_TEMPERATURE


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
    latency.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="the rows' sampling temperature, each row seeded by its request id (default: 0, "
        "greedy)",
    )
    latency.add_argument(
        "--top-p", type=float, default=1.0, metavar="P", help="the rows' top-p (default: 1)"
    )
    latency.add_argument(
        "--top-k", type=int, default=0, metavar="K", help="the rows' top-k (default: 0, off)"
    )
    latency.add_argument("--json", action="store_true", help="one JSON object per line")
    latency.add_argument(
        "--profile",
        action="store_true",
        help="after each row's timed runs, profile one more and print its top operations "
        "by host time and, on a GPU, by device time to stderr",
    )


def latency_sampling(args: argparse.Namespace) -> SamplingSpec:
    """The rows' sampling of ``add_latency_arguments``' flags (the seed is each row's)."""
    if not 0.0 <= args.temperature <= MAX_TEMPERATURE:
        raise ConfigError(
            f"--temperature must be in [0, {MAX_TEMPERATURE:g}], got {args.temperature!r}"
        )
    if not 0.0 < args.top_p <= 1.0:
        raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p!r}")
    if args.top_k < 0:
        raise ConfigError(f"--top-k must be 0 (off) or more, got {args.top_k}")
    try:
        return resolve_sampling(
            args.temperature, args.top_p, args.top_k, defaults=SamplingSpec(), seed=0
        )
    except SamplingError as exc:
        raise ConfigError(f"--{exc}") from None


def resolve_latency(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> ServeConfig:
    """The configuration of ``add_latency_arguments``' flags and their ``OUTRIDER_*`` values;
    the serve flags it leaves out keep their defaults (their variables are not read)."""
    return resolve(args, environ, leave_out=SERVING_ONLY)
