"""The progress count of ``bench serve`` and ``bench sweep``: drawn on a TTY only, notes above
it, and each benchmark counting its own work (a fake backend and a fake latency runner)."""

from __future__ import annotations

import argparse
import asyncio
import io
import math
import time
from pathlib import Path

import pytest
from test_bench_sweep import FakeLatency, configs_named

from outrider.daemon.bench.progress import CLEAR, Progress
from outrider.daemon.bench.serve import run_benchmark
from outrider.daemon.bench.serve_data import BenchRequest
from outrider.daemon.bench.serve_report import Outcome
from outrider.daemon.bench.sweep import SweepOptions, run_sweep


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_count_is_drawn_on_a_tty_with_notes_above_it() -> None:
    tty = Terminal()
    progress = Progress("requests", 3, tty)
    progress.advance()
    progress.note("a line of the benchmark")
    progress.advance(2)
    progress.close()
    text = tty.getvalue()
    assert text.startswith(f"{CLEAR}requests: 0/3")
    assert f"{CLEAR}a line of the benchmark\n{CLEAR}requests: 1/3" in text
    assert text.endswith(f"{CLEAR}requests: 3/3\n")


def test_nothing_but_the_notes_off_a_tty() -> None:
    pipe = io.StringIO()
    progress = Progress("requests", 2, pipe)
    progress.advance()
    progress.note("a line of the benchmark")
    progress.advance()
    progress.close()
    assert pipe.getvalue() == "a line of the benchmark\n"


class FakeBackend:
    def __init__(self) -> None:
        self.calls: list[float] = []  # the Unix time of each request

    async def run(self, req: BenchRequest) -> Outcome:
        self.calls.append(time.time())
        await asyncio.sleep(0)
        return Outcome(req.prompt_len, req.output_len, success=True)


def test_bench_serve_counts_the_timed_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    tty = Terminal()
    monkeypatch.setattr("sys.stderr", tty)
    requests = [BenchRequest(None, [1, 2], 2, 4)] * 5
    args = argparse.Namespace(max_concurrency=2, request_rate=math.inf, seed=0)
    backend = FakeBackend()  # a stand-in with the one method run_benchmark calls
    outcomes, _, started_at = asyncio.run(run_benchmark(backend, requests, args))  # type: ignore[arg-type]
    assert len(outcomes) == 5 and len(backend.calls) == 6
    # The timed run starts after the untimed first request, before the first timed one.
    assert backend.calls[0] <= started_at <= backend.calls[1]
    assert tty.getvalue().endswith(f"{CLEAR}requests: 5/5\n")


def test_bench_sweep_counts_the_cells(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tty = Terminal()
    monkeypatch.setattr("sys.stderr", tty)
    matrix = configs_named("triton/none", "fa4/none")
    run_sweep(matrix, tmp_path / "results.jsonl", SweepOptions(), runner=FakeLatency())
    total = sum(len(c.cells()) for c in matrix)
    text = tty.getvalue()
    assert text.endswith(f"{CLEAR}bench sweep: cells: {total}/{total}\n")
    assert f"{CLEAR}bench sweep: triton/none: " in text
