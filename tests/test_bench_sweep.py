"""``outrider bench sweep``: the matrix, resuming, the budget, failures and the report, with a
fake ``bench latency`` runner (the real one needs a GPU), and one real process on CPU."""

from __future__ import annotations

import itertools
import json
import shlex
from pathlib import Path

import msgspec
import pytest

from outrider.daemon.bench.latency_io import LatencyRow
from outrider.daemon.bench.sweep import (
    LATENCY_COMMAND,
    MATRIX,
    BackendSet,
    CellResult,
    Finished,
    SweepConfig,
    SweepOptions,
    read_results,
    run_process,
    run_sweep,
    select,
)
from outrider.daemon.bench.sweep_report import format_report, list_cells
from outrider.daemon.cli.main import main

CONFIGS = "tests/fixtures/configs"
TARGET = ["--load-format", "dummy", "--dtype", "bfloat16", "--device", "cuda"]
SHAPE = ["--batch-size", "1", "32", "--input-len", "1024", "8192", "--output-len", "64"]


def values(flags: list[str], flag: str) -> list[int]:
    """The integers after ``flag`` up to the next flag."""
    rest = flags[flags.index(flag) + 1 :]
    return [int(v) for v in itertools.takewhile(lambda v: not v.startswith("--"), rest)]


def row(batch: int, context: int, step_ms: float, runs: int = 5) -> LatencyRow:
    return LatencyRow(
        batch=batch, input_len=context, output_len=64, prefill_ms=1.0, decode_steps=63,
        step_ms=step_ms, decode_tok_s=batch * 1e3 / step_ms, tokens_per_step=1.0,
        roofline_tok_s=1e3, percent_of_roofline=10.0, draft_ms=0.0, verify_ms=step_ms,
        catch_up_ms=0.0, graph_ms=0.0, runs=runs, step_ms_min=step_ms, step_ms_max=step_ms,
    )  # fmt: skip


class FakeLatency:
    """Prints what ``bench latency --json`` would, a step of ``step_ms`` for every row; the
    models named in ``fail`` exit 1."""

    def __init__(self, step_ms: float = 10.0, fail: tuple[str, ...] = ()) -> None:
        self.step_ms = step_ms
        self.fail = fail
        self.calls: list[list[str]] = []

    def __call__(self, flags: list[str], timeout_s: float) -> Finished:
        self.calls.append(flags)
        if any(f"--attention-backend {name}" in " ".join(flags) for name in self.fail):
            return Finished(1, "", "loading...\nRuntimeError: CUDA out of memory\n")
        rows = [
            row(batch, context, self.step_ms)
            for batch in values(flags, "--batch-size")
            for context in values(flags, "--input-len")
        ]
        facts = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0"}
        lines = [json.dumps(facts), *(json.dumps(r.__dict__) for r in rows)]
        return Finished(0, "\n".join(lines) + "\n", "")


def configs_named(*names: str) -> list[SweepConfig]:
    return [c for c in MATRIX if c.name in names]


def test_the_matrix_has_80_cells_with_the_exact_flags() -> None:
    cells = [cell for config in MATRIX for cell in config.cells()]
    assert len(cells) == len(set(cells)) == 80
    names = ["fa4/none", "fa4/eagle3-chain", "fa4/eagle3-tree", "fa4/none-qwen3", "fa4/dflash"]
    assert [c.name for c in MATRIX[:5]] == names
    flags = {c.name: c.latency_args(CONFIGS, 5, [1, 32], [1024, 8192]) for c in MATRIX}
    llama = ["--model", f"{CONFIGS}/Llama-3.1-8B-Instruct.config.json"]
    eagle3 = [
        "--draft-model", f"{CONFIGS}/Llama-3.1-8B-EAGLE3.config.json",
        "--speculative-algorithm", "eagle3",
    ]  # fmt: skip
    end = [*TARGET, *SHAPE, "--runs", "5", "--json"]
    assert flags["fa4/none"] == [*llama, "--attention-backend", "fa4", *end]
    qwen3 = ["--model", f"{CONFIGS}/Qwen3-8B.config.json"]
    assert flags["triton/none-qwen3"] == [*qwen3, "--attention-backend", "triton", *end]
    assert flags["flashinfer/eagle3-chain"] == [
        *llama, *eagle3, "--speculative-num-steps", "3", "--speculative-simulate-acceptance", "3",
        "--attention-backend", "flashinfer", *end,
    ]  # fmt: skip
    assert flags["triton/eagle3-tree"] == [
        *llama, *eagle3, "--speculative-num-steps", "5", "--speculative-topk", "4",
        "--speculative-num-draft-tokens", "8", "--speculative-simulate-acceptance", "3",
        "--attention-backend", "triton", *end,
    ]  # fmt: skip
    assert flags["mix/dflash"] == [
        "--model", f"{CONFIGS}/Qwen3-8B.config.json",
        "--draft-model", f"{CONFIGS}/Qwen3-8B-DFlash-b16.config.json",
        "--speculative-algorithm", "dflash", "--speculative-simulate-acceptance", "6.4",
        "--prefill-attention-backend", "fa4", "--decode-attention-backend", "auto",
        "--verify-attention-backend", "auto", "--draft-attention-backend", "auto", *end,
    ]  # fmt: skip
    for config in MATRIX:  # the models exist where the sweep runs (the repository root)
        for flag in ("--model", "--draft-model"):
            if flag in flags[config.name]:
                path = flags[config.name][flags[config.name].index(flag) + 1]
                assert (Path(__file__).parent.parent / path).is_file(), path


