"""``outrider plugins --matrix``: what every installed attention backend supports, phase by
phase and with every speculative algorithm, judged by the checks ``outrider serve`` applies.

Nothing here restates a rule: every cell is the verdict of the registry's capability checks
(plugins/checks.py) on one configuration built for it. A plugin's own ``check`` is left out:
it looks at this machine (installed kernels, the compute capability, the draft's files), and
the matrix describes the plugins wherever they are installed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import get_args

import msgspec

from outrider.daemon.config import Device, DTypeName
from outrider.plugins.api import PHASES, CheckContext, Phase, PluginSpec, Problem
from outrider.plugins.checks import (
    PHASE_FLAGS,
    draft_phases,
    phase_problems,
    used_phases,
)
from outrider.plugins.registry import KIND_NAMES, Registry

# Every phase not under test runs on this backend, which serves them all.
REFERENCE_BACKEND = "torch"
# The dtype a device serves in by default (float32 is the only one on CPU).
DEVICE_DTYPES: dict[Device, str] = {"cpu": "float32", "cuda": "bfloat16"}
# The tree each tree-drafting algorithm is checked with (K, S, N).
TREE_TOPK, TREE_STEPS, TREE_TOKENS = 2, 3, 6
# Stands in for --draft-model where an algorithm needs one: its files are its own check's.
DRAFT_PLACEHOLDER = "DRAFT"
NOT_RUN = "—"


class MatrixCell(msgspec.Struct, frozen=True):
    """One combination as the capability checks judge it."""

    runs: bool  # False: the configuration does not run that phase at all
    problems: list[Problem]  # the checks' refusals; none: supported

    @property
    def supported(self) -> bool:
        return self.runs and not self.problems


class SlotRow(msgspec.Struct, frozen=True):
    """A backend routed by one flag (the other phases on the reference), per drafting column."""

    flag: str
    phases: list[Phase]
    cells: dict[str, MatrixCell]


class BackendMatrix(msgspec.Struct, frozen=True):
    name: str
    devices: dict[str, MatrixCell]  # each in its default dtype (DEVICE_DTYPES)
    dtypes: list[str]  # those the checks accept
    page_sizes: list[int] | None  # as declared; None: any
    cuda_graphs: bool
    graph_kv_bound: bool
    host_plans: bool
    phases: dict[str, MatrixCell]
    slots: list[SlotRow]


class Matrix(msgspec.Struct, frozen=True):
    device: str  # what the slot rows are checked on
    dtype: str
    page_size: int
    drafting: list[str]  # the columns of the slot rows
    backends: list[BackendMatrix]
    failed: list[str]  # plugins left out: those that failed to load or declare nothing


@dataclass(frozen=True)
class Drafting:
    """A column of the slot rows: a speculative algorithm (or none), as a chain or a tree."""

    label: str
    algorithm: str
    tree: bool = False


def build_matrix(registry: Registry, device: Device = "cuda", page_size: int = 16) -> Matrix:
    """The matrix of every attention backend ``registry`` holds; the slot rows are checked
    on ``device`` in its default dtype with ``page_size``."""
    base = CheckContext(
        device=device,
        dtype=DEVICE_DTYPES[device],
        page_size=page_size,
        overlap=True,
        attention_routes={phase: REFERENCE_BACKEND for phase in PHASES},
        speculative_algorithm="none",
    )
    columns = drafting_columns(registry)
    backends = [
        _backend_matrix(registry, entry.spec, base, columns)
        for entry in registry.entries("attention")
        if entry.spec is not None
    ]
    failed = [
        f"{KIND_NAMES[kind]} {entry.name}: {entry.error}"
        for kind in ("attention", "speculative")
        for entry in registry.entries(kind)
        if entry.spec is None
    ]
    failed += [
        f"{KIND_NAMES['speculative']} {entry.name}: declares no SpeculativeCapabilities"
        for entry in registry.entries("speculative")
        if entry.spec is not None and entry.spec.speculative is None
    ]
    labels = [column.label for column in columns]
    return Matrix(device, base.dtype, page_size, labels, backends, failed)


def drafting_columns(registry: Registry) -> list[Drafting]:
    """None, then every speculative algorithm as a chain, and as a tree where it drafts them."""
    columns = [Drafting("none", "none")]
    for entry in registry.entries("speculative"):
        caps = entry.spec.speculative if entry.spec is not None else None
        if caps is None:
            continue
        if caps.tree:
            columns += [
                Drafting(f"{entry.name} chain", entry.name),
                Drafting(f"{entry.name} tree", entry.name, tree=True),
            ]
        else:
            columns.append(Drafting(entry.name, entry.name))
    return columns


def _backend_matrix(
    registry: Registry, spec: PluginSpec, base: CheckContext, columns: list[Drafting]
) -> BackendMatrix:
    caps = spec.attention
    assert caps is not None, "the registry admits attention specs with capabilities"
    devices: dict[str, MatrixCell] = {}
    for device, dtype in DEVICE_DTYPES.items():
        ctx = dataclasses.replace(base, device=device, dtype=dtype)
        devices[device] = MatrixCell(
            True, _options(registry.declared_problems(spec, ctx), "--device")
        )
    dtypes = [
        dtype
        for dtype in get_args(DTypeName)
        if dtype != "auto"
        and not _options(
            registry.declared_problems(spec, dataclasses.replace(base, dtype=dtype)), "--dtype"
        )
    ]
    slots = []
    for flag in dict.fromkeys(PHASE_FLAGS.values()):
        phases = [phase for phase in PHASES if PHASE_FLAGS[phase] == flag]
        cells = {c.label: _slot_cell(registry, spec.name, phases, c, base) for c in columns}
        slots.append(SlotRow(flag, phases, cells))
    return BackendMatrix(
        name=spec.name,
        devices=devices,
        dtypes=dtypes,
        page_sizes=None if caps.page_sizes is None else sorted(caps.page_sizes),
        cuda_graphs=caps.cuda_graphs,
        graph_kv_bound=caps.graph_kv_bound,
        host_plans=caps.host_plans,
        phases={
            phase: MatrixCell(True, phase_problems(spec.name, caps, phase)) for phase in PHASES
        },
        slots=slots,
    )


def _slot_cell(
    registry: Registry, name: str, phases: list[Phase], column: Drafting, base: CheckContext
) -> MatrixCell:
    """Backend ``name`` routed to ``phases``, the reference elsewhere, under ``column``."""
    ctx = dataclasses.replace(
        base,
        attention_routes=base.attention_routes | {phase: name for phase in phases},
        speculative_algorithm=column.algorithm,
    )
    drafts: frozenset[Phase] = frozenset()
    if column.algorithm != "none":
        spec = registry.get("speculative", column.algorithm)
        assert spec.speculative is not None, "drafting_columns keeps algorithms with capabilities"
        drafts = draft_phases(spec.speculative)  # as Registry._draft_phases decides
        ctx = dataclasses.replace(
            ctx, draft_model=DRAFT_PLACEHOLDER if spec.speculative.needs_draft_model else ""
        )
        if column.tree:
            ctx = dataclasses.replace(
                ctx,
                speculative_topk=TREE_TOPK,
                speculative_num_steps=TREE_STEPS,
                speculative_num_draft_tokens=TREE_TOKENS,
            )
    if not set(phases) & set(used_phases(ctx, drafts)):
        return MatrixCell(False, [])
    problems = []
    for backend in dict.fromkeys(ctx.attention_routes.values()):
        problems += registry.declared_problems(registry.get("attention", backend), ctx)
    if column.algorithm != "none":
        problems += registry.declared_problems(registry.get("speculative", column.algorithm), ctx)
    return MatrixCell(True, problems)


def _options(problems: Iterable[Problem], option: str) -> list[Problem]:
    return [p for p in problems if p.option == option]


# --- Markdown -----------------------------------------------------------------------------


class _Notes:
    """The checks' messages, numbered once each, in order of first use."""

    def __init__(self) -> None:
        self.numbers: dict[Problem, int] = {}

    def cell(self, cell: MatrixCell) -> str:
        if not cell.runs:
            return NOT_RUN
        if not cell.problems:
            return "yes"
        numbers = [self.numbers.setdefault(p, len(self.numbers) + 1) for p in cell.problems]
        return f"no ({', '.join(map(str, dict.fromkeys(numbers)))})"

    def lines(self) -> list[str]:
        return [f"{n}. `{p.option}`: {_escape(p.message)}" for p, n in self.numbers.items()]


