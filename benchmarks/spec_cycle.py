"""One speculative decode step (draft + verify + accept + draft catch-up) next to one plain
decode step, in process on the GPU, with dummy weights.

First a short pass with any host synchronisation inside a step raising
(``OUTRIDER_DEBUG_SYNC_CHECK``), then steady-state timing: ``batch`` requests decoding, the
overlap loop, the mean wall time of one loop turn (= one step) over ``--steps`` turns.

With ``--schema`` (and ``--tokenizer``, a directory whose tokenizer has the model's vocabulary
size: ``benchmarks/wide_tokenizer.py``) each engine runs its batch a second time with every
row constrained, to an array of at least ``--items`` documents of the schema (so that no row
ends within the timed turns). ``--trace DIR`` writes a profiler trace of a few turns of each
run (``DIR/<algorithm>-<batch>-<free|constrained>.json``, for chrome://tracing or Perfetto)
and prints the host's top functions by their own time over as many more (the whole
profile beside the trace: ``.prof``, for ``pstats``).

    python benchmarks/spec_cycle.py --model Llama-3.1-8B-Instruct.config.json \\
        --algorithm eagle3 --draft-model Llama-3.1-8B-EAGLE3.config.json --batch 1 32
    python benchmarks/spec_cycle.py ... --attention-backend auto --simulate-acceptance 3 \\
        --schema benchmarks/structured/review.schema.json --tokenizer DIR --trace traces

``--attention-backend`` defaults to ``torch`` (the figures of BENCHMARKS.md taken before the
flag); the daemon's default is ``auto``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec
import torch

from outrider.daemon.bench.latency import benchmark_request, random_prompts
from outrider.daemon.config import ServeConfig
from outrider.daemon.engine.build import Engine, build_engine
from outrider.daemon.grammar.compiler import Grammars
from outrider.protocol.messages import Grammar

TRACED_TURNS = 6


@dataclass
class Row:
    algorithm: str
    batch: int
    constrained: bool
    step_ms: float
    tokens_per_step: float  # committed per request per step (1 + mean accepted drafts)


def _engine(args: argparse.Namespace, algorithm: str, batch: int) -> Engine:
    spec = algorithm != "none"
    config = ServeConfig(
        model=args.model,
        load_format="dummy",
        device=args.device,
        dtype="bfloat16",
        max_running=max(batch, 1),
        kv_cache_tokens=batch * (args.prompt + args.steps * 16 + 256) + 4096,
        context_length=args.prompt + args.steps * 16 + 128,
        page_size=args.page_size,
        speculative_algorithm=algorithm,
        draft_model=args.draft_model if spec else "",
        speculative_num_draft_tokens=args.num_draft_tokens if spec else 0,
        speculative_num_steps=args.num_steps if spec else 0,
        speculative_topk=args.topk if spec else 0,
        speculative_simulate_acceptance=args.simulate_acceptance if spec else 0.0,
        speculative_min_acceptance=0.0 if spec else -1.0,  # draft every batch
        threads=args.threads,
        attention_backend=args.attention_backend,
    )
    return build_engine(config)


class Constraint:
    """Every row's grammar: an array of at least ``items`` documents of a JSON schema."""

    def __init__(self, schema: Path, tokenizer: str, items: int, engine: Engine) -> None:
        array = {"type": "array", "items": json.loads(schema.read_text()), "minItems": items}
        self.grammar = Grammar(kind="json_schema", text=json.dumps(array))
        self.grammars = Grammars(tokenizer, engine.facts.vocab_size, engine.facts.eos_token_ids)


def _add(engine: Engine, batch: int, prompt: int, rid0: int, rows: Constraint | None) -> None:
    prompts = random_prompts(batch, prompt, engine.facts.vocab_size, seed=rid0)
    for rid, ids in enumerate(prompts, start=rid0):
        request = benchmark_request(rid, ids, None)
        if rows is None:
            engine.scheduler.add(request)
            continue
        request = msgspec.structs.replace(request, grammar=rows.grammar, ignore_eos=False)
        engine.scheduler.add(request, rows.grammars.start(request))


def _drain(engine: Engine) -> None:
    for rid in list(engine.scheduler.requests):
        engine.scheduler.abort(rid, "benchmark done")
    while engine.loop.has_work:
        engine.loop.iterate()


def _synchronize(engine: Engine) -> None:
    if engine.config.device == "cuda":
        torch.cuda.synchronize()


