"""Every draft algorithm against ``none`` through the real daemon, at each concurrency: the
sweep behind "a speculative engine never serves less than ``none``" (BENCHMARKS.md).

For each target it starts ``outrider serve`` for ``none``, then for each algorithm at each
``--acceptance`` (simulated: ``--speculative-simulate-acceptance``; the drafting policy
measured at start, as served), and runs ``outrider bench serve`` at each ``--concurrency``
(random prompts of ``--input-len`` tokens drawn with the seed ``C``, ``--output-len`` new
ones, greedy, ``max(2C, 16)`` requests). The targets, with dummy weights: Llama-3.1-8B's
config for the EAGLE-3 chain (3 drafts) and tree (5 steps x top-4, 16 nodes), Qwen3-8B's for
n-gram and DFlash (block of 16); each algorithm is compared with ``none`` on its own target,
at the same concurrency, in the same run. ``--fixed N ...`` adds, for each algorithm and
acceptance, a daemon that drafts every decode batch at verify width N
(``--speculative-min-acceptance 0``; DFlash at its block, its only width): the fixed lengths
the drafting policy's choice is measured against. A simulated chain (EAGLE-3's, n-gram's)
accepts each position with one probability, set from the acceptance at the policy daemon's
chain (the engine's ``position_rate``); a fixed daemon's shorter chain gets the acceptance that
same probability gives at its length, so that every width is the policy daemon's draft cut
short, as the policy's own cut steps are (a fixed chain of one draft at acceptance 2 would
otherwise accept every draft). ``--shape moe`` serves Qwen3-30B-A3B's config (dummy weights)
to every algorithm instead, the mixture-of-experts target. ``--shape family`` serves the embedded
family with its trained drafts instead (no simulation: ``--acceptance`` is ignored), on any
device: a smoke run on a CPU.

Every result goes to ``--out`` (JSON) as it comes, and a table to stdout: output tok/s, the
ratio to ``none``, the acceptance length, and the P99 ITL and TPOT. With ``--step-logs`` each
result also says where its daemon's turns went while its timed requests ran (``turns``: per
kind of step, its turns, their milliseconds, rows and unfed rows; daemon/bench/step_summary.py),
printed after the table.

    python benchmarks/speculation_sweep.py --tokenizer D --out sweep.json
    python benchmarks/speculation_sweep.py --tokenizer D --algorithms dflash --acceptance 2 \\
        --concurrency 1 256 --out sweep.json -- --max-prompt-run 2

D: a tokenizer of the targets' vocabulary size or less (the prompts' ids are drawn from it;
``benchmarks/wide_tokenizer.py``). Flags after ``--`` go to every daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from decode import wait_ready  # benchmarks/ is sys.path[0] when run as a script

from outrider.daemon.bench.step_summary import Line, Turns, describe, read, summarize
from outrider.daemon.engine.verify import position_rate
from outrider.daemon.family import embedded_family
from outrider.plugins.speculative.ngram import SPEC as NGRAM

CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "configs"
DUMMY = ("--load-format", "dummy", "--dtype", "bfloat16")
STEPS, TOKENS = "--speculative-num-steps", "--speculative-num-draft-tokens"
CHAIN_STEPS = 3  # the EAGLE-3 chain's drafts
NGRAM_WIDTH = NGRAM.speculative.default_width if NGRAM.speculative else 0
KEPT = (
    "output_throughput", "completed", "failed", "duration", "spec_decode_acceptance_length",
    "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
    "p99_itl_ms",
)  # fmt: skip


@dataclass(frozen=True)
class Algorithm:
    target: str  # the key of its target in the shape's targets
    flags: tuple[str, ...]
    simulated: bool  # its acceptance is simulated (dummy drafts)
    # The flag that fixes its verify width N, and what it takes: N + offset ("": its width
    # is the draft's own, DFlash's block).
    width_flag: tuple[str, int] = ("", 0)
    chain: int = 0  # the drafts of its chain as the policy daemon runs it (0: not a chain)


Shape = tuple[dict[str, tuple[str, ...]], dict[str, Algorithm]]  # targets, algorithms


def _algorithms(
    chained: str, blocked: str, eagle3: str, dflash: str, tree: tuple[str, ...], simulated: bool
) -> dict[str, Algorithm]:
    """The four algorithms: EAGLE-3's chain and ``tree`` (its shape flags) with the ``eagle3``
    draft on target ``chained``, n-gram and DFlash with the ``dflash`` draft on ``blocked``."""
    drafts = ("--speculative-algorithm", "eagle3", "--draft-model", eagle3)
    ngram = ("--speculative-algorithm", "ngram")
    return {
        "chain": Algorithm(
            chained, (*drafts, STEPS, str(CHAIN_STEPS)), simulated, (STEPS, -1), CHAIN_STEPS
        ),
        "tree": Algorithm(chained, (*drafts, *tree), simulated, (TOKENS, 0)),
        "ngram": Algorithm(blocked, ngram, simulated, (TOKENS, 0), NGRAM_WIDTH - 1),
        "dflash": Algorithm(
            blocked, ("--speculative-algorithm", "dflash", "--draft-model", dflash), simulated
        ),
    }


def dummy_shape() -> Shape:
    """The 8B targets with dummy weights and their algorithms (module docstring)."""
    targets = {
        "llama": ("--model", str(CONFIGS / "Llama-3.1-8B-Instruct.config.json"), *DUMMY),
        "qwen3": ("--model", str(CONFIGS / "Qwen3-8B.config.json"), *DUMMY),
    }
    tree = ("--speculative-num-steps", "5", "--speculative-topk", "4",
            "--speculative-num-draft-tokens", "16")  # fmt: skip
    eagle3 = str(CONFIGS / "Llama-3.1-8B-EAGLE3.config.json")
    dflash = str(CONFIGS / "Qwen3-8B-DFlash-b16.config.json")
    return targets, _algorithms("llama", "qwen3", eagle3, dflash, tree, simulated=True)


def moe_shape() -> Shape:
    """Qwen3-30B-A3B (128 experts, 8 a token) with dummy weights, every algorithm on it: its
    drafts take the 8B drafts' layouts at its sizes (EAGLE-3: one layer; DFlash: five layers
    tapping five of its 48, a block of 16)."""
    targets = {"moe": ("--model", str(CONFIGS / "Qwen3-30B-A3B.config.json"), *DUMMY)}
    tree = ("--speculative-num-steps", "5", "--speculative-topk", "4",
            "--speculative-num-draft-tokens", "16")  # fmt: skip
    eagle3 = str(CONFIGS / "Qwen3-30B-A3B-EAGLE3.config.json")
    dflash = str(CONFIGS / "Qwen3-30B-A3B-DFlash-b16.config.json")
    return targets, _algorithms("moe", "moe", eagle3, dflash, tree, simulated=True)


def family_shape() -> Shape:
    """The embedded family's target with its trained drafts."""
    family = embedded_family()
    if family is None:
        raise SystemExit("the outrider-family package is not installed (pip install ./family)")
    tree = ("--speculative-num-steps", "3", "--speculative-topk", "4",
            "--speculative-num-draft-tokens", "8")  # fmt: skip
    drafts = family.target.parent
    algorithms = _algorithms(
        "family", "family", str(drafts / "eagle3"), str(drafts / "dflash"), tree, simulated=False
    )
    return {"family": ("--model", str(family.target))}, algorithms


