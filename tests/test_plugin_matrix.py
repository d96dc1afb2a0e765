"""``outrider plugins --matrix``: every cell is the capability checks' verdict, the README's
table is the command's output, and installed third-party backends appear in it."""

from __future__ import annotations

import json
import textwrap
import tomllib
import uuid
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

# The example package of the third-party tests, built and installed (a module-scoped fixture).
from test_thirdparty_plugin import _plugins_cmd
from test_thirdparty_plugin import site as thirdparty_site  # noqa: F401 (requested by name)

from outrider.daemon.cli import main as cli
from outrider.daemon.cli import plugins as plugins_cmd
from outrider.daemon.cli.plugin_matrix import (
    BackendMatrix,
    Matrix,
    MatrixCell,
    build_matrix,
    format_matrix,
)
from outrider.plugins.api import ENTRY_POINT_GROUPS, PHASES, CheckContext, PluginKind, Problem
from outrider.plugins.registry import Registry, discover

ROOT = Path(__file__).parents[1]
HOST_PLANNED_DRAFT = Problem(
    "--draft-attention-backend",
    "flashinfer plans each batch on the host from exact lengths, and standalone's draft "
    "batches follow the accepted counts, known only on the device: route the draft phases to "
    "another backend",
)


def _project_points() -> dict[PluginKind, list[EntryPoint]]:
    """The entry points this project declares (pyproject.toml), installed or not yet."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        declared = tomllib.load(f)["project"]["entry-points"]
    return {
        kind: [EntryPoint(name, value, group) for name, value in declared[group].items()]
        for kind, group in ENTRY_POINT_GROUPS.items()
    }


def _project_registry() -> Registry:
    return Registry(_project_points())


def _backend(matrix: Matrix, name: str) -> BackendMatrix:
    [backend] = [b for b in matrix.backends if b.name == name]
    return backend


def _slot(backend: BackendMatrix, flag: str) -> dict[str, MatrixCell]:
    [slot] = [s for s in backend.slots if s.flag == flag]
    return slot.cells


def test_the_columns_are_every_algorithm_chain_and_tree() -> None:
    matrix = build_matrix(_project_registry())
    assert matrix.drafting == [
        "none", "dflash", "eagle3 chain", "eagle3 tree", "ngram", "standalone",
    ]  # fmt: skip
    assert {"flashinfer", "torch", "triton"} <= {b.name for b in matrix.backends}
    assert matrix.failed == []
    assert [(s.flag, s.phases) for s in matrix.backends[0].slots] == [
        ("--prefill-attention-backend", ["extend"]),
        ("--decode-attention-backend", ["decode"]),
        ("--verify-attention-backend", ["verify"]),
        ("--draft-attention-backend", ["draft_decode", "draft_extend"]),
    ]


def test_flashinfer_cells_are_the_checks_refusals() -> None:
    flashinfer = _backend(build_matrix(_project_registry()), "flashinfer")
    assert flashinfer.devices == {
        "cpu": MatrixCell(True, [Problem("--device", "flashinfer does not run on cpu")]),
        "cuda": MatrixCell(True, []),
    }
    assert flashinfer.dtypes == ["bfloat16", "float16"]
    assert flashinfer.page_sizes is None
    assert (flashinfer.cuda_graphs, flashinfer.graph_kv_bound, flashinfer.host_plans) == (
        True, False, True,
    )  # fmt: skip
    assert flashinfer.phases == {phase: MatrixCell(True, []) for phase in PHASES}
    verify = _slot(flashinfer, "--verify-attention-backend")
    assert verify["none"] == MatrixCell(False, [])  # plain decoding verifies nothing
    for label in ("dflash", "eagle3 chain", "eagle3 tree", "ngram", "standalone"):
        assert verify[label] == MatrixCell(True, []), label
    draft = _slot(flashinfer, "--draft-attention-backend")
    for label in ("dflash", "eagle3 chain", "eagle3 tree"):  # DFlash's block, trees' masks
        assert draft[label] == MatrixCell(True, []), label
    assert draft["standalone"] == MatrixCell(True, [HOST_PLANNED_DRAFT])
    assert draft["ngram"] == MatrixCell(False, [])  # no draft model: no draft phases
    decode = _slot(flashinfer, "--decode-attention-backend")
    assert decode["none"].supported
    assert [label for label, cell in decode.items() if cell.runs] == ["none"]
    assert all(c.supported for c in _slot(flashinfer, "--prefill-attention-backend").values())


def test_torch_supports_everything_on_cpu_and_triton_on_cuda() -> None:
    torch = _backend(build_matrix(_project_registry(), device="cpu"), "torch")
    assert torch.devices == {"cpu": MatrixCell(True, []), "cuda": MatrixCell(True, [])}
    assert torch.dtypes == ["float32", "bfloat16", "float16"]
    assert all(cell.supported for cell in torch.phases.values())
    cells = [cell for slot in torch.slots for cell in slot.cells.values()]
    assert len(cells) == 4 * 6
    assert all(cell.supported or not cell.runs for cell in cells)
    assert sum(cell.runs for cell in cells) == 6 + 1 + 5 + 4  # prefill, decode, verify, draft

    triton = _backend(build_matrix(_project_registry()), "triton")
    assert triton.devices["cpu"] == MatrixCell(
        True, [Problem("--device", "triton does not run on cpu")]
    )
    assert all(c.supported or not c.runs for s in triton.slots for c in s.cells.values())
    # Every slot row of a backend refused on the device carries that refusal.
    flashinfer = _backend(build_matrix(_project_registry(), device="cpu"), "flashinfer")
    prefill = _slot(flashinfer, "--prefill-attention-backend")
    assert Problem("--device", "flashinfer does not run on cpu") in prefill["none"].problems


SPECS = """
from outrider.plugins.api import AttentionCapabilities, PluginSpec, Problem

