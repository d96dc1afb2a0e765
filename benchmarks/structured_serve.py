"""A JSON-schema workload through the real daemon, with the grammar and without, for each
speculative algorithm, under the overlap loop and the serial one.

For each configuration and loop it starts ``outrider serve``, then runs ``outrider bench
serve`` (random prompts, greedy) at each ``--concurrency``: warm-up runs with the grammar
(the compiler's first vocabulary read, the graphs captured on first use) and without, then
``--pairs`` measured pairs back to back, each a run without the grammar and one with
``--json-schema`` (``benchmarks/structured/review.schema.json`` unless ``--schema``). It
writes every result and the ratios to ``--out`` (JSON) and a table to stdout: the median
pair's output tok/s and mean TPOT with the grammar over without (the pairs' range of the
first beside it), and acceptance lengths, a row per loop (overlap against serial: compare
the rows). Runs of a few seconds move by a tenth from one to the next: compare pairs of one
daemon, not daemons. With the grammar the requests end where the schema's JSON ends (at most
``--output-len``); without it they decode as much (``ignore_eos``): lengths drawn uniformly
around the warm-up's mean output length, spread as its shortest and longest, so that both
runs admit and finish requests alike and the ratio is the grammar's cost.

    python benchmarks/structured_serve.py --device cuda --out structured.json
    python benchmarks/structured_serve.py --shape llama --model-dir DIR --device cuda ...

``--shape family`` (the default) serves the embedded family with its trained drafts;
``--shape llama`` serves ``--model-dir`` (a Llama-3.1-8B config.json beside a tokenizer, dummy
weights) with dummy drafts at a simulated acceptance (bench/sweep.py's rates), and ``--shape
qwen3`` a Qwen3-8B one, plainly and with the DFlash-b16 draft. The tokenizer should have the
config's vocabulary size, and be a real one: the grammar engine's cost follows the
tokenizer's size, its special ids and its pieces (``benchmarks/real_vocab.py`` puts a real
129,280-id tokenizer beside a config of that size; the drafts take the target's size). The
daemons log at ``OUTRIDER_LOG_LEVEL`` (default ``warning``; ``info`` shows the graphs captured
on first use, and when).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from decode import wait_ready  # benchmarks/ is sys.path[0] when run as a script

from outrider.daemon.family import embedded_family

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "benchmarks" / "structured" / "review.schema.json"
CONFIGS = ROOT / "tests" / "fixtures" / "configs"


def family_configs() -> dict[str, list[str]]:
    family = embedded_family()
    if family is None:
        raise SystemExit("the outrider-family package is not installed (pip install ./family)")
    eagle3, dflash = str(family.target.parent / "eagle3"), str(family.target.parent / "dflash")
    return {
        "none": ["--speculative-algorithm", "none"],  # the family's default drafts
        "ngram": ["--speculative-algorithm", "ngram"],
        "eagle3-chain": ["--speculative-algorithm", "eagle3", "--draft-model", eagle3,
                         "--speculative-num-steps", "3"],
        "eagle3-tree": ["--speculative-algorithm", "eagle3", "--draft-model", eagle3,
                        "--speculative-num-steps", "3", "--speculative-topk", "4",
                        "--speculative-num-draft-tokens", "8"],
        "dflash": ["--speculative-algorithm", "dflash", "--draft-model", dflash],
    }  # fmt: skip


def draft_config(name: str, model_dir: str) -> str:
    """The fixture draft config ``name`` with the target's ``vocab_size`` (a model directory
    of another vocabulary, ``real_vocab.py``'s), written beside the system's temporary files
    where it differs. A DFlash draft's mask token outside that vocabulary takes its last id."""
    config = json.loads((CONFIGS / name).read_text())
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    if config["vocab_size"] == vocab_size:
        return str(CONFIGS / name)
    config["vocab_size"] = vocab_size
    dflash = config.get("dflash_config", {})
    if dflash.get("mask_token_id", 0) >= vocab_size:
        dflash["mask_token_id"] = vocab_size - 1
    path = Path(tempfile.gettempdir()) / f"vocab{vocab_size}-{name}"
    path.write_text(json.dumps(config, indent=2) + "\n")
    return str(path)


def llama_configs(model_dir: str) -> dict[str, list[str]]:
    eagle3 = draft_config("Llama-3.1-8B-EAGLE3.config.json", model_dir)
    target = ["--model", model_dir, "--load-format", "dummy", "--dtype", "bfloat16"]
    return {
        "none": target,
        "ngram": [*target, "--speculative-algorithm", "ngram",
                  "--speculative-simulate-acceptance", "2"],
        "eagle3-chain": [*target, "--speculative-algorithm", "eagle3", "--draft-model", eagle3,
                         "--speculative-num-steps", "3", "--speculative-simulate-acceptance", "3"],
        "eagle3-tree": [*target, "--speculative-algorithm", "eagle3", "--draft-model", eagle3,
                        "--speculative-num-steps", "5", "--speculative-topk", "4",
                        "--speculative-num-draft-tokens", "8",
                        "--speculative-simulate-acceptance", "3"],
    }  # fmt: skip


def qwen3_configs(model_dir: str) -> dict[str, list[str]]:
    dflash = draft_config("Qwen3-8B-DFlash-b16.config.json", model_dir)
    target = ["--model", model_dir, "--load-format", "dummy", "--dtype", "bfloat16"]
    return {
        "none": target,
        "dflash": [*target, "--speculative-algorithm", "dflash", "--draft-model", dflash,
                   "--speculative-simulate-acceptance", "6.4"],
    }  # fmt: skip


SHAPES = {"llama": llama_configs, "qwen3": qwen3_configs}