@dataclass(frozen=True)
class Mode:
    """One daemon of the sweep: ``none`` or an algorithm at one acceptance."""

    target: str
    algorithm: str  # "none" or a key of the shape's algorithms
    acceptance: float | None  # simulated; None: the drafts' own
    # None: the drafting policy chooses; else every decode batch drafts (the policy off) at
    # this verify width N, 0: at the algorithm's own.
    fixed: int | None = None

    @property
    def name(self) -> str:
        accepted = "" if self.acceptance is None else f"-a{self.acceptance:g}"
        width = "" if self.fixed is None else f"-n{self.fixed}" if self.fixed else "-whole"
        return f"{self.target}-{self.algorithm}{accepted}{width}"


def modes(
    algorithms: dict[str, Algorithm],
    chosen: list[str],
    acceptances: list[float],
    fixed: Sequence[int] = (),
) -> list[Mode]:
    """``none`` first on each target the chosen algorithms use, then each algorithm at each
    acceptance (once, unsimulated, where its drafts are real): as its policy chooses, then at
    each ``fixed`` verify width (once at its own where the draft fixes it)."""
    order: list[Mode] = []
    for name in chosen:
        algorithm = algorithms[name]
        if all(mode.target != algorithm.target for mode in order):
            order.append(Mode(algorithm.target, "none", None))
        widths = fixed if algorithm.width_flag[0] else [0] if fixed else []
        for acceptance in acceptances if algorithm.simulated else [None]:
            order.append(Mode(algorithm.target, name, acceptance))
            order += [Mode(algorithm.target, name, acceptance, width) for width in widths]
    return sorted(order, key=lambda mode: (mode.target, mode.algorithm != "none"))