def format_matrix(matrix: Matrix) -> str:
    """The matrix as Markdown: backends by device, dtype, page size, graphs and phase; then
    each backend per routing flag by drafting; then the refusals the cells number."""
    notes = _Notes()
    head = ["backend", *DEVICE_DTYPES, "dtypes", "page sizes", "CUDA graphs", "host plans"]
    rows = [_row([*head, *PHASES]), _row(["---"] * (len(head) + len(PHASES)))]
    for b in matrix.backends:
        pages = "any" if b.page_sizes is None else ", ".join(map(str, b.page_sizes))
        graphs = "no" if not b.cuda_graphs else "per KV bound" if b.graph_kv_bound else "yes"
        cells = [
            f"`{b.name}`",
            *(notes.cell(b.devices[device]) for device in DEVICE_DTYPES),
            ", ".join(b.dtypes) or "none",
            pages,
            graphs,
            "yes" if b.host_plans else "no",
            *(notes.cell(b.phases[phase]) for phase in PHASES),
        ]
        rows.append(_row(cells))
    rows += [
        "",
        "CUDA graphs: decode batches replay them (per KV bound: one per KV length bucket, its "
        "work growing with the bound; no: they run eagerly). Host plans: it plans each forward "
        "on the host from exact lengths; routed to a phase of the speculative cycle (verify or "
        "draft), each cycle waits for the previous one's accepted counts.",
        "",
        f"Each backend routed by one flag, every other phase on `{REFERENCE_BACKEND}`; "
        f"{matrix.device}, {matrix.dtype}, page size {matrix.page_size}; a tree is "
        f"`--speculative-topk {TREE_TOPK} --speculative-num-steps {TREE_STEPS} "
        f"--speculative-num-draft-tokens {TREE_TOKENS}`; {NOT_RUN}: that configuration does "
        "not run the phase.",
        "",
        _row(["backend", "routed by", *matrix.drafting]),
        _row(["---"] * (2 + len(matrix.drafting))),
    ]
    for b in matrix.backends:
        for slot in b.slots:
            cells = [notes.cell(slot.cells[label]) for label in matrix.drafting]
            rows.append(_row([f"`{b.name}`", f"`{slot.flag}`", *cells]))
    if notes.numbers:
        rows += ["", "Refused:", "", *notes.lines()]
    if matrix.failed:
        rows += ["", "Left out:", "", *(f"- {_escape(f)}" for f in matrix.failed)]
    return "\n".join(rows) + "\n"


def _row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(_escape(cell) for cell in cells) + " |"


def _escape(text: str) -> str:
    return text.replace("|", "\\|")
