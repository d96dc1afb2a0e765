"""Every speculative algorithm against ``none`` on the embedded family, at each temperature:
tok/s through the real daemon (``family_acceptance.py``, one daemon a cell, the median of its
passes), in rounds that interleave the algorithms, and each cell's ratio to ``none`` of the
same round and temperature; the report is the median ratio over the rounds.

    python benchmarks/family_temperatures.py --device cuda --temperatures 0 0.7 1.0 --runs 5

Each daemon serves the family's held-out prompts as messages, one at a time by default, seeded,
``--runs`` passes (its tok/s is their median; a daemon's first pass, whose prompts miss the
prefix cache, counts like the others). EAGLE-3 drafts chains of ``--eagle3-steps``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ACCEPTANCE = Path(__file__).with_name("family_acceptance.py")


@dataclass
class Cell:
    round: int
    temperature: float
    algorithm: str
    tokens_per_s: float
    runs_tokens_per_s: list[float]
    tau: float
    drafting_rows: int


def serve_flags(algorithm: str, eagle3_steps: int) -> list[str]:
    flags = ["--speculative-algorithm", algorithm]
    if algorithm == "eagle3":
        flags += ["--speculative-num-steps", str(eagle3_steps)]
    return flags


def measure(args: argparse.Namespace, round_: int, temperature: float, algorithm: str) -> Cell:
    """One daemon: ``family_acceptance.py`` for one algorithm at one temperature."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "cell.json"
        command = [
            sys.executable, str(ACCEPTANCE), "--device", args.device, "--forms", "messages",
            "--concurrency", str(args.concurrency), "--prompts", str(args.prompts),
            "--new-tokens", str(args.new_tokens), "--runs", str(args.runs),
            "--temperature", str(temperature), "--out", str(out),
            "--daemon-log-level", "warning",
            "--", *serve_flags(algorithm, args.eagle3_steps),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"{algorithm} at T = {temperature} failed:\n{done.stderr[-4000:]}")
        result = json.loads(out.read_text())["results"][0]
    return Cell(
        round=round_,
        temperature=temperature,
        algorithm=algorithm,
        tokens_per_s=result["tokens_per_s"],
        runs_tokens_per_s=result["runs_tokens_per_s"],
        tau=result["tau"],
        drafting_rows=result["spec_drafts"],
    )


def ratios(cells: list[Cell], temperature: float, algorithm: str) -> list[float]:
    """Each round's tok/s of ``algorithm`` over ``none``'s at ``temperature``."""
    by_round = {
        (c.round, c.algorithm): c.tokens_per_s for c in cells if c.temperature == temperature
    }
    rounds = sorted({c.round for c in cells})
    return [by_round[r, algorithm] / by_round[r, "none"] for r in rounds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0])
    parser.add_argument("--algorithms", nargs="+", default=["dflash", "eagle3", "ngram"])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--eagle3-steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900, help="seconds a daemon may take")
    parser.add_argument("--out", type=Path, help="every cell, as JSON")
    args = parser.parse_args()

    algorithms = ["none", *(a for a in args.algorithms if a != "none")]
    cells = []
    for round_ in range(args.rounds):
        for temperature in args.temperatures:
            for algorithm in algorithms:
                cell = measure(args, round_, temperature, algorithm)
                cells.append(cell)
                print(
                    f"round {round_} T = {temperature} {algorithm}: {cell.tokens_per_s:.1f} "
                    f"tok/s {cell.runs_tokens_per_s}, tau {cell.tau:.2f}, "
                    f"{cell.drafting_rows} drafting rows",
                    flush=True,
                )
    if args.out:
        args.out.write_text(json.dumps([asdict(c) for c in cells], indent=2))
    print(f"\n{'T':>4} " + " ".join(f"{a:>18}" for a in algorithms[1:]) + "   (vs none)")
    for temperature in args.temperatures:
        row = [statistics.median(ratios(cells, temperature, a)) for a in algorithms[1:]]
        print(f"{temperature:>4} " + " ".join(f"{r:>18.3f}" for r in row))


if __name__ == "__main__":
    main()