def simulated_acceptance(mode: Mode, chain: int) -> float:
    """The acceptance ``mode``'s daemon simulates: its own, or for a fixed width N of a
    ``chain`` of that many drafts, what the chain's per-position probability gives at N - 1
    drafts (module docstring)."""
    assert mode.acceptance is not None
    if not (chain and mode.fixed):
        return mode.acceptance
    rate = position_rate(mode.acceptance, chain)
    return sum(rate**position for position in range(mode.fixed))


def serve_command(
    mode: Mode,
    targets: dict[str, tuple[str, ...]],
    algorithms: dict[str, Algorithm],
    endpoint: str,
    args: argparse.Namespace,
) -> list[str]:
    rows = str(max(args.concurrency))
    command = [sys.executable, "-m", "outrider.daemon.cli", "serve", "--listen", endpoint,
               "--device", args.device, *targets[mode.target], "--max-running", rows,
               "--cuda-graph-max-bs", rows]  # fmt: skip
    if mode.algorithm == "none":
        command += ["--speculative-algorithm", "none"]
    else:
        command += algorithms[mode.algorithm].flags
    if mode.acceptance is not None:
        accepted = simulated_acceptance(mode, algorithms[mode.algorithm].chain)
        command += ["--speculative-simulate-acceptance", f"{accepted:.6g}"]
    if mode.fixed is not None:  # after the algorithm's flags: the last of a flag counts
        command += ["--speculative-min-acceptance", "0"]
        flag, offset = algorithms[mode.algorithm].width_flag
        if mode.fixed:
            command += [flag, str(mode.fixed + offset)]
    if args.step_logs:
        command += ["--step-log", str(step_log(args.step_logs, mode))]
    return [*command, *args.serve_args]


def step_log(folder: Path, mode: Mode) -> Path:
    """The step log of ``mode``'s daemon in ``folder``."""
    return folder / f"{mode.name}.jsonl"


@contextmanager
def serving(command: list[str], endpoint: str) -> Iterator[None]:
    """A daemon started with ``command``, ready at ``endpoint`` (the seconds it took
    printed: the start-up's model load, graphs, warm-up and timing); stopped after."""
    print("daemon:", " ".join(command), flush=True)
    started = time.monotonic()
    proc = subprocess.Popen(command, env={**os.environ, "OUTRIDER_LOG_LEVEL": "warning"})
    try:
        wait_ready(endpoint, proc, 900)
        print(f"ready in {time.monotonic() - started:.1f} s", flush=True)
        yield
    finally:
        proc.terminate()
        proc.wait(120)


def bench_command(
    endpoint: str, concurrency: int, result: str, args: argparse.Namespace
) -> list[str]:
    """The ``outrider bench serve`` run at ``concurrency``, its result written to ``result``.
    Its prompts are seeded by the concurrency: a daemon's prefix cache holds the earlier runs'
    prompts, and the same seed would serve a run's first requests from it (how much, set by
    which concurrencies ran before), so that a cell's figures would depend on the list."""
    command = [
        sys.executable, "-m", "outrider.daemon.cli", "bench", "serve", "--endpoint", endpoint,
        "--dataset", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts",
        str(max(2 * concurrency, 16)), "--max-concurrency", str(concurrency),
        "--seed", str(concurrency), "--result-json", result,
    ]  # fmt: skip
    if args.tokenizer:
        command += ["--tokenizer", str(args.tokenizer)]
    return command