def test_only_keeps_the_named_sets_of_each_dimension() -> None:
    assert [c.name for c in select(["mix", "fa4", "dflash"])] == ["fa4/dflash", "mix/dflash"]
    assert len(select(["triton"])) == 5 and len(select([])) == 20
    with pytest.raises(ValueError, match=r"--only fa3: backend sets are fa4, flashinfer"):
        select(["fa3"])


def test_refused_configurations_are_recorded_not_run(tmp_path: Path) -> None:
    """A configuration the capability checks refuse (here fa4 over pages it does not take)
    gets their refusal in each of its cells and no process starts for it (never another
    backend in its place)."""
    results = tmp_path / "sweep.jsonl"
    runner = FakeLatency()
    [plain] = configs_named("flashinfer/none")
    big_pages = BackendSet("fa4", ("--attention-backend", "fa4", "--page-size", "256"), True)
    refused = SweepConfig(big_pages, plain.algorithm)
    outcome = run_sweep([plain, refused], results, SweepOptions(), runner=runner)
    assert (outcome.ran, outcome.refused) == (["flashinfer/none"], ["fa4/none"])
    assert len(runner.calls) == 1 and "Llama-3.1-8B-Instruct" in runner.calls[0][1]
    lines = read_results(results)
    statuses = [(r.backends, r.status) for r in lines]
    assert statuses == [("flashinfer", "ok")] * 4 + [("fa4", "refused")] * 4
    assert lines[4].reason == [
        "--page-size: fa4 takes page sizes 1, 2, 4, 8, 16, 32, 64, 128, not 256"
    ]
    ok = lines[0]
    assert (ok.batch, ok.context, ok.device) == (1, 1024, "NVIDIA H100 80GB HBM3")
    assert ok.row == row(1, 1024, 10.0)
    assert ok.command.startswith("python -m outrider.daemon.cli bench latency --model ")
    assert ok.versions["outrider"]


def test_done_cells_are_skipped_and_missing_ones_run(tmp_path: Path) -> None:
    results = tmp_path / "sweep.jsonl"
    matrix = configs_named("triton/none", "triton/eagle3-chain")
    first = FakeLatency()
    run_sweep(matrix[:1], results, SweepOptions(runs=3), runner=first)
    assert [values(flags, "--runs") for flags in first.calls] == [[3]]
    # Two cells of the first configuration are missing: only they are measured again.
    lines = results.read_text().splitlines()
    results.write_text("\n".join(lines[:-2]) + "\n")
    second = FakeLatency()
    outcome = run_sweep(matrix, results, SweepOptions(), runner=second)
    assert outcome.ran == ["triton/none", "triton/eagle3-chain"]
    assert [(values(f, "--batch-size"), values(f, "--input-len")) for f in second.calls] == [
        ([32], [1024, 8192]),
        ([1, 32], [1024, 8192]),
    ]
    third = FakeLatency()
    outcome = run_sweep(matrix, results, SweepOptions(), runner=third)
    assert (third.calls, outcome.ran) == ([], [])
    assert len(read_results(results)) == 8
    # A cell recorded with other configuration flags (here: another decode backend) runs again.
    recorded = results.read_text().splitlines()
    changed = recorded[0].replace(" --attention-backend triton ", " --attention-backend fa4 ", 1)
    assert changed != recorded[0]
    results.write_text("\n".join([changed, *recorded[1:]]) + "\n")
    fourth = FakeLatency()
    outcome = run_sweep(matrix, results, SweepOptions(), runner=fourth)
    assert outcome.ran == ["triton/none"]
    assert [(values(f, "--batch-size"), values(f, "--input-len")) for f in fourth.calls] == [
        ([1], [1024])
    ]


