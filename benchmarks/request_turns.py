"""Where a served request's time goes, turn by turn: the embedded family in process with the
drafting policy ``serve`` runs, the family's held-out prompts through the chat template, one
request at a time on the serial loop, each turn timed between two device synchronisations and
labelled by the plan it launched.

    python benchmarks/request_turns.py --device cuda --algorithm eagle3 --temperature 0.7

Labels: ``extend`` (a prompt turn), ``plain`` (a decode turn without drafts), ``draft`` (a
speculative cycle); ``+rel`` where the plan reported an ended request, ``+cu`` where the turn ran
an eager catch-up first (a catch-up replayed from a CUDA graph does not show). A first round
is not counted in the table, so that the counted rounds' prompts hit the prefix cache, as a
daemon's repeated runs do; its time a request is printed beside them (the first pass of a
daemon, whose prompts all miss the cache).
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import torch
from host_turn import family_settings  # benchmarks/ is sys.path[0] when run as a script
from transformers import AutoTokenizer

from outrider.daemon.config import ServeConfig
from outrider.daemon.engine.build import Engine, build_engine
from outrider.daemon.engine.plan import StepPlan
from outrider.daemon.internal import own_request
from outrider.plugins.sampling_spec import SamplingSpec
from outrider.plugins.speculative.deferred import DeferredRows

PROMPTS_FILE = "heldout_prompts.jsonl"


def build(device: str, algorithm: str, steps: int) -> tuple[Engine, list[list[int]]]:
    """The family's engine as ``serve`` builds it, and its held-out prompts' token ids."""
    settings = family_settings(device, algorithm)
    if steps:
        settings["speculative_num_steps"] = steps
    engine = build_engine(ServeConfig(**settings))  # type: ignore[arg-type]  # typed above
    return engine, held_out_prompts(str(settings["model"]))


def held_out_prompts(model: str) -> list[list[int]]:
    """The family's held-out prompts (beside the target ``model``'s directory) through its
    chat template, as token ids."""
    target = Path(model)
    tokenizer = AutoTokenizer.from_pretrained(target)
    lines = (target.parent / PROMPTS_FILE).read_text().splitlines()
    prompts = []
    for line in lines:
        ids = tokenizer.apply_chat_template(
            json.loads(line)["messages"], add_generation_prompt=True, tokenize=True
        )
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return prompts


def label_turns(engine: Engine) -> list[str]:
    """A one-item list the engine's launches write the current turn's label into."""
    runner, label = engine.loop.runner, [""]
    launch, worker = runner.launch, runner.worker

    def labelled(plan: StepPlan, *rest: object) -> object:
        kind = plan.kind if plan.kind == "extend" else ("draft" if plan.drafting else "plain")
        label[0] = kind + ("+rel" if plan.released_slots else "") + label[0]
        return launch(plan, *rest)  # type: ignore[arg-type]  # the loop's grammar and settle

    runner.launch = labelled  # type: ignore[method-assign,assignment]
    if runner.deferred is not None:
        catch_up = worker.catch_up_deferred

        def marked(rows: DeferredRows) -> None:
            label[0] += "+cu"
            catch_up(rows)

        worker.catch_up_deferred = marked  # type: ignore[method-assign]
    return label


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--algorithm", default="none")
    parser.add_argument("--num-steps", type=int, default=3, help="EAGLE-3's chain length")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    steps = args.num_steps if args.algorithm == "eagle3" else 0
    engine, prompts = build(args.device, args.algorithm, steps)
    prompts = prompts[: args.prompts]
    loop = engine.loop
    loop.overlap = False
    label = label_turns(engine)

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    turns: dict[str, list[float]] = collections.defaultdict(list)
    first_round = 0.0
    rid = 0
    for round_ in range(args.rounds + 1):
        for seed, prompt in enumerate(prompts):
            rid += 1
            sampling = SamplingSpec(args.temperature, 1.0, 0, seed, 0)
            loop.scheduler.add(own_request(rid, f"r{rid}", prompt, args.new_tokens, sampling))
            while loop.has_work:
                label[0] = ""
                sync()
                started = time.perf_counter()
                loop.iterate()
                sync()
                elapsed = (time.perf_counter() - started) * 1e3
                if round_:
                    turns[label[0]].append(elapsed)
                else:
                    first_round += elapsed
            loop.scheduler.take_updates()
    requests = args.rounds * len(prompts)
    total = sum(sum(times) for times in turns.values())
    print(
        f"{args.algorithm} at T = {args.temperature}: {total / requests:.2f} ms a request "
        f"({requests * args.new_tokens / total * 1e3:.1f} tok/s); the first round "
        f"{first_round / len(prompts):.2f} ms a request"
    )
    for kind, times in sorted(turns.items()):
        times.sort()
        print(
            f"  {kind:16s} {len(times) / requests:6.2f} a request, median "
            f"{times[len(times) // 2]:.3f} ms, {sum(times) / requests:7.2f} ms a request"
        )


if __name__ == "__main__":
    main()