def bench(
    endpoint: str, concurrency: int, args: argparse.Namespace
) -> tuple[dict[str, float], float]:
    """One ``outrider bench serve`` run at ``concurrency``: its result's ``KEPT`` figures, and
    the Unix time its timed requests began (after its untimed first request)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = bench_command(endpoint, concurrency, out.name, args)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        result = json.loads(Path(out.name).read_text())
    return {key: result[key] for key in KEPT if key in result}, result["started_at"]


def ratios(rows: list[dict]) -> list[dict]:
    """``rows`` (mode, target, algorithm, acceptance, concurrency and the figures), each with
    ``ratio``: its output tok/s over that of ``none`` on its target at its concurrency
    (None where that run is missing)."""
    reference = {
        (row["target"], row["concurrency"]): row["output_throughput"]
        for row in rows
        if row["algorithm"] == "none"
    }
    out = []
    for row in rows:
        base = reference.get((row["target"], row["concurrency"]))
        out.append({**row, "ratio": row["output_throughput"] / base if base else None})
    return out


def table(rows: list[dict]) -> str:
    lines = [f"{'mode':<22} {'C':>4} {'tok/s':>10} {'ratio':>6} {'accept':>6} "
             f"{'P99 ITL ms':>10} {'P99 TPOT ms':>11}"]  # fmt: skip
    for row in ratios(rows):
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        lines.append(
            f"{row['mode']:<22} {row['concurrency']:>4} {row['output_throughput']:>10.1f} "
            f"{ratio:>6} {row.get('spec_decode_acceptance_length', 1.0):>6.2f} "
            f"{row['p99_itl_ms']:>10.2f} {row['p99_tpot_ms']:>11.2f}"
        )
    return "\n".join(lines)


def attach_turns(spans: Sequence[tuple[dict, float, float]], log: list[Line]) -> None:
    """Each result of ``spans`` (with the Unix times its run began and ended) gets, as
    ``turns``, the turns of its daemon's step log ``log`` that started during its run."""
    for row, began, ended in spans:
        kinds = summarize(log, since=began, until=ended)
        row["turns"] = {name: asdict(turns) for name, turns in kinds.items()}


def turns_table(rows: list[dict]) -> str:
    """Each result's turns by kind (``step_summary.describe``), where it has them."""
    return "\n".join(
        f"{row['mode']:<22} {row['concurrency']:>4}  "
        + describe({name: Turns(**turns) for name, turns in row["turns"].items()})
        for row in rows
        if "turns" in row
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("dummy", "moe", "family"), default="dummy")
    parser.add_argument("--algorithms", nargs="+", choices=("chain", "tree", "ngram", "dflash"),
                        default=["chain", "tree", "ngram", "dflash"])  # fmt: skip
    parser.add_argument("--acceptance", type=float, nargs="+", default=[2.0, 4.0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--fixed", type=int, nargs="*", default=[], metavar="N",
                        help="also each algorithm drafting every batch at verify width N "
                        "(DFlash: its block)")  # fmt: skip
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--tokenizer", type=Path, help="required with --shape dummy")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--step-logs", type=Path, help="a folder: each daemon's --step-log")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("serve_args", nargs="*", help="extra `outrider serve` flags (after --)")
    args = parser.parse_args()
    if args.shape != "family" and args.tokenizer is None:
        parser.error(f"--shape {args.shape} needs --tokenizer (the config.json files have none)")
    targets, algorithms = {"dummy": dummy_shape, "moe": moe_shape, "family": family_shape}[
        args.shape
    ]()
    if args.step_logs:
        args.step_logs.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for mode in modes(algorithms, args.algorithms, args.acceptance, args.fixed):
        endpoint = f"ipc://{tempfile.mkdtemp()}/bench.sock"
        spans: list[tuple[dict, float, float]] = []  # each result and its wall times
        with serving(serve_command(mode, targets, algorithms, endpoint, args), endpoint):
            for concurrency in args.concurrency:
                figures, began = bench(endpoint, concurrency, args)
                rows.append({
                    "mode": mode.name, "target": mode.target, "algorithm": mode.algorithm,
                    "acceptance": mode.acceptance, "concurrency": concurrency, **figures,
                })  # fmt: skip
                spans.append((rows[-1], began, time.time()))
                args.out.write_text(json.dumps(ratios(rows), indent=1) + "\n")
                print(json.dumps(rows[-1]), flush=True)
        if args.step_logs:  # the daemon has stopped: its log is whole
            attach_turns(spans, read(step_log(args.step_logs, mode)))
            args.out.write_text(json.dumps(ratios(rows), indent=1) + "\n")
    print(table(rows))
    if args.step_logs:
        print(turns_table(rows))


if __name__ == "__main__":
    main()
