"""The overlap loop against its serial twin, in process: tokens/s and the GPU's idle fraction.

Builds one engine from `outrider serve` flags (no ``--model``: the embedded family with DFlash),
then serves the same requests with the overlap loop and with the serial loop, keeping
``--concurrency`` requests in flight (a finished one is replaced at once). Per loop it reports
decode tokens/s over the whole set (median of ``--runs``), the acceptance counters (equal both
ways, or the comparison is void), a digest of the outputs, and from a profiler trace of one more
pass (``--profile-steps`` loop turns from turn ``--profile-skip``) the share of the traced
window in which no kernel or copy ran on the GPU.

    python benchmarks/overlap_idle.py --concurrency 32 --prompts 96 -- --device cuda \\
        --speculative-min-acceptance 0
    python benchmarks/overlap_idle.py --input-len 512 -- --device cuda \\
        --speculative-min-acceptance 0 --load-format dummy --dtype bfloat16 \\
        --model tests/fixtures/configs/Qwen3-8B.config.json --speculative-algorithm dflash \\
        --draft-model tests/fixtures/configs/Qwen3-8B-DFlash-b16.config.json \\
        --speculative-simulate-acceptance 6.4

``--speculative-min-acceptance 0`` drafts every batch: the adaptive policy learns from each
pass, so the two loops would otherwise draft at different steps. Prompts: the family's
held-out conversations through its chat template, or with ``--input-len N`` random token ids
(dummy weights have no tokenizer worth using).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from outrider.daemon.engine.build import Engine, build_engine
from outrider.daemon.family import embedded_family
from outrider.daemon.flags import add_serve_arguments, resolve
from outrider.daemon.internal import own_request
from outrider.daemon.tokenizer import load_tokenizer
from outrider.plugins.sampling_spec import SamplingSpec

PROMPTS_FILE = "heldout_prompts.jsonl"


@dataclass
class LoopResult:
    loop: str  # "overlap" or "serial"
    tokens_per_s: float  # median over the runs
    runs_tokens_per_s: list[float]
    spec_drafts: int
    spec_accepted_tokens: int
    outputs_sha256: str
    profiled_turns: int
    gpu_idle_fraction: float | None  # of the traced window: no kernel or copy ran; CPU: None


def family_prompts(count: int) -> list[list[int]]:
    family = embedded_family()
    if family is None:
        raise SystemExit("the outrider-family package is not installed (pip install ./family)")
    tokenizer = load_tokenizer(family.target)
    assert tokenizer is not None, "the family ships its tokenizer"
    lines = (family.target.parent / PROMPTS_FILE).read_text().splitlines()[:count]
    return [tokenizer.apply_chat_template(json.loads(line)["messages"][:1]) for line in lines]


def random_prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def serve(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    concurrency: int,
    temperature: float,
    on_turn: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """Every prompt served with at most ``concurrency`` in flight; the outputs by prompt.
    ``on_turn(n)`` runs before loop turn ``n``."""
    loop = engine.loop
    outputs: list[list[int]] = [[] for _ in prompts]
    waiting = list(range(len(prompts)))[::-1]
    running, turn = 0, 0
    while waiting or loop.has_work:
        while waiting and running < concurrency:
            index = waiting.pop()
            sampling = SamplingSpec(temperature, 1.0, 0, index, 0)
            request = own_request(index, f"r{index}", list(prompts[index]), new_tokens, sampling)
            loop.scheduler.add(request)
            running += 1
        if on_turn is not None:
            on_turn(turn)
        for update in loop.iterate():
            outputs[update.rid].extend(update.token_ids)
            if update.is_final:
                running -= 1
        turn += 1
    loop.idle_check()
    return outputs


def idle_fraction(spans: Iterable[tuple[float, float]]) -> float:
    """The share of [first start, last end] that no interval of ``spans`` covers."""
    ordered = sorted(spans)
    if not ordered:
        return 1.0
    busy, cursor = 0.0, ordered[0][0]
    for start, end in ordered:
        start = max(start, cursor)
        if end > start:
            busy += end - start
            cursor = end
    window = max(end for _, end in ordered) - ordered[0][0]
    return 1.0 - busy / window if window > 0 else 0.0


def device_spans(prof: profile) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every kernel and copy the trace saw on the GPU."""
    spans = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            start = event.time_range.start
            spans.append((start, start + event.time_range.elapsed_us()))
    return spans


