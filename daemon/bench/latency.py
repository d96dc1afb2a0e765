"""The measurement behind ``outrider bench latency`` (bench/command.py): needs the daemon extra."""

from __future__ import annotations

import functools
import itertools
import platform
import random
import sys
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import msgspec
import torch

from outrider.daemon.bench.latency_io import LatencyRow
from outrider.daemon.bench.roofline import WeightBytes, read_bandwidth, step_weight_bytes
from outrider.daemon.config import ServeConfig
from outrider.daemon.engine.build import Engine, build_engine
from outrider.daemon.engine.timing import PhaseTimer, PhaseTimes
from outrider.daemon.internal import GREEDY, TokenizedRequest, own_request
from outrider.daemon.processes.placement import torch_threads
from outrider.daemon.processes.ranks import start_leader, stop_leader
from outrider.plugins.models.config import kv_bytes_per_token
from outrider.plugins.sampling_spec import SamplingSpec


def measure_latency(
    config: ServeConfig,
    batch_sizes: list[int],
    input_lens: list[int],
    output_len: int,
    *,
    runs: int = 1,
    profile: bool = False,
    sampling: SamplingSpec = GREEDY,
) -> tuple[list[LatencyRow], dict[str, object]]:
    """One row per batch size and prompt length (batch-major), each the run of median step
    time of ``runs`` timed runs of requests sampling as ``sampling`` (each seeded by its
    id), and the facts every row shares (device, versions, bandwidth); with ``profile``, each
    row's top operations by device time go to stderr."""
    torch.set_num_threads(torch_threads(config))  # as serve does (each rank sets its own)
    ranks, tp = start_leader(config)
    try:
        engine = build_engine(config, tp=tp)
        measured = _measure(
            engine, config, batch_sizes, input_lens, output_len, sampling, runs, profile
        )
    except BaseException:
        if ranks is not None:
            ranks.stop()  # kills them: they may wait in a step that never completes
        raise
    stop_leader(engine, ranks)
    return measured


class TimedRun(NamedTuple):
    prefill_ms: float
    decode_ms: float
    phases: PhaseTimes  # of the decode

    @property
    def step_ms(self) -> float:
        return self.decode_ms / max(self.phases.steps, 1)


def _measure(
    engine: Engine,
    config: ServeConfig,
    batch_sizes: list[int],
    input_lens: list[int],
    output_len: int,
    sampling: SamplingSpec,
    runs: int,
    profile: bool,
) -> tuple[list[LatencyRow], dict[str, object]]:
    timer = engine.loop.runner.enable_phase_timing()
    dtype = str(engine.facts.configuration["dtype"])
    bandwidth = read_bandwidth(config.device)
    # Under tensor parallelism every rank reads its share at the same time.
    roofline = Roofline(
        bandwidth * config.tensor_parallel_size,
        step_weight_bytes(engine.model_config, dtype),
        kv_bytes_per_token(engine.model_config, dtype),
    )
    rows = []
    rids = itertools.count()
    for batch, input_len in itertools.product(batch_sizes, input_lens):
        # Untimed first: allocator growth, and the CUDA graphs of every batch and KV bound
        # the timed runs will meet.
        run = functools.partial(_run, engine, timer, rids, batch, input_len, output_len, sampling)
        run()
        timed = [run() for _ in range(runs)]
        if profile:
            _profile(engine, batch, run)
        rows.append(latency_row(timed, roofline, batch, input_len, output_len))
    device = torch.cuda.get_device_name() if config.device == "cuda" else platform.processor()
    facts: dict[str, object] = {
        "device": device or platform.machine(),
        "torch": torch.__version__,
        "model": config.model,
        "dtype": dtype,
        "speculative": config.speculative_algorithm,
        "sampling": _described(sampling),
        "tensor_parallel_size": config.tensor_parallel_size,
        "torch_threads": torch.get_num_threads(),
        "width": engine.loop.runner.shape.width,
        "read_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "weight_gb": round(roofline.weights.total / 1e9, 3),
    }
    return rows, facts


def _described(sampling: SamplingSpec) -> str:
    if not sampling.temperature:
        return "greedy"
    return f"temperature {sampling.temperature:g}, top-p {sampling.top_p:g}, top-k {sampling.top_k}"


class Roofline(NamedTuple):
    """What one decode step must read: every weight once (of a mixture of experts, the experts
    the batch's tokens reach), and each row's KV."""

    bandwidth: float  # bytes/s, over every rank
    weights: WeightBytes
    kv_bytes_per_token: int

    def tok_s(self, batch: int, mean_context: float) -> float:
        """One token per row per step at ``bandwidth``."""
        step_bytes = self.weights.per_step(batch) + batch * mean_context * self.kv_bytes_per_token
        return batch * self.bandwidth / step_bytes


