"""Where a step log's turns went (``--step-log``, scheduler/step_log.py): per kind of step, how
many turns, their time and their rows. A benchmark that serves several runs from one daemon
(the speculation sweep's concurrencies) places each run's turns by their wall time (``at``).

Kinds: ``prompt`` (an EXTEND batch), ``mixed`` (an EXTEND batch that decoding rows ride) and
``decode N`` (a decode step of width ``N``: 1 a plain step). Turns that launched nothing are
left out. A turn's time is the loop's turn: under overlap, the device's time of the step
before where the loop waited for it, so a kind's total is where the run's time went only
summed over every kind.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Line = dict[str, Any]  # one JSON line of a step log


@dataclass
class Turns:
    """The turns of one kind: their count, their summed milliseconds, the milliseconds of
    those they waited for results (``wait_ms``: near nothing where the host, or a wait inside
    the launch, set the pace), rows, rows that did not feed the draft (``StepPlan.unfed``) and
    the allocator's calls to the driver (``allocator_calls``)."""

    turns: int = 0
    ms: float = 0.0
    waited_ms: float = 0.0
    rows: int = 0
    unfed: int = 0
    allocator_calls: int = 0

    def add(self, line: Line) -> None:
        self.turns += 1
        self.ms += line["turn_ms"]
        self.waited_ms += line["wait_ms"]
        self.rows += line["rows"]
        self.unfed += line["unfed"]
        self.allocator_calls += line.get("allocator_calls", 0)


def kind(line: Line) -> str | None:
    """The kind of the step a step log's line launched (module docstring); None: no step."""
    if "kind" not in line:
        return None
    if line["kind"] == "decode":
        return f"decode {line['width']}"
    return "mixed" if line.get("riders") else "prompt"


def read(path: Path) -> list[Line]:
    """Every line of the step log at ``path``."""
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def summarize(
    lines: Iterable[Line], since: float = float("-inf"), until: float = float("inf")
) -> dict[str, Turns]:
    """The turns of ``lines`` by kind, prompts first, then decode steps by width; only those
    that started between ``since`` and ``until`` (Unix seconds)."""
    kinds: dict[str, Turns] = {}
    for line in lines:
        name = kind(line)
        if name is not None and since <= line["at"] <= until:
            kinds.setdefault(name, Turns()).add(line)
    return dict(sorted(kinds.items(), key=lambda item: _order(item[0])))


def _order(name: str) -> tuple[int, int]:
    """Prompt batches, mixed ones, then decode steps by width."""
    if name.startswith("decode"):
        return (2, int(name.split()[-1]))
    return (0 if name == "prompt" else 1, 0)


def describe(kinds: dict[str, Turns]) -> str:
    """One line: each kind's turns, milliseconds and waited milliseconds a turn, rows a turn,
    unfed rows a turn and allocator calls in all where there are some, e.g. ``prompt 64 x
    47.0 ms, waited 27.4 (4.0 rows); decode 1 765 x 10.9 ms, waited 8.2 (171.0 rows, 2.0
    unfed)``."""
    parts = []
    for name, turns in kinds.items():
        n = turns.turns
        rows = f"{turns.rows / n:.1f} rows"
        if turns.unfed:
            rows += f", {turns.unfed / n:.1f} unfed"
        if turns.allocator_calls:
            rows += f", allocator calls {turns.allocator_calls}"
        parts.append(
            f"{name} {n} x {turns.ms / n:.1f} ms, waited {turns.waited_ms / n:.1f} ({rows})"
        )
    return "; ".join(parts)