def traced_idle_fraction(
    engine: Engine, args: argparse.Namespace, prompts: Sequence[Sequence[int]]
) -> float:
    """One more pass, traced from turn ``--profile-skip`` (admission and prefill are over)
    for ``--profile-steps`` turns: the GPU's idle share of that window."""
    prof = profile(activities=[ProfilerActivity.CUDA])
    first, last = args.profile_skip, args.profile_skip + args.profile_steps

    def on_turn(turn: int) -> None:
        if turn == first:
            prof.start()
        elif turn == last:
            synchronize()
            prof.stop()

    serve(engine, prompts, args.new_tokens, args.concurrency, args.temperature, on_turn)
    if prof.profiler is None or not prof.profiler.function_events:  # the pass ended first
        raise SystemExit(f"the pass ended before turn {last}: lower --profile-steps")
    return idle_fraction(device_spans(prof))


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(
    engine: Engine, overlap: bool, args: argparse.Namespace, prompts: Sequence[Sequence[int]]
) -> LoopResult:
    engine.loop.overlap = overlap
    before = engine.scheduler.counters()
    rates, outputs = [], []
    for _ in range(args.runs):
        synchronize()
        start = time.perf_counter()
        outputs = serve(engine, prompts, args.new_tokens, args.concurrency, args.temperature)
        synchronize()
        rates.append(sum(map(len, outputs)) / (time.perf_counter() - start))
    after = engine.scheduler.counters()
    return LoopResult(
        loop="overlap" if overlap else "serial",
        tokens_per_s=statistics.median(rates),
        runs_tokens_per_s=[round(r, 1) for r in rates],
        spec_drafts=after.spec_drafts - before.spec_drafts,
        spec_accepted_tokens=after.spec_accepted_tokens - before.spec_accepted_tokens,
        outputs_sha256=hashlib.sha256(json.dumps(outputs).encode()).hexdigest(),
        profiled_turns=args.profile_steps,
        gpu_idle_fraction=(
            round(traced_idle_fraction(engine, args, prompts), 4)
            if torch.cuda.is_available()
            else None
        ),
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=0, help="random prompts of N tokens")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile-skip", type=int, default=20)
    parser.add_argument("--profile-steps", type=int, default=200)
    parser.add_argument("serve_args", nargs="*", help="`outrider serve` flags (after --)")
    args = parser.parse_args(argv)
    serve_parser = argparse.ArgumentParser()
    add_serve_arguments(serve_parser)
    config = resolve(serve_parser.parse_args(args.serve_args))
    engine = build_engine(config)
    vocab = engine.model_config.vocab_size
    prompts = (
        random_prompts(args.prompts, args.input_len, vocab)
        if args.input_len
        else family_prompts(args.prompts)
    )
    serve(engine, prompts[: args.concurrency], 8, args.concurrency, args.temperature)  # warm
    results = [measure(engine, overlap, args, prompts) for overlap in (True, False)]
    for result in results:
        print(json.dumps(asdict(result)))
    overlap, serial = results
    same = (overlap.spec_drafts, overlap.spec_accepted_tokens, overlap.outputs_sha256) == (
        serial.spec_drafts,
        serial.spec_accepted_tokens,
        serial.outputs_sha256,
    )
    idle = (
        f"GPU idle {100 * overlap.gpu_idle_fraction:.1f} % against "
        f"{100 * serial.gpu_idle_fraction:.1f} %; "
        if overlap.gpu_idle_fraction is not None and serial.gpu_idle_fraction is not None
        else ""
    )
    print(
        f"overlap / serial: {overlap.tokens_per_s / serial.tokens_per_s:.3f}x "
        f"({overlap.tokens_per_s:,.1f} against {serial.tokens_per_s:,.1f} tok/s); {idle}"
        f"acceptance and outputs {'identical' if same else 'DIFFER'}"
    )
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
