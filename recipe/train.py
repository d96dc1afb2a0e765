"""The recipe's driver: ``python recipe/train.py STAGE [--out DIR] [options]``.

Stages run in order (data, tokenizer, target, regenerate, then the drafts eagle3 and dflash
in either order, then family); each reads the manifests of the stages before it and is
skipped when it already completed with the same config and inputs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

# NOTE: run as a script, sys.path[0] is recipe/ itself, where module names such as `data`
# would shadow installed packages; the repository root takes its place so that the recipe is
# imported as the package `recipe`.
_ROOT = Path(__file__).resolve().parent.parent
if sys.path and Path(sys.path[0]).resolve() == _ROOT / "recipe":
    sys.path[0] = str(_ROOT)

from recipe import (  # noqa: E402
    data,
    dflash_train,
    draft_loop,
    eagle3_train,
    family,
    model,
    regenerate,
    target,
    tokenizer,
)

DEFAULT_OUT = _ROOT / "recipe" / "out"
DEFAULT_FAMILY = _ROOT / "family" / "outrider_family"
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


def _adopt_target(args: argparse.Namespace) -> None:
    family.adopt_target(args.out, args.family)


def _family(args: argparse.Namespace) -> None:
    config = family.FamilyConfig(count=args.count, max_prompt_tokens=args.max_prompt_tokens)
    family.run(config, args.out, args.dest)


def _draft_runtime(args: argparse.Namespace) -> draft_loop.DraftRuntime:
    return draft_loop.DraftRuntime(
        device=args.device or draft_loop.DraftRuntime.device,
        budget_s=args.budget_s,
        max_steps_this_call=args.max_steps_this_call,
    )


def _eagle3(args: argparse.Namespace) -> None:
    config = eagle3_train.Eagle3StageConfig(
        aux_layer_ids=tuple(args.aux_layer_ids),
        draft_vocab_size=args.draft_vocab_size,
        intermediate_size=args.intermediate_size,
        steps=args.steps,
        lr=args.lr,
        epochs=args.epochs,
        batch_size=args.batch_size,
        eval_prompts=args.eval_prompts,
        export_dtype=args.export_dtype,
        seed=args.seed,
    )
    if eagle3_train.run(config, _draft_runtime(args), args.out) is None:
        sys.exit(EXIT_UNFINISHED)


def _dflash(args: argparse.Namespace) -> None:
    config = dflash_train.DFlashStageConfig(
        target_layer_ids=tuple(args.target_layer_ids),
        num_layers=args.num_layers,
        block_size=args.block_size,
        intermediate_size=args.intermediate_size,
        max_anchors=args.max_anchors,
        lr=args.lr,
        epochs=args.epochs,
        batch_size=args.batch_size,
        eval_prompts=args.eval_prompts,
        export_dtype=args.export_dtype,
        seed=args.seed,
    )
    if dflash_train.run(config, _draft_runtime(args), args.out) is None:
        sys.exit(EXIT_UNFINISHED)


def _draft_options(p: argparse.ArgumentParser, defaults: Any) -> None:
    """Options both draft stages take."""
    p.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--epochs", type=float, default=defaults.epochs)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences")
    p.add_argument("--eval-prompts", type=int, default=defaults.eval_prompts)
    p.add_argument("--export-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=draft_loop.DraftRuntime.budget_s,
        help="wall-time budget of this call; training resumes on the next call",
    )
    p.add_argument("--max-steps-this-call", type=int)


def _draft_parsers(stages: Any, common: argparse.ArgumentParser) -> None:
    defaults_e = eagle3_train.Eagle3StageConfig()
    p = stages.add_parser("eagle3", parents=[common], help="train and export the EAGLE-3 draft")
    p.add_argument(
        "--aux-layer-ids",
        type=int,
        nargs=3,
        default=list(defaults_e.aux_layer_ids),
        help="tapped target layers, output-of-layer convention",
    )
    p.add_argument("--draft-vocab-size", type=int, default=defaults_e.draft_vocab_size)
    p.add_argument("--steps", type=int, default=defaults_e.steps, help="training-time unroll")
    _draft_options(p, defaults_e)
    p.set_defaults(run=_eagle3)

    defaults_d = dflash_train.DFlashStageConfig()
    p = stages.add_parser("dflash", parents=[common], help="train and export the DFlash draft")
    p.add_argument(
        "--target-layer-ids",
        type=int,
        nargs="+",
        default=list(defaults_d.target_layer_ids),
        help="tapped target layers, output-of-layer convention",
    )
    p.add_argument("--num-layers", type=int, default=defaults_d.num_layers)
    p.add_argument("--block-size", type=int, default=defaults_d.block_size)
    p.add_argument("--max-anchors", type=int, default=defaults_d.max_anchors)
    _draft_options(p, defaults_d)
    p.set_defaults(run=_dflash)


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

    p = stages.add_parser(
        "adopt-target", parents=[common], help="the shipped target as the target stage's output"
    )
    p.add_argument("--family", type=Path, default=DEFAULT_FAMILY, help="the package directory")
    p.set_defaults(run=_adopt_target)

    defaults_r = regenerate.RegenerateConfig()
    p = stages.add_parser("regenerate", parents=[common], help="the target's own answers")
    p.add_argument("--count", type=int, default=defaults_r.count)
    p.add_argument("--max-new-tokens", type=int, default=defaults_r.max_new_tokens)
    p.add_argument("--batch-size", type=int, default=defaults_r.batch_size)
    p.add_argument("--seed", type=int, default=defaults_r.seed)
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.set_defaults(run=_regenerate)
    _draft_parsers(stages, common)

    defaults_f = family.FamilyConfig()
    p = stages.add_parser("family", parents=[common], help="gather the outrider-family package")
    p.add_argument("--count", type=int, default=defaults_f.count, help="held-out prompts")
    p.add_argument("--max-prompt-tokens", type=int, default=defaults_f.max_prompt_tokens)
    p.add_argument("--dest", type=Path, default=DEFAULT_FAMILY, help="the package directory")
    p.set_defaults(run=_family)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
