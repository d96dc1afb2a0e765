"""``outrider bench sweep``: the attention backend x speculative algorithm matrix of
``outrider bench latency`` runs, resumable, filled in over several invocations.

A configuration (a backend set with an algorithm) is one engine build: one ``bench latency``
process runs every batch size and context of it still to measure. Each cell (configuration,
batch, context) becomes one line of the results file (JSONL): measured, refused by the
capability checks before running (a backend set is never replaced by another), or failed
(with the end of the process's stderr). Cells already in the file are skipped.

    outrider bench sweep --results sweep.jsonl --budget-s 480     # one slice; repeat
    outrider bench sweep --results sweep.jsonl --list
    outrider bench sweep --report sweep.jsonl

Run from the repository root: the models are the public config.json files of
``tests/fixtures/configs`` (``--configs``), with dummy weights. On a TTY, stderr counts the
cells done (bench/progress.py).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

from outrider.daemon.bench.latency_io import LatencyRow, add_latency_arguments, resolve_latency
from outrider.daemon.bench.progress import Progress
from outrider.daemon.config import ConfigError
from outrider.plugins.api import PluginKind, Problem
from outrider.plugins.checks import ATTENTION_FLAG, SPECULATIVE_FLAG
from outrider.plugins.registry import PluginError, Registry, discover

# FA4's partner in the mix (FA4 has no split-KV on SM90: a few long rows under-fill the GPU):
# ``auto`` routes the decode, verify and draft batches of few rows to split-KV triton and the
# others to FA4 (BENCHMARKS.md, "Where FA4 overtakes split-KV decode"). Cells measured with
# another partner run again.
MIX_PARTNER = "auto"

LLAMA = "Llama-3.1-8B-Instruct.config.json"
LLAMA_EAGLE3 = "Llama-3.1-8B-EAGLE3.config.json"
QWEN3 = "Qwen3-8B.config.json"
QWEN3_DFLASH = "Qwen3-8B-DFlash-b16.config.json"

BATCH_SIZES = (1, 32)
CONTEXTS = (1024, 8192)  # the prompt's length; the new tokens decode after it
OUTPUT_LEN = 64
COMMON_FLAGS = ("--load-format", "dummy", "--dtype", "bfloat16", "--device", "cuda")
LATENCY_COMMAND = ("-m", "outrider.daemon.cli", "bench", "latency")
STDERR_LINES = 20  # kept of a failed process
WITHIN_PERCENT = 3.0  # the mix against the best single backend


@dataclass(frozen=True)
class BackendSet:
    """Attention backends per phase, as flags; ``single``: one backend for every phase."""

    name: str
    flags: tuple[str, ...]
    single: bool


@dataclass(frozen=True)
class Algorithm:
    """A target with its speculative algorithm (or none), models in the configs folder."""

    name: str
    model: str
    draft_model: str = ""
    # Dummy drafts never agree with a dummy target: a simulated acceptance gives each cycle
    # realistic commits (EAGLE-3 chains as BENCHMARKS.md's earlier rows, the tree at the same
    # rate so that its extra cost shows; DFlash-b16 on Qwen3-8B as issue 13 quotes).
    flags: tuple[str, ...] = ()
    plain: str = ""  # the algorithm that decodes the same target without speculation


BACKEND_SETS = (
    BackendSet("fa4", ("--attention-backend", "fa4"), single=True),
    BackendSet("flashinfer", ("--attention-backend", "flashinfer"), single=True),
    BackendSet("triton", ("--attention-backend", "triton"), single=True),
    BackendSet(
        "mix",
        (
            "--prefill-attention-backend", "fa4",
            "--decode-attention-backend", MIX_PARTNER,
            "--verify-attention-backend", MIX_PARTNER,
            "--draft-attention-backend", MIX_PARTNER,
        ),
        single=False,
    ),
)  # fmt: skip
ALGORITHMS = (
    Algorithm("none", LLAMA),
    Algorithm(
        "eagle3-chain",
        LLAMA,
        LLAMA_EAGLE3,
        ("--speculative-algorithm", "eagle3", "--speculative-num-steps", "3",
         "--speculative-simulate-acceptance", "3"),
        plain="none",
    ),
    Algorithm(
        "eagle3-tree",
        LLAMA,
        LLAMA_EAGLE3,
        ("--speculative-algorithm", "eagle3", "--speculative-num-steps", "5",
         "--speculative-topk", "4", "--speculative-num-draft-tokens", "8",
         "--speculative-simulate-acceptance", "3"),
        plain="none",
    ),
    Algorithm("none-qwen3", QWEN3),  # DFlash's target decoding alone: its cycle's yardstick
    Algorithm(
        "dflash",
        QWEN3,
        QWEN3_DFLASH,
        ("--speculative-algorithm", "dflash", "--speculative-simulate-acceptance", "6.4"),
        plain="none-qwen3",
    ),
)  # fmt: skip


@dataclass(frozen=True)
class Cell:
    backends: str
    algorithm: str
    batch: int
    context: int

    def __str__(self) -> str:
        return f"{self.backends}/{self.algorithm} batch {self.batch} context {self.context}"


@dataclass(frozen=True)
class SweepConfig:
    """One engine build: a backend set with an algorithm."""

    backends: BackendSet
    algorithm: Algorithm

    @property
    def name(self) -> str:
        return f"{self.backends.name}/{self.algorithm.name}"

    def cells(self) -> list[Cell]:
        b, a = self.backends.name, self.algorithm.name
        return [Cell(b, a, n, c) for n, c in itertools.product(BATCH_SIZES, CONTEXTS)]

    def config_flags(self, configs: str) -> list[str]:
        """The ``bench latency`` flags that make this configuration (the engine it builds)."""
        algorithm = self.algorithm
        draft = ["--draft-model", os.path.join(configs, algorithm.draft_model)]
        return [
            "--model", os.path.join(configs, algorithm.model),
            *(draft if algorithm.draft_model else []),
            *algorithm.flags,
            *self.backends.flags,
            *COMMON_FLAGS,
        ]  # fmt: skip

    def latency_args(
        self, configs: str, runs: int, batches: Sequence[int], contexts: Sequence[int]
    ) -> list[str]:
        """The ``bench latency`` flags measuring ``batches`` x ``contexts``."""
        return [
            *self.config_flags(configs),
            "--batch-size", *map(str, batches),
            "--input-len", *map(str, contexts),
            "--output-len", str(OUTPUT_LEN),
            "--runs", str(runs),
            "--json",
        ]  # fmt: skip


MATRIX = tuple(SweepConfig(b, a) for b in BACKEND_SETS for a in ALGORITHMS)


class CellResult(msgspec.Struct, frozen=True, kw_only=True):
    """One line of the results file."""

    backends: str
    algorithm: str
    batch: int
    context: int
    status: Literal["ok", "refused", "failed"]
    command: str  # run from the repository root
    device: str = ""
    versions: dict[str, str] = {}
    row: LatencyRow | None = None  # status ok
    # refused: the checks' problems; failed: the exit status and the end of stderr.
    reason: list[str] = []

    @property
    def cell(self) -> Cell:
        return Cell(self.backends, self.algorithm, self.batch, self.context)


@dataclass(frozen=True)
class Finished:
    """A ``bench latency`` process that ended (``returncode`` None: stopped at its timeout)."""

    returncode: int | None
    stdout: str
    stderr: str


Runner = Callable[[list[str], float], Finished]  # (bench latency flags, timeout s or 0)


@dataclass(frozen=True)
class SweepOptions:
    runs: int = 5
    configs: str = "tests/fixtures/configs"
    budget_s: float = 0.0  # 0: no limit
    timeout_s: float = 0.0  # per configuration; 0: no limit
    retry_failed: bool = False


@dataclass
class SweepOutcome:
    """What one invocation did, configurations by name."""

    ran: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)  # not started: past the budget
    failed_cells: int = 0


def current(results: Iterable[CellResult], configs: str) -> dict[Cell, CellResult]:
    """Each cell's last line recorded by the matrix's configuration of its name: a line of a
    configuration whose flags changed since (e.g. the mix's partner) counts as not measured."""
    prefixes = {
        config.name: shlex.join(["python", *LATENCY_COMMAND, *config.config_flags(configs)]) + " "
        for config in MATRIX
    }
    kept: dict[Cell, CellResult] = {}
    for result in results:
        prefix = prefixes.get(f"{result.backends}/{result.algorithm}")
        if prefix is not None and result.command.startswith(prefix):
            kept[result.cell] = result
    return kept


def select(only: Sequence[str], matrix: Sequence[SweepConfig] = MATRIX) -> list[SweepConfig]:
    """The configurations ``only`` names: any of its backend sets with any of its algorithms
    (a dimension it does not name: all); raises ValueError for an unknown name."""
    backend_names = [b.name for b in BACKEND_SETS]
    algorithm_names = [a.name for a in ALGORITHMS]
    unknown = [name for name in only if name not in backend_names + algorithm_names]
    if unknown:
        raise ValueError(
            f"--only {' '.join(unknown)}: backend sets are {', '.join(backend_names)}; "
            f"algorithms are {', '.join(algorithm_names)}"
        )
    backends = [n for n in only if n in backend_names] or backend_names
    algorithms = [n for n in only if n in algorithm_names] or algorithm_names
    return [c for c in matrix if c.backends.name in backends and c.algorithm.name in algorithms]


def run_sweep(
    matrix: Sequence[SweepConfig],
    results: Path,
    options: SweepOptions,
    *,
    runner: Runner | None = None,
    registry: Registry | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> SweepOutcome:
    """Measure every cell of ``matrix`` not yet in ``results``, a configuration at a time,
    appending its lines as each ends; past ``options.budget_s`` no configuration starts."""
    runner = runner or run_process
    registry = registry or discover()
    done = current(read_results(results), options.configs) if results.exists() else {}
    versions = installed_versions()
    started = clock()
    outcome = SweepOutcome()
    pending_cells = {
        config.name: [
            c
            for c in config.cells()
            if c not in done or (options.retry_failed and done[c].status == "failed")
        ]
        for config in matrix
    }
    progress = Progress("bench sweep: cells", sum(map(len, pending_cells.values())))
    for config in matrix:
        pending = pending_cells[config.name]
        if not pending:
            continue
        batches = sorted({c.batch for c in pending})
        contexts = sorted({c.context for c in pending})
        flags = config.latency_args(options.configs, options.runs, batches, contexts)
        command = shlex.join(["python", *LATENCY_COMMAND, *flags])
        problems = refusal(flags, registry)
        if problems:
            lines = [_result(c, "refused", command, versions, reason=problems) for c in pending]
            _append(results, lines)
            outcome.refused.append(config.name)
            progress.advance(len(pending))
            continue
        if options.budget_s and clock() - started >= options.budget_s:
            outcome.left.append(config.name)
            progress.advance(len(pending))
            continue
        progress.note(f"bench sweep: {config.name}: {command}")
        began = clock()
        lines = _measured(pending, command, versions, runner(flags, options.timeout_s))
        _append(results, lines)
        outcome.ran.append(config.name)
        failed = sum(line.status == "failed" for line in lines)
        outcome.failed_cells += failed
        progress.advance(len(pending))
        progress.note(
            f"bench sweep: {config.name}: {len(lines) - failed} cells measured, {failed} failed "
            f"in {clock() - began:.0f} s"
        )
    progress.close()
    return outcome


def _measured(
    cells: list[Cell], command: str, versions: dict[str, str], finished: Finished
) -> list[CellResult]:
    """A line per cell from a process's output: its row, or why there is none."""
    if finished.returncode != 0:
        status = (
            "timed out" if finished.returncode is None else f"exit status {finished.returncode}"
        )
        tail = finished.stderr.splitlines()[-STDERR_LINES:]
        return [_result(c, "failed", command, versions, reason=[status, *tail]) for c in cells]
    # The facts, then a row per line; a library may print other lines to stdout.
    objects = [line for line in finished.stdout.splitlines() if line.startswith("{")]
    try:
        device = str(json.loads(objects[0])["device"])
        rows = [msgspec.json.decode(line, type=LatencyRow) for line in objects[1:]]
    except (ValueError, KeyError, IndexError) as exc:  # msgspec's errors are ValueErrors
        reason = [f"unreadable output: {exc}"]
        return [_result(c, "failed", command, versions, reason=reason) for c in cells]
    by_cell = {(r.batch, r.input_len): r for r in rows}
    lines = []
    for cell in cells:
        row = by_cell.get((cell.batch, cell.context))
        if row is None:
            lines.append(_result(cell, "failed", command, versions, reason=["no row printed"]))
        else:
            lines.append(_result(cell, "ok", command, versions, device=device, row=row))
    return lines


def _result(
    cell: Cell,
    status: Literal["ok", "refused", "failed"],
    command: str,
    versions: dict[str, str],
    *,
    device: str = "",
    row: LatencyRow | None = None,
    reason: Sequence[str] = (),
) -> CellResult:
    return CellResult(
        backends=cell.backends,
        algorithm=cell.algorithm,
        batch=cell.batch,
        context=cell.context,
        status=status,
        command=command,
        device=device,
        versions=versions,
        row=row,
        reason=list(reason),
    )


def refusal(latency_flags: list[str], registry: Registry) -> list[str]:
    """The capability checks' problems with the configuration ``latency_flags`` resolve to, as
    ``outrider serve`` would report them; empty when it may run. The plugins' own checks are
    left out: they judge this machine (installed kernels, the device), which the run's own
    start reports (a failed cell), while a refusal holds wherever the sweep runs."""
    parser = argparse.ArgumentParser(prog="outrider bench latency")
    add_latency_arguments(parser)
    try:
        config = resolve_latency(parser.parse_args(latency_flags))
    except ConfigError as exc:
        return [str(exc)]
    ctx = config.check_context(config.serving_dtype(None))
    named: list[tuple[PluginKind, str, str]] = [
        ("attention", name, ATTENTION_FLAG) for name in dict.fromkeys(ctx.attention_routes.values())
    ]
    if ctx.speculative_algorithm != "none":
        named.append(("speculative", ctx.speculative_algorithm, SPECULATIVE_FLAG))
    problems: list[Problem] = []
    for kind, name, option in named:
        try:
            spec = registry.get(kind, name)
        except PluginError as exc:
            problems.append(Problem(option, str(exc)))
            continue
        problems += registry.declared_problems(spec, ctx)
    return list(dict.fromkeys(map(str, problems)))


def run_process(latency_flags: list[str], timeout_s: float) -> Finished:
    """``bench latency`` in a process of its own (this interpreter), to its end or timeout."""
    argv = [sys.executable, *LATENCY_COMMAND, *latency_flags]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s or None, check=False
        )
    except subprocess.TimeoutExpired as exc:
        return Finished(None, _text(exc.stdout), _text(exc.stderr))
    return Finished(done.returncode, done.stdout, done.stderr)


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


# The distributions a cell's figures depend on; those not installed are left out.
VERSIONED = ("outrider", "torch", "triton", "flashinfer-python", "flash-attn-4")


def installed_versions() -> dict[str, str]:
    versions = {}
    for name in VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def read_results(path: Path) -> list[CellResult]:
    """Every line of a results file; raises ValueError naming a line that does not decode."""
    results = []
    with path.open("rb") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                results.append(msgspec.json.decode(line, type=CellResult))
            except msgspec.DecodeError as exc:  # ValidationError included
                raise ValueError(f"{path}:{number}: {exc}") from None
    return results


def _append(path: Path, lines: Iterable[CellResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as file:
        file.writelines(msgspec.json.encode(line) + b"\n" for line in lines)