@dataclass(frozen=True)
class Lengths:
    """Output lengths of a run: uniform in ``[mean * (1 - spread), mean * (1 + spread)]``."""

    mean: int
    spread: float

    @classmethod
    def of(cls, outputs: list[int]) -> Lengths:
        """The lengths ``outputs`` (a run's output lengths) span."""
        mean = max(1, round(sum(outputs) / len(outputs)))
        return cls(mean, min(1.0, (max(outputs) - min(outputs)) / (2 * mean)))


def bench(
    endpoint: str, args: argparse.Namespace, concurrency: int, lengths: Lengths | None
) -> dict:
    """One ``outrider bench serve`` run: with the schema (``lengths`` None; at most
    ``--output-len`` tokens), or without it, of ``lengths``. Its result JSON's figures."""
    mean, spread = (args.output_len, 0.0) if lengths is None else (lengths.mean, lengths.spread)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [
            sys.executable, "-m", "outrider.daemon.cli", "bench", "serve", "--endpoint",
            endpoint, "--dataset", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(mean), "--random-range-ratio", str(spread),
            "--num-prompts", str(args.prompts * concurrency), "--max-concurrency",
            str(concurrency), "--result-json", out.name,
        ]  # fmt: skip
        if lengths is None:
            command += ["--json-schema", f"@{args.schema}"]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        result = json.loads(Path(out.name).read_text())
    keep = ("output_throughput", "mean_tpot_ms", "total_output_tokens", "completed", "failed",
            "spec_decode_acceptance_length", "duration", "output_lens")  # fmt: skip
    return {key: result[key] for key in keep if key in result}


def measure(
    name: str, flags: list[str], serial: bool, args: argparse.Namespace, rows: list[dict]
) -> None:
    """Serve ``name`` and append a row to ``rows`` per concurrency, writing ``--out`` after
    each (a run cut short keeps what it measured)."""
    endpoint = f"ipc://{tempfile.mkdtemp()}/bench.sock"
    command = [
        sys.executable, "-m", "outrider.daemon.cli", "serve", "--listen", endpoint,
        "--device", args.device, "--speculative-min-acceptance", "0", *flags, *args.serve_args,
    ]  # fmt: skip
    if serial:
        command.append("--no-overlap")
    print("daemon:", " ".join(command), flush=True)
    level = os.environ.get("OUTRIDER_LOG_LEVEL", "warning")  # info: the first-use captures
    proc = subprocess.Popen(command, env={**os.environ, "OUTRIDER_LOG_LEVEL": level})
    try:
        wait_ready(endpoint, proc, 900)
        for concurrency in args.concurrency:
            # Warm: the grammar compiler's first vocabulary read, the graphs a batch with
            # grammar rows replays (captured on first use).
            lengths = Lengths.of(bench(endpoint, args, concurrency, None)["output_lens"])
            bench(endpoint, args, concurrency, lengths)  # warm: the unconstrained batches
            print(f"measured pairs at concurrency {concurrency}", file=sys.stderr, flush=True)
            pairs = []
            for _ in range(args.pairs):
                plain = bench(endpoint, args, concurrency, lengths)
                constrained = bench(endpoint, args, concurrency, None)
                for run in (plain, constrained):
                    del run["output_lens"]
                pairs.append({
                    "plain": plain, "grammar": constrained,
                    "tok_s_ratio": constrained["output_throughput"] / plain["output_throughput"],
                    "tpot_ratio": constrained["mean_tpot_ms"] / plain["mean_tpot_ms"],
                })  # fmt: skip
            middle = sorted(pairs, key=lambda pair: pair["tok_s_ratio"])[len(pairs) // 2]
            rows.append({
                "config": name, "loop": "serial" if serial else "overlap",
                "concurrency": concurrency, **middle, "pairs": pairs,
                "plain_lengths": {"mean": lengths.mean, "spread": lengths.spread},
            })  # fmt: skip
            args.out.write_text(json.dumps(rows, indent=1) + "\n")
            print(json.dumps(rows[-1]), flush=True)
    finally:
        proc.terminate()
        proc.wait(120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("family", *SHAPES), default="family")
    parser.add_argument("--model-dir", help="--shape llama, qwen3: config.json and a tokenizer")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--configs", nargs="+", help="default: every one of the shape")
    parser.add_argument("--loops", nargs="+", choices=("overlap", "serial"),
                        default=["overlap", "serial"])  # fmt: skip
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompts", type=int, default=4, help="requests per concurrency slot")
    parser.add_argument("--pairs", type=int, default=3, help="measured pairs per concurrency")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--schema", type=Path, default=SCHEMA)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("serve_args", nargs="*", help="extra `outrider serve` flags (after --)")
    args = parser.parse_args()
    if args.shape == "family":
        configs = family_configs()
    elif args.model_dir:
        configs = SHAPES[args.shape](args.model_dir)
    else:
        parser.error(f"--shape {args.shape} needs --model-dir")
    rows: list[dict] = []
    for name in args.configs or list(configs):
        for loop in args.loops:
            measure(name, configs[name], loop == "serial", args, rows)
    for row in rows:
        print(
            f"{row['config']:>13} {row['loop']:>7} c{row['concurrency']:<3}"
            f" tok/s {row['plain']['output_throughput']:9.1f} -> "
            f"{row['grammar']['output_throughput']:9.1f} ({row['tok_s_ratio']:.2f}x)"
            f" [{min(pair['tok_s_ratio'] for pair in row['pairs']):.2f}-"
            f"{max(pair['tok_s_ratio'] for pair in row['pairs']):.2f}]"
            f" TPOT {row['tpot_ratio']:.2f}x"
            f" tau {row['plain'].get('spec_decode_acceptance_length', 1):.2f} -> "
            f"{row['grammar'].get('spec_decode_acceptance_length', 1):.2f}"
        )


if __name__ == "__main__":
    main()
