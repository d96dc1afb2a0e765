"""The measurement behind ``outrider bench latency`` (bench_cmd.py): needs the daemon extra."""

from __future__ import annotations

import functools
import itertools
import platform
import random
import sys
import time
from collections.abc import Callable, Iterator

import torch

from outrider.daemon.bench_cmd import LatencyRow
from outrider.daemon.config import ServeConfig
from outrider.daemon.engine.build import Engine, build_engine
from outrider.daemon.engine.timing import PhaseTimer, PhaseTimes
from outrider.daemon.internal import TokenizedRequest, own_request
from outrider.daemon.rank_processes import start_leader, stop_leader
from outrider.daemon.roofline import kv_bytes_per_token, read_bandwidth, weight_bytes


def measure_latency(
    config: ServeConfig,
    batch_sizes: list[int],
    input_len: int,
    output_len: int,
    *,
    profile: bool = False,
) -> tuple[list[LatencyRow], dict[str, object]]:
    """One row per batch size, and the facts every row shares (device, versions, bandwidth);
    with ``profile``, each batch size's top operations by device time go to stderr."""
    ranks, tp = start_leader(config)
    try:
        engine = build_engine(config, tp=tp)
        measured = _measure(engine, config, batch_sizes, input_len, output_len, profile)
    except BaseException:
        if ranks is not None:
            ranks.stop()  # kills them: they may wait in a step that never completes
        raise
    stop_leader(engine, ranks)
    return measured


def _measure(
    engine: Engine,
    config: ServeConfig,
    batch_sizes: list[int],
    input_len: int,
    output_len: int,
    profile: bool,
) -> tuple[list[LatencyRow], dict[str, object]]:
    timer = engine.loop.runner.enable_phase_timing()
    dtype = str(engine.facts.configuration["dtype"])
    bandwidth = read_bandwidth(config.device)
    weights = weight_bytes(engine.model_config, dtype)
    kv_per_token = kv_bytes_per_token(engine.model_config, dtype)
    rows = []
    rids = itertools.count()
    for batch in batch_sizes:
        # Untimed first: allocator growth, and the CUDA graphs of every batch and KV bound
        # the timed run will meet.
        _run(engine, timer, rids, batch, input_len, output_len)
        prefill_ms, decode_ms, phases = _run(engine, timer, rids, batch, input_len, output_len)
        if profile:
            run = functools.partial(_run, engine, timer, rids, batch, input_len, output_len)
            _profile(engine, batch, run)
        steps = max(phases.steps, 1)
        tokens = batch * (output_len - 1)
        mean_context = input_len + output_len / 2
        # Under tensor parallelism every rank reads its share at the same time.
        ranks_bandwidth = bandwidth * config.tensor_parallel_size
        roofline = batch * ranks_bandwidth / (weights + batch * mean_context * kv_per_token)
        decode_tok_s = tokens / (decode_ms / 1e3)
        rows.append(
            LatencyRow(
                batch=batch,
                input_len=input_len,
                output_len=output_len,
                prefill_ms=prefill_ms,
                decode_steps=phases.steps,
                step_ms=decode_ms / steps,
                decode_tok_s=decode_tok_s,
                tokens_per_step=(output_len - 1) / steps,
                roofline_tok_s=roofline,
                percent_of_roofline=100 * decode_tok_s / roofline,
                draft_ms=phases.draft_ms / steps,
                verify_ms=phases.verify_ms / steps,
                catch_up_ms=phases.catch_up_ms / steps,
                graph_ms=phases.graph_ms / steps,
            )
        )
    device = torch.cuda.get_device_name() if config.device == "cuda" else platform.processor()
    facts: dict[str, object] = {
        "device": device or platform.machine(),
        "torch": torch.__version__,
        "model": config.model,
        "dtype": dtype,
        "speculative": config.speculative_algorithm,
        "tensor_parallel_size": config.tensor_parallel_size,
        "width": engine.loop.runner.shape.width,
        "read_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "weight_gb": round(weights / 1e9, 3),
    }
    return rows, facts


def _run(
    engine: Engine,
    timer: PhaseTimer,
    rids: Iterator[int],
    batch: int,
    input_len: int,
    output_len: int,
) -> tuple[float, float, PhaseTimes]:
    """(prefill ms, decode ms, decode phases) of ``batch`` greedy requests run to the end."""
    loop, scheduler = engine.loop, engine.scheduler
    prompts = random_prompts(batch, input_len, engine.facts.vocab_size, seed=batch)
    _synchronize(engine)
    started = time.perf_counter()
    for prompt in prompts:
        scheduler.add(benchmark_request(next(rids), prompt, output_len))
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
    return prefill_ms, decode_ms, timer.take()


def _profile(engine: Engine, batch: int, run: Callable[[], object]) -> None:
    """``run`` under the profiler; its top operations by device time to stderr."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if engine.config.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        run()
    sort = "self_cuda_time_total" if engine.config.device == "cuda" else "self_cpu_time_total"
    print(f"profile of batch {batch} (prefill and decode):", file=sys.stderr)
    print(prof.key_averages().table(sort_by=sort, row_limit=20), file=sys.stderr)


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


def benchmark_request(rid: int, prompt: list[int], max_new_tokens: int | None) -> TokenizedRequest:
    """A greedy request that ignores EOS (None: until the context limit)."""
    return own_request(rid, f"bench-{rid}", prompt, max_new_tokens)


def _synchronize(engine: Engine) -> None:
    if engine.config.device == "cuda":
        torch.cuda.synchronize()


def elapsed_ms(since: float) -> float:
    return (time.perf_counter() - since) * 1e3