def measure(
    engine: Engine,
    algorithm: str,
    batch: int,
    steps: int,
    prompt: int,
    profile: bool = False,
    rows: Constraint | None = None,
    trace: Path | None = None,
) -> Row:
    loop = engine.loop
    # Correctness pass: every launch under the sync check.
    loop.runner.enable_sync_check(True)
    _add(engine, batch, prompt, 0, rows)
    for _ in range(8):
        loop.iterate()
    _drain(engine)
    loop.runner.enable_sync_check(False)

    _add(engine, batch, prompt, 10_000, rows)
    while any(not r.decoding for r in engine.scheduler.running) or engine.scheduler.waiting:
        loop.iterate()
    for _ in range(3):
        loop.iterate()
    before = engine.scheduler.counters()
    _synchronize(engine)
    start = time.perf_counter()
    for _ in range(steps):
        loop.iterate()
    _synchronize(engine)
    elapsed = time.perf_counter() - start
    after = engine.scheduler.counters()
    if profile:
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            for _ in range(3):
                loop.iterate()
            _synchronize(engine)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25), flush=True)
    if trace is not None:
        kind = "free" if rows is None else "constrained"
        _trace(engine, trace / f"{algorithm}-{batch}-{kind}.json")
    drafts = after.spec_drafts - before.spec_drafts
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    _drain(engine)
    return Row(
        algorithm=algorithm,
        batch=batch,
        constrained=rows is not None,
        step_ms=1000 * elapsed / steps,
        tokens_per_step=1 + accepted / drafts if drafts else 1.0,
    )


def _trace(engine: Engine, path: Path) -> None:
    """A profiler trace of ``TRACED_TURNS`` turns to ``path``, then the host's top functions
    by own time over as many more (printed; the whole profile beside the trace, ``.prof``)."""
    loop = engine.loop
    activities = [torch.profiler.ProfilerActivity.CPU]
    if engine.config.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(TRACED_TURNS):
            loop.iterate()
        _synchronize(engine)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    host = cProfile.Profile()
    host.enable()
    for _ in range(TRACED_TURNS):
        loop.iterate()
    _synchronize(engine)
    host.disable()
    print(f"host functions over {TRACED_TURNS} turns ({path.stem}):", flush=True)
    host.dump_stats(path.with_suffix(".prof"))
    pstats.Stats(host).sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="target config.json (dummy weights)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--algorithm", required=True)
    parser.add_argument("--draft-model", default="")
    parser.add_argument("--num-draft-tokens", type=int, default=0)
    parser.add_argument("--num-steps", type=int, default=0)
    parser.add_argument("--topk", type=int, default=0, help="> 1: a tree (needs the two above)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--profile", action="store_true", help="print a profile of 3 turns")
    parser.add_argument("--simulate-acceptance", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=0, help="`outrider serve --threads`")
    parser.add_argument(
        "--attention-backend", default="torch", help="`outrider serve`'s (its default: auto)"
    )
    parser.add_argument("--schema", type=Path, help="also run every row under this schema")
    parser.add_argument("--tokenizer", help="with --schema: the grammar's tokenizer directory")
    parser.add_argument("--items", type=int, default=4, help="with --schema: documents a row")
    parser.add_argument("--trace", type=Path, help="a directory for traces")
    args = parser.parse_args()
    if args.schema is not None and args.tokenizer is None:
        parser.error("--schema needs --tokenizer")
    rows = []
    for algorithm in ("none", args.algorithm):
        for batch in args.batch:
            engine = _engine(args, algorithm, batch)
            rows.append(
                measure(
                    engine, algorithm, batch, args.steps, args.prompt, args.profile,
                    trace=args.trace,
                )
            )  # fmt: skip
            print(json.dumps(asdict(rows[-1])), flush=True)
            if args.schema is not None:
                constraint = Constraint(args.schema, args.tokenizer, args.items, engine)
                rows.append(
                    measure(
                        engine, algorithm, batch, args.steps, args.prompt, args.profile,
                        constraint, args.trace,
                    )
                )  # fmt: skip
                print(json.dumps(asdict(rows[-1])), flush=True)
            del engine
            if args.device == "cuda":
                torch.cuda.empty_cache()
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "torch": torch.__version__,
                "model": args.model,
                "draft_model": args.draft_model,
            }
        )
    )


if __name__ == "__main__":
    main()