PICKY = PluginSpec(
    name="picky", kind="attention", summary="", implementation="x:Y",
    attention=AttentionCapabilities(
        devices=frozenset({"cuda"}), page_sizes=frozenset({64}), tree_mask=True,
        phases=frozenset({"verify", "draft_decode", "draft_extend"}),
    ),
    check=lambda spec, ctx: [Problem("--attention-backend", "picky: its kernels are missing")],
)
"""


@pytest.fixture
def picky(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Registry:
    """The built-in algorithms, the reference backend and ``picky``: verify and draft phases
    only, pages of 64, and an own check that always refuses."""
    module = f"matrix_plugins_{uuid.uuid4().hex}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(SPECS))
    monkeypatch.syspath_prepend(str(tmp_path))
    points = _project_points()
    group = ENTRY_POINT_GROUPS["attention"]
    points["attention"] = [ep for ep in points["attention"] if ep.name == "torch"]
    points["attention"].append(EntryPoint("picky", f"{module}:PICKY", group))
    return Registry(points)


def test_a_cell_is_what_the_registry_refuses_its_own_check_left_out(picky: Registry) -> None:
    matrix = build_matrix(picky, page_size=64)
    backend = _backend(matrix, "picky")
    assert backend.page_sizes == [64]
    served = "verify, draft_decode, draft_extend"
    assert backend.phases["extend"] == MatrixCell(
        True,
        [
            Problem(
                "--prefill-attention-backend",
                f"picky cannot run the extend phase (it serves {served}): route that phase to "
                "another backend with --prefill-attention-backend",
            )
        ],
    )
    verify = _slot(backend, "--verify-attention-backend")
    assert verify["eagle3 tree"].supported and verify["dflash"].supported
    draft = _slot(backend, "--draft-attention-backend")
    assert draft["dflash"] == MatrixCell(
        True,
        [
            Problem(
                "--draft-attention-backend",
                "dflash drafts with non-causal attention, which picky cannot do",
            )
        ],
    )
    # The same configuration through the registry: the capability refusals and the own one.
    routes = {phase: "torch" for phase in PHASES}
    ctx = CheckContext(
        device="cuda",
        dtype="bfloat16",
        page_size=64,
        overlap=True,
        attention_routes=routes | {"draft_decode": "picky", "draft_extend": "picky"},
        speculative_algorithm="dflash",
        draft_model="DRAFT",
    )
    own = Problem("--attention-backend", "picky: its kernels are missing")
    problems = picky.check(ctx)
    assert problems[:2] == [own, *draft["dflash"].problems]

    other_size = _backend(build_matrix(picky, page_size=16), "picky")
    refusal = Problem("--page-size", "picky takes page sizes 64, not 16")
    assert _slot(other_size, "--verify-attention-backend")["ngram"] == MatrixCell(True, [refusal])


def test_markdown_numbers_each_refusal_once(picky: Registry) -> None:
    lines = format_matrix(build_matrix(picky, page_size=64)).splitlines()
    assert lines[:4] == [
        "| backend | cpu | cuda | dtypes | page sizes | CUDA graphs | host plans | extend "
        "| decode | verify | draft_decode | draft_extend |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        "| `picky` | no (1) | yes | float32, bfloat16, float16 | 64 | no | no | no (2) | no (3) "
        "| yes | yes | yes |",
        "| `torch` | yes | yes | float32, bfloat16, float16 | any | per KV bound | no | yes | yes "
        "| yes | yes | yes |",
    ]
    picky_rows = [line for line in lines if line.startswith("| `picky` | `--")]
    assert picky_rows == [
        "| `picky` | `--prefill-attention-backend` | " + " | ".join(["no (2)"] * 6) + " |",
        "| `picky` | `--decode-attention-backend` | no (3) | — | — | — | — | — |",
        "| `picky` | `--verify-attention-backend` | — | yes | yes | yes | yes | yes |",
        "| `picky` | `--draft-attention-backend` | — | no (4) | yes | yes | — | yes |",
    ]
    refused = lines[lines.index("Refused:") + 2 :]
    assert [line.split(".", 1)[0] for line in refused] == ["1", "2", "3", "4"]
    assert refused[0] == "1. `--device`: picky does not run on cpu"
    assert refused[3] == (
        "4. `--draft-attention-backend`: dflash drafts with non-causal attention, which picky "
        "cannot do"
    )
    assert not any("kernels are missing" in line for line in lines)


def test_the_readme_matrix_is_the_generated_one(capsys: pytest.CaptureFixture[str]) -> None:
    readme = (ROOT / "README.md").read_text()
    begin, end = "<!-- plugin matrix: begin -->\n", "<!-- plugin matrix: end -->"
    assert begin in readme and end in readme, "the README lost its plugin matrix markers"
    table = readme.split(begin, 1)[1].split(end, 1)[0]
    assert table == format_matrix(build_matrix(_project_registry())), (
        "regenerate it: outrider plugins --matrix (with the project installed: pip install -e .)"
    )
    assert cli.main(["plugins", "--matrix"]) == 0
    assert capsys.readouterr().out == format_matrix(build_matrix(discover()))


def test_json_form_carries_the_cells(capsys: pytest.CaptureFixture[str]) -> None:
    assert plugins_cmd.main(["--matrix", "--json"]) == 0
    matrix = json.loads(capsys.readouterr().out)
    assert (matrix["device"], matrix["dtype"], matrix["page_size"]) == ("cuda", "bfloat16", 16)
    [flashinfer] = [b for b in matrix["backends"] if b["name"] == "flashinfer"]
    [verify] = [s for s in flashinfer["slots"] if s["flag"] == "--verify-attention-backend"]
    assert verify["phases"] == ["verify"]
    assert verify["cells"]["eagle3 tree"] == {"runs": True, "problems": []}
    [draft] = [s for s in flashinfer["slots"] if s["flag"] == "--draft-attention-backend"]
    assert draft["cells"]["standalone"]["problems"][0] == {
        "option": HOST_PLANNED_DRAFT.option,
        "message": HOST_PLANNED_DRAFT.message,
    }
    assert verify["cells"]["none"] == {"runs": False, "problems": []}


def test_an_installed_third_party_backend_appears(request: pytest.FixtureRequest) -> None:
    site = request.getfixturevalue("thirdparty_site")
    lines = _plugins_cmd(site, "--matrix").splitlines()
    rows = {
        tuple(line.strip("| ").split(" | ")[:2]): line for line in lines if line.startswith("|")
    }
    # CUDA only, pages of 16, no graphs, every phase; no tree masks, causal only.
    [cpu] = [
        line for line in lines if line.endswith("`--device`: example-sdpa does not run on cpu")
    ]
    sdpa = rows["`example-sdpa`", f"no ({cpu.split('.')[0]})"].strip("| ").split(" | ")
    assert sdpa[2:] == ["yes", "bfloat16, float16", "16", "no", "no", *["yes"] * len(PHASES)]
    dense = rows["`example-dense`", "yes"].strip("| ").split(" | ")
    assert dense[2:] == ["yes", "float32, bfloat16, float16", "any", "no", "no", *["yes"] * 5]
    # The package's own speculative plugin gets its column, after the tree's.
    drafting = next(line for line in lines if line.startswith("| backend | routed by |"))
    assert drafting.split(" | ")[2:] == [
        "none", "dflash", "eagle3 chain", "eagle3 tree", "example-draft", "ngram", "standalone |"
    ]  # fmt: skip
    verify = rows["`example-sdpa`", "`--verify-attention-backend`"].strip("| ").split(" | ")
    assert verify[2:5] + verify[6:] == ["—", "yes", "yes", "yes", "yes", "yes"]  # but the tree
    number = verify[5].removeprefix("no (").removesuffix(")")
    assert (
        f"{number}. `--verify-attention-backend`: eagle3 with --speculative-topk 2 verifies a "
        "tree (a tree mask), which example-sdpa cannot do"
    ) in lines
    assert lines[-1].startswith(
        "- speculative algorithm broken: import of outrider_example_plugin.broken:SPEC failed: "
        "ModuleNotFoundError"
    )
