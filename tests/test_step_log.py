"""The step log (``--step-log``, scheduler/step_log.py) of an in-process engine: a line per
loop turn, in order, each launched step's plan as launched, timings that add up, wall times
on the Unix clock; and its summary by kind of step (daemon/bench/step_summary.py)."""

from __future__ import annotations

import io
import json
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from engine_harness import engine_for, record_launches, request, run
from model_fixtures import VOCAB

from outrider.daemon.bench.step_summary import Turns, describe, summarize
from outrider.daemon.scheduler.step_log import StepLog


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_a_line_per_turn_with_its_step_as_launched(
    llama_dir: str, tmp_path: Path, overlap: bool
) -> None:
    path = tmp_path / "steps.jsonl"
    path.write_text("earlier\n")  # the log appends
    engine = engine_for(
        llama_dir, step_log=str(path), mixed_batches=True, chunked_prefill_tokens=24,
        page_size=4, max_running=3, no_overlap=not overlap,
    )  # fmt: skip
    loop = engine.loop
    launched = record_launches(loop.runner)
    turns = 0
    iterate = loop.iterate

    def counted() -> object:
        nonlocal turns
        turns += 1
        return iterate()

    loop.iterate = counted  # type: ignore[method-assign]
    prompts = [[3 + (5 * i + j) % (VOCAB - 3) for j in range(10 + 7 * i)] for i in range(6)]
    samplings = [{}, {"temperature": 0.8}, {"temperature": 0.8, "top_p": 0.9}]
    requests = [
        request(i, p, max_new_tokens=8, seed=i, **samplings[i % 3])  # type: ignore[arg-type]
        for i, p in enumerate(prompts)
    ]
    began = time.time()
    run(engine, requests, stagger=2)
    loop.close()
    ended = time.time()
    first, *lines = path.read_text().splitlines()
    assert first == "earlier" and len(lines) == turns
    entries = [json.loads(line) for line in lines]
    steps = [e for e in entries if "kind" in e]
    kinds = {(True, True): "greedy", (True, False): "greedy", (False, True): "cut"}
    assert [
        (s["kind"], s["rows"], s["tokens"], s["width"], s["riders"], s["unfed"], s["sampling"])
        for s in steps
    ] == [
        (
            p.kind, p.bs, p.num_tokens, p.q_lens[0] if p.kind == "decode" else 0,
            len(p.relay_rows), len(p.unfed), kinds.get((p.all_greedy, p.cuts), "sampled"),
        )
        for p in launched
    ]  # fmt: skip
    assert {s["sampling"] for s in steps} == {"greedy", "sampled", "cut"}
    assert any(s["riders"] for s in steps) and any(s["kind"] == "decode" for s in steps)
    # Under overlap the last turn only processes the step before it: no step of its own.
    assert (len(steps) < len(entries)) == overlap
    times = [e["t"] for e in entries]
    assert times == sorted(times)
    assert all(began - 1.0 <= e["at"] <= ended for e in entries)  # opened before the run
    assert max(e["at"] - e["t"] for e in entries) - min(e["at"] - e["t"] for e in entries) < 1e-5
    # The summary: every launched step counted under its kind, its turns' time and rows.
    kinds = summarize(entries)
    named = Counter(
        "mixed" if p.relay_rows else "prompt" if p.kind == "extend" else f"decode {p.q_lens[0]}"
        for p in launched
    )
    assert {name: turns.turns for name, turns in kinds.items()} == named
    assert sum(t.rows for t in kinds.values()) == sum(p.bs for p in launched)
    assert sum(t.ms for t in kinds.values()) == pytest.approx(sum(s["turn_ms"] for s in steps))
    half = len(steps) // 2
    before = summarize(entries, until=steps[half]["at"])
    after = summarize(entries, since=steps[half + 1]["at"])
    assert sum(t.turns for t in before.values()) == half + 1
    assert sum(t.turns for t in after.values()) == len(steps) - half - 1
    for e in entries:
        assert 0 <= e["plan_ms"] <= e["turn_ms"] and 0 <= e["wait_ms"] <= e["turn_ms"], e
    assert all(s["waiting"] >= 0 for s in steps) and any(s["waiting"] for s in steps)


def test_a_turn_with_allocator_calls_counts_them() -> None:
    """Where the log counts the allocator's calls to the driver, a turn that made some says
    how many since the turn before (the first: since the log opened); the others say nothing."""
    counts = iter([5, 5, 7, 7, 8])
    out = io.StringIO()
    log = StepLog(out, lambda: next(counts))
    for turn in range(4):
        log.turn(float(turn), float(turn), float(turn) + 0.5, 0.0, None, 0)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line.get("allocator_calls") for line in lines] == [None, 2, None, 1]
    uncounted = io.StringIO()
    StepLog(uncounted).turn(0.0, 0.0, 0.5, 0.0, None, 0)
    assert "allocator_calls" not in json.loads(uncounted.getvalue())


@pytest.mark.gpu
def test_a_cuda_turn_whose_allocator_maps_memory_says_so(llama_dir: str, tmp_path: Path) -> None:
    """With the allocator's cache emptied, the prompt batch's buffers are mapped anew: the
    log counts those calls (the statistics it reads exist in this torch)."""
    path = tmp_path / "steps.jsonl"
    engine = engine_for(llama_dir, step_log=str(path), device="cuda", dtype="float32")
    torch.cuda.empty_cache()
    run(engine, [request(0, [3 + j % (VOCAB - 3) for j in range(40)], max_new_tokens=4)])
    engine.loop.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert sum(line.get("allocator_calls", 0) for line in lines) > 0


def test_the_summary_orders_kinds_and_describes_each_per_turn() -> None:
    """Prompt batches, mixed ones, then decode steps by width; a turn's mean time, time
    waited and rows, its unfed rows and the allocator's calls in all (where some are)."""

    def line(at: float, ms: float, kind: str, rows: int, **more: int) -> dict[str, object]:
        return {"at": at, "turn_ms": ms, "wait_ms": ms / 2, "kind": kind, "rows": rows,
                "unfed": 0} | more  # fmt: skip

    lines = [
        line(1.0, 9.0, "decode", 8, width=10),
        line(2.0, 5.0, "decode", 4, width=1, unfed=4, allocator_calls=2),
        {"at": 3.0, "turn_ms": 1.0, "wait_ms": 0.5},  # launched nothing
        line(4.0, 40.0, "extend", 3, riders=2),
        line(5.0, 30.0, "extend", 2, riders=0, allocator_calls=1),
        line(6.0, 7.0, "decode", 6, width=1),
    ]
    kinds = summarize(lines)
    assert list(kinds) == ["prompt", "mixed", "decode 1", "decode 10"]
    assert kinds["decode 1"] == Turns(
        turns=2, ms=12.0, waited_ms=6.0, rows=10, unfed=4, allocator_calls=2
    )
    assert describe(kinds) == (
        "prompt 1 x 30.0 ms, waited 15.0 (2.0 rows, allocator calls 1); "
        "mixed 1 x 40.0 ms, waited 20.0 (3.0 rows); "
        "decode 1 2 x 6.0 ms, waited 3.0 (5.0 rows, 2.0 unfed, allocator calls 2); "
        "decode 10 1 x 9.0 ms, waited 4.5 (8.0 rows)"
    )
    assert list(summarize(lines, since=2.0, until=4.0)) == ["mixed", "decode 1"]
