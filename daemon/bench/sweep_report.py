"""``outrider bench sweep --report`` and ``--list``: a results file as Markdown, a row per
algorithm, batch and context, a column per backend set, then the best single backend and the
mix against it; each speculative cycle against its target's plain step; and the state of every
cell.

A cell recorded twice counts by its last line (``--retry-failed`` appends); a line recorded by
a configuration whose flags have changed since counts as not run (``bench_sweep.current``).
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Sequence

from outrider.daemon.bench.sweep import (
    ALGORITHMS,
    BACKEND_SETS,
    BATCH_SIZES,
    CONTEXTS,
    OUTPUT_LEN,
    WITHIN_PERCENT,
    Cell,
    CellResult,
    SweepConfig,
    SweepOptions,
    current,
)

MISSING = "—"
WITHIN = f"{WITHIN_PERCENT:g} %"


class _Notes:
    """Refusals and failures, numbered once each, in order of first use."""

    def __init__(self) -> None:
        self.numbers: dict[str, int] = {}

    def refer(self, texts: Iterable[str]) -> str:
        numbers = [self.numbers.setdefault(t, len(self.numbers) + 1) for t in texts]
        return ", ".join(map(str, dict.fromkeys(numbers)))

    def lines(self) -> list[str]:
        return [f"{n}. {_escape(text)}" for text, n in self.numbers.items()]


def format_report(results: Sequence[CellResult], configs: str = SweepOptions.configs) -> str:
    """The table of every (algorithm, batch, context) with at least one cell in ``results``,
    in the matrix's order, and the notes its refused and failed cells number (``configs``: the
    models folder the sweep ran with)."""
    last = current(results, configs)
    notes = _Notes()
    names = [b.name for b in BACKEND_SETS]
    head = ["algorithm", "batch", "context", *names, "best single", f"mix within {WITHIN}"]
    rows = [_row(head), _row(["---", "---:", "---:", *["---:"] * len(names), "---", "---"])]
    for algorithm in ALGORITHMS:
        for batch in BATCH_SIZES:
            for context in CONTEXTS:
                cells = {n: last.get(Cell(n, algorithm.name, batch, context)) for n in names}
                if any(cells.values()):
                    rows.append(_table_row(algorithm.name, batch, context, cells, notes))
    text = [*_preamble(list(last.values())), "", *rows, *_cycle_table(last)]
    if notes.numbers:
        text += ["", "Refused or failed:", "", *notes.lines()]
    return "\n".join(text) + "\n"


def _table_row(
    algorithm: str,
    batch: int,
    context: int,
    cells: dict[str, CellResult | None],
    notes: _Notes,
) -> str:
    shown = []
    for result in cells.values():
        if result is None:
            shown.append("not run")
        elif result.row is not None:
            shown.append(f"{result.row.step_ms:.2f} ms, {result.row.decode_tok_s:,.1f} tok/s")
        elif result.status == "refused":
            shown.append(f"refused ({notes.refer(result.reason)})")
        else:
            failure = result.reason[0] if result.reason else "failed"
            if len(result.reason) > 1:
                failure += f": {result.reason[-1]}"
            shown.append(f"failed ({notes.refer([failure])})")
    steps = {n: r.row.step_ms for n, r in cells.items() if r is not None and r.row is not None}
    singles = [b.name for b in BACKEND_SETS if b.single and b.name in steps]
    best = min(singles, key=steps.__getitem__, default=None)
    mixes = [b.name for b in BACKEND_SETS if not b.single and b.name in steps]
    verdict = MISSING
    if best is not None and mixes:
        percent = 100 * (steps[mixes[0]] / steps[best] - 1)
        verdict = f"{'yes' if percent <= WITHIN_PERCENT else 'no'}, {percent:+.1f} %"
    return _row([algorithm, str(batch), str(context), *shown, best or MISSING, verdict])


def _cycle_table(last: dict[Cell, CellResult]) -> list[str]:
    """Each measured speculative cycle over the plain step of the same target, backend set,
    batch and context (the algorithm's ``plain``); empty when no pair is measured."""

    def step_ms(backends: str, algorithm: str, batch: int, context: int) -> float | None:
        result = last.get(Cell(backends, algorithm, batch, context))
        return result.row.step_ms if result is not None and result.row is not None else None

    names = [b.name for b in BACKEND_SETS]
    rows = []
    for algorithm in (a for a in ALGORITHMS if a.plain):
        for batch in BATCH_SIZES:
            for context in CONTEXTS:
                ratios = []
                for name in names:
                    cycle = step_ms(name, algorithm.name, batch, context)
                    plain = step_ms(name, algorithm.plain, batch, context)
                    ratios.append(f"{cycle / plain:.2f}x" if cycle and plain else MISSING)
                if any(r != MISSING for r in ratios):
                    rows.append(_row([algorithm.name, str(batch), str(context), *ratios]))
    if not rows:
        return []
    head = _row(["algorithm", "batch", "context", *names])
    rule = _row(["---", "---:", "---:", *["---:"] * len(names)])
    caption = "A speculative cycle against the plain step of its target (same backends):"
    return ["", caption, "", head, rule, *rows]


def _preamble(results: list[CellResult]) -> list[str]:
    measured = [r for r in results if r.row is not None]
    devices = sorted({r.device for r in measured})
    versions = sorted({f"{k} {v}" for r in measured for k, v in r.versions.items()})
    runs = sorted({r.row.runs for r in measured if r.row is not None})
    mixed = [b for b in BACKEND_SETS if not b.single]
    median = f" (the median of {' or '.join(map(str, runs))} runs)" if runs else ""
    lines = [
        f"Wall time per decode step or speculative cycle{median} and decode tok/s; bfloat16, "
        f"dummy weights, a batch of prompts of the context's length, {OUTPUT_LEN} new tokens "
        "each. " + " ".join(f"{b.name}: `{shlex.join(b.flags)}`." for b in mixed),
        f"Mix within {WITHIN}: its step time against the best single backend's.",
        f"Device: {', '.join(devices) or 'none yet'}"
        + (" (cells of different devices do not compare)" if len(devices) > 1 else "")
        + f"; versions: {', '.join(versions) or 'none yet'}.",
    ]
    return lines


def list_cells(
    matrix: Sequence[SweepConfig],
    results: Sequence[CellResult],
    configs: str = SweepOptions.configs,
) -> str:
    """A line per cell with its state (the last line recorded, else "to run"), then counts."""
    done = current(results, configs)
    lines, states = [], []
    for config in matrix:
        for cell in config.cells():
            result = done.get(cell)
            state = "to run" if result is None else result.status
            step = f"  {result.row.step_ms:.2f} ms" if result and result.row else ""
            lines.append(f"{state:<8} {cell}{step}")
            states.append(state)
    counts = ", ".join(f"{states.count(s)} {s}" for s in ("ok", "refused", "failed", "to run"))
    return "\n".join([*lines, f"{len(states)} cells: {counts}"]) + "\n"


def _row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(_escape(cell) for cell in cells) + " |"


def _escape(text: str) -> str:
    return text.replace("|", "\\|")
