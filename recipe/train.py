"""The recipe's driver: ``python recipe/train.py STAGE [--out DIR] [options]``.

Stages run in order (data, tokenizer, target, regenerate); each reads the manifests of the
stages before it and is skipped when it already completed with the same config and inputs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# NOTE: run as a script, sys.path[0] is recipe/ itself, where module names such as `data`
# would shadow installed packages; the repository root takes its place so that the recipe is
# imported as the package `recipe`.
_ROOT = Path(__file__).resolve().parent.parent
if sys.path and Path(sys.path[0]).resolve() == _ROOT / "recipe":
    sys.path[0] = str(_ROOT)

from recipe import data, model, regenerate, target, tokenizer  # noqa: E402

DEFAULT_OUT = _ROOT / "recipe" / "out"
EXIT_UNFINISHED = 3  # a resumable stage stopped at its budget: run it again


def _data(args: argparse.Namespace) -> None:
    config = data.DataConfig(
        heldout_fraction=args.heldout_fraction, seed=args.seed, limit=args.limit
    )
    data.run(config, args.out, args.source)


def _tokenizer(args: argparse.Namespace) -> None:
    config = tokenizer.TokenizerConfig(vocab_size=args.vocab_size, min_frequency=args.min_frequency)
    tokenizer.run(config, args.out)


def _target(args: argparse.Namespace) -> None:
    config = target.TargetConfig(
        shape=args.shape,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        steps=args.steps,
        train_seconds=args.train_seconds,
        eval_every=args.eval_every,
        export_dtype=args.export_dtype,
        seed=args.seed,
    )
    runtime = target.TargetRuntime(
        device=args.device or target.TargetRuntime.device,
        budget_s=args.budget_s,
        max_steps_this_call=args.max_steps_this_call,
    )
    if target.run(config, runtime, args.out) is None:
        sys.exit(EXIT_UNFINISHED)


def _regenerate(args: argparse.Namespace) -> None:
    config = regenerate.RegenerateConfig(
        count=args.count,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    regenerate.run(config, args.out, args.device or target.TargetRuntime.device)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recipe/train.py", description=__doc__)
    stages = parser.add_subparsers(dest="stage", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output root")

    p = stages.add_parser("data", parents=[common], help="clean and split ShareGPT")
    p.add_argument("--source", type=Path, help="a ShareGPT JSON file (default: the package's)")
    p.add_argument("--limit", type=int, help="read only the first N conversations")
    p.add_argument("--heldout-fraction", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=_data)

    p = stages.add_parser("tokenizer", parents=[common], help="train the byte-level BPE")
    p.add_argument("--vocab-size", type=int, default=8192, help="specials included")
    p.add_argument("--min-frequency", type=int, default=2)
    p.set_defaults(run=_tokenizer)

    defaults = target.TargetConfig()
    p = stages.add_parser("target", parents=[common], help="train and export the target")
    p.add_argument("--shape", choices=sorted(model.SHAPES), default=defaults.shape)
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    p.add_argument("--steps", type=int, default=defaults.steps, help="0: sized by time")
    p.add_argument(
        "--train-seconds",
        type=float,
        default=defaults.train_seconds,
        help="with --steps 0: the run's length in seconds (approximate)",
    )
    p.add_argument("--eval-every", type=int, default=defaults.eval_every)
    p.add_argument("--export-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=target.TargetRuntime.budget_s,
        help="wall-time budget of this call; training resumes on the next call",
    )
    p.add_argument("--max-steps-this-call", type=int)
    p.set_defaults(run=_target)

    defaults_r = regenerate.RegenerateConfig()
    p = stages.add_parser("regenerate", parents=[common], help="the target's own answers")
    p.add_argument("--count", type=int, default=defaults_r.count)
    p.add_argument("--max-new-tokens", type=int, default=defaults_r.max_new_tokens)
    p.add_argument("--batch-size", type=int, default=defaults_r.batch_size)
    p.add_argument("--seed", type=int, default=defaults_r.seed)
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.set_defaults(run=_regenerate)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