def test_the_budget_stops_starting_configurations(tmp_path: Path) -> None:
    """Each configuration takes 100 s of the fake clock: past 150 s none starts, and the next
    run resumes where this one stopped."""
    results = tmp_path / "sweep.jsonl"
    now = [0.0]
    runner = FakeLatency()

    def slow(flags: list[str], timeout_s: float) -> Finished:
        now[0] += 100.0
        return runner(flags, timeout_s)

    matrix = select(["triton", "mix"])
    options = SweepOptions(budget_s=150.0)
    outcome = run_sweep(matrix, results, options, runner=slow, clock=lambda: now[0])
    assert outcome.ran == ["triton/none", "triton/eagle3-chain"]
    assert outcome.left == [c.name for c in matrix[2:]]
    now[0] = 0.0
    outcome = run_sweep(matrix, results, options, runner=slow, clock=lambda: now[0])
    assert outcome.ran == ["triton/eagle3-tree", "triton/none-qwen3"]
    assert len(read_results(results)) == 16


def test_a_failing_configuration_is_recorded_and_the_sweep_goes_on(tmp_path: Path) -> None:
    results = tmp_path / "sweep.jsonl"
    matrix = configs_named("fa4/none", "triton/none")
    outcome = run_sweep(matrix, results, SweepOptions(), runner=FakeLatency(fail=("fa4",)))
    assert (outcome.ran, outcome.failed_cells) == (["fa4/none", "triton/none"], 4)
    lines = read_results(results)
    assert [r.status for r in lines] == ["failed"] * 4 + ["ok"] * 4
    assert lines[0].reason == ["exit status 1", "loading...", "RuntimeError: CUDA out of memory"]
    # Failed cells count as done, unless retried; the retry appends, and its line wins.
    assert run_sweep(matrix, results, SweepOptions(), runner=FakeLatency()).ran == []
    retry = SweepOptions(retry_failed=True)
    assert run_sweep(matrix, results, retry, runner=FakeLatency()).ran == ["fa4/none"]
    assert list_cells(matrix, read_results(results)).endswith(
        "\n8 cells: 8 ok, 0 refused, 0 failed, 0 to run\n"
    )


def results_of(*lines: tuple[str, str, int, int, str, float | list[str]]) -> list[CellResult]:
    """Lines as the matrix's configurations record them (their commands)."""
    made = []
    for backends, algorithm, batch, context, status, what in lines:
        measured = isinstance(what, float)
        (config,) = configs_named(f"{backends}/{algorithm}")
        flags = ["python", *LATENCY_COMMAND, *config.latency_args(CONFIGS, 5, [batch], [context])]
        made.append(
            CellResult(
                backends=backends, algorithm=algorithm, batch=batch, context=context,
                status=status,  # type: ignore[arg-type]
                command=shlex.join(flags),
                device="NVIDIA H100 80GB HBM3" if measured else "",
                versions={"outrider": "0.1.0", "torch": "2.11.0"},
                row=row(batch, context, what) if isinstance(what, float) else None,
                reason=[] if isinstance(what, float) else what,
            )
        )  # fmt: skip
    return made


def test_the_report_table() -> None:
    refusal = ["--draft-attention-backend: flashinfer cannot run the draft_decode phase"]
    results = results_of(
        ("fa4", "none", 1, 1024, "ok", 10.0),
        ("flashinfer", "none", 1, 1024, "ok", 9.8),
        ("triton", "none", 1, 1024, "ok", 12.0),
        ("mix", "none", 1, 1024, "ok", 10.08),
        ("fa4", "none", 32, 8192, "failed", ["exit status 1", "x", "RuntimeError: out of memory"]),
        ("triton", "none", 32, 8192, "ok", 40.0),
        ("mix", "none", 32, 8192, "ok", 42.0),
        ("flashinfer", "dflash", 1, 1024, "refused", refusal),
        ("fa4", "dflash", 1, 1024, "failed", ["timed out"]),
        ("fa4", "dflash", 1, 1024, "ok", 20.0),  # a retry: the last line counts
    )
    assert format_report(results) == (
        "Wall time per decode step or speculative cycle (the median of 5 runs) and decode "
        "tok/s; bfloat16, dummy weights, a batch of prompts of the context's length, 64 new "
        "tokens each. mix: `--prefill-attention-backend fa4 --decode-attention-backend auto "
        "--verify-attention-backend auto --draft-attention-backend auto`.\n"
        "Mix within 3 %: its step time against the best single backend's.\n"
        "Device: NVIDIA H100 80GB HBM3; versions: outrider 0.1.0, torch 2.11.0.\n"
        "\n"
        "| algorithm | batch | context | fa4 | flashinfer | triton | mix | best single "
        "| mix within 3 % |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |\n"
        "| none | 1 | 1024 | 10.00 ms, 100.0 tok/s | 9.80 ms, 102.0 tok/s | 12.00 ms, 83.3 tok/s "
        "| 10.08 ms, 99.2 tok/s | flashinfer | yes, +2.9 % |\n"
        "| none | 32 | 8192 | failed (1) | not run | 40.00 ms, 800.0 tok/s "
        "| 42.00 ms, 761.9 tok/s | triton | no, +5.0 % |\n"
        "| dflash | 1 | 1024 | 20.00 ms, 50.0 tok/s | refused (2) | not run | not run | fa4 | — |\n"
        "\n"
        "Refused or failed:\n"
        "\n"
        "1. exit status 1: RuntimeError: out of memory\n"
        "2. --draft-attention-backend: flashinfer cannot run the draft_decode phase\n"
    )  # fmt: skip