def latency_row(
    timed: list[TimedRun], roofline: Roofline, batch: int, input_len: int, output_len: int
) -> LatencyRow:
    """The row of the median run by step time (the lower middle for an even count)."""
    ordered = sorted(timed, key=lambda run: run.step_ms)
    median = ordered[(len(ordered) - 1) // 2]
    steps = max(median.phases.steps, 1)
    tokens = batch * (output_len - 1)
    decode_tok_s = tokens / (median.decode_ms / 1e3)
    ceiling = roofline.tok_s(batch, input_len + output_len / 2)
    return LatencyRow(
        batch=batch,
        input_len=input_len,
        output_len=output_len,
        prefill_ms=median.prefill_ms,
        decode_steps=median.phases.steps,
        step_ms=median.step_ms,
        decode_tok_s=decode_tok_s,
        tokens_per_step=(output_len - 1) / steps,
        roofline_tok_s=ceiling,
        percent_of_roofline=100 * decode_tok_s / ceiling,
        draft_ms=median.phases.draft_ms / steps,
        verify_ms=median.phases.verify_ms / steps,
        catch_up_ms=median.phases.catch_up_ms / steps,
        graph_ms=median.phases.graph_ms / steps,
        runs=len(timed),
        step_ms_min=ordered[0].step_ms,
        step_ms_max=ordered[-1].step_ms,
    )


def _run(
    engine: Engine,
    timer: PhaseTimer,
    rids: Iterator[int],
    batch: int,
    input_len: int,
    output_len: int,
    sampling: SamplingSpec,
) -> TimedRun:
    """``batch`` requests sampling as ``sampling`` (each seeded by its id) run to the end."""
    loop, scheduler = engine.loop, engine.scheduler
    batch_rids = [next(rids) for _ in range(batch)]
    # NOTE: fresh prompts every run (seeded by the first rid): the prefix cache would serve
    # most of a repeated prompt's prefill, and a longer prompt drawn from the same seed starts
    # with a shorter one.
    prompts = random_prompts(batch, input_len, engine.facts.vocab_size, seed=batch_rids[0])
    _synchronize(engine)
    started = time.perf_counter()
    for rid, prompt in zip(batch_rids, prompts, strict=True):
        seeded = msgspec.structs.replace(sampling, seed=rid)
        scheduler.add(benchmark_request(rid, prompt, output_len, seeded))
    # Prefill: until every request has been extended (its first token is sampled there).
    finals = []
    while scheduler.waiting or any(not r.decoding for r in scheduler.running):
        finals += [u for u in loop.iterate() if u.is_final]
    _synchronize(engine)
    prefill_ms = elapsed_ms(started)
    timer.take()
    started = time.perf_counter()
    while loop.has_work:
        finals += [u for u in loop.iterate() if u.is_final]
    _synchronize(engine)
    decode_ms = elapsed_ms(started)
    assert len(finals) == batch, "every request ends once"
    for update in finals:
        # A failed step ends its requests early: nothing was measured.
        if update.finish is None or update.finish.reason != "length":
            raise RuntimeError(f"a benchmark request ended with {update.error or update.finish}")
    return TimedRun(prefill_ms, decode_ms, timer.take())


def _profile(engine: Engine, batch: int, run: Callable[[], object]) -> None:
    """``run`` under the profiler; its top operations by host time to stderr, and on a GPU
    by device time as well (an eager prompt step may be bound by either)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    sorts = {"host": "self_cpu_time_total"}
    if engine.config.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        sorts["device"] = "self_cuda_time_total"
    with torch.profiler.profile(activities=activities) as prof:
        run()
    operations = prof.key_averages()
    for by, sort in sorts.items():
        print(f"profile of batch {batch} (prefill and decode) by {by} time:", file=sys.stderr)
        print(operations.table(sort_by=sort, row_limit=20), file=sys.stderr)


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


def benchmark_request(
    rid: int, prompt: list[int], max_new_tokens: int | None, sampling: SamplingSpec = GREEDY
) -> TokenizedRequest:
    """A request that ignores EOS (None: until the context limit), greedy unless
    ``sampling`` says otherwise."""
    return own_request(rid, f"bench-{rid}", prompt, max_new_tokens, sampling)


def _synchronize(engine: Engine) -> None:
    if engine.config.device == "cuda":
        torch.cuda.synchronize()


def elapsed_ms(since: float) -> float:
    return (time.perf_counter() - since) * 1e3