def test_the_report_sets_each_cycle_against_its_targets_plain_step() -> None:
    """EAGLE-3 against Llama's plain row, DFlash against Qwen3's, cell by cell; a cycle whose
    plain step is missing shows a dash, and a pair without any ratio gets no row."""
    results = results_of(
        ("fa4", "none", 1, 1024, "ok", 10.0),
        ("triton", "none", 1, 1024, "ok", 8.0),
        ("fa4", "eagle3-chain", 1, 1024, "ok", 12.5),
        ("triton", "eagle3-chain", 1, 1024, "ok", 10.0),
        ("mix", "eagle3-chain", 1, 1024, "ok", 11.0),
        ("fa4", "none-qwen3", 1, 8192, "ok", 8.0),
        ("fa4", "dflash", 1, 8192, "ok", 11.0),
        ("fa4", "dflash", 32, 1024, "ok", 30.0),
    )
    assert format_report(results).split("\n\n")[2:4] == [
        "A speculative cycle against the plain step of its target (same backends):",
        "| algorithm | batch | context | fa4 | flashinfer | triton | mix |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n"
        "| eagle3-chain | 1 | 1024 | 1.25x | — | 1.25x | — |\n"
        "| dflash | 1 | 8192 | 1.38x | — | — | — |\n",
    ]


def test_a_line_of_a_changed_configuration_counts_as_not_run() -> None:
    """A mix cell recorded before the mix's flags changed shows as not run, in the report as
    in the list (the sweep measures it again)."""
    (fresh,) = results_of(("mix", "none", 1, 1024, "ok", 10.0))
    stale = msgspec.structs.replace(
        fresh,
        command=fresh.command.replace(
            "--verify-attention-backend auto", "--verify-attention-backend fa4"
        ),
    )
    assert stale.command != fresh.command
    table = [line for line in format_report([stale]).splitlines() if line.startswith("| none")]
    assert table == []
    assert "| none | 1 | 1024 | not run | not run | not run | 10.00 ms, 100.0 tok/s |" in (
        format_report([stale, fresh])
    )
    listed = list_cells(configs_named("mix/none"), [stale]).splitlines()
    assert listed[0] == "to run   mix/none batch 1 context 1024"


def test_the_command_lists_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "sweep.jsonl"
    run_sweep(configs_named("triton/none"), results, SweepOptions(), runner=FakeLatency())
    assert main(["bench", "sweep", "--results", str(results), "--list", "--only", "none"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0] == "to run   fa4/none batch 1 context 1024"
    assert listed[8] == "ok       triton/none batch 1 context 1024  10.00 ms"
    assert listed[-1] == "16 cells: 4 ok, 0 refused, 0 failed, 12 to run"
    assert main(["bench", "sweep", "--report", str(results)]) == 0
    report = capsys.readouterr().out.splitlines()
    assert report[-1] == (
        "| none | 32 | 8192 | not run | not run | 10.00 ms, 3,200.0 tok/s | not run | triton | — |"
    )
    assert len(report) == 3 + 1 + 2 + 4  # the preamble, a blank line, the head, four rows
    assert main(["bench", "sweep", "--only", "fa3", "--results", str(results)]) == 2
    assert capsys.readouterr().err.startswith("outrider bench sweep: --only fa3: backend sets")


def test_a_real_process_prints_what_the_sweep_reads(llama_dir: str) -> None:
    """The protocol between the sweep and ``bench latency``: its facts line and rows."""
    flags = ["--model", llama_dir, "--batch-size", "2", "--input-len", "8", "12"]
    finished = run_process([*flags, "--output-len", "3", "--runs", "2", "--json"], 120.0)
    assert finished.returncode == 0, finished.stderr
    facts, *rows = finished.stdout.splitlines()
    assert json.loads(facts)["device"]
    decoded = [LatencyRow(**json.loads(line)) for line in rows]
    assert [(r.batch, r.input_len, r.runs) for r in decoded] == [(2, 8, 2), (2, 12, 2)]
