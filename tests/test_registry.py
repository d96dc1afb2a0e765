from __future__ import annotations

import sys
import textwrap
import uuid
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Literal

import pytest

from outrider.plugins.api import PHASES, CheckContext, Phase, Problem
from outrider.plugins.registry import PluginError, Registry, discover

SPECS = """
from outrider.plugins.api import AttentionCapabilities, PluginSpec, Problem

ALPHA = PluginSpec(
    name="alpha", kind="attention", summary="any device", implementation="x:Y",
    attention=AttentionCapabilities(),
)
CUDA_ONLY = PluginSpec(
    name="cuda-only", kind="attention", summary="cuda, pages of 16", implementation="x:Y",
    attention=AttentionCapabilities(devices=frozenset({"cuda"}), page_sizes=frozenset({16})),
)
NO_CAPS = PluginSpec(name="no-caps", kind="attention", summary="", implementation="x:Y")
FUTURE = PluginSpec(
    name="future", kind="attention", summary="", implementation="x:Y", api_version=99,
    attention=AttentionCapabilities(),
)
CHAIN = PluginSpec(
    name="chain", kind="speculative", summary="", implementation="x:Y",
    check=lambda spec, ctx: [Problem("--speculative-config", "chain needs a draft model")],
)
RAISING = PluginSpec(
    name="raising", kind="speculative", summary="", implementation="x:Y",
    check=lambda spec, ctx: 1 / 0,
)
NOT_A_SPEC = 42
"""


@pytest.fixture
def specs_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"fake_plugins_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(SPECS))
    (tmp_path / f"{name}_broken.py").write_text("raise RuntimeError('no GPU library')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _registry(module: str, attention: dict[str, str], speculative: dict[str, str]) -> Registry:
    def points(group: str, names: dict[str, str]) -> list[EntryPoint]:
        return [EntryPoint(n, f"{module}{target}", group) for n, target in names.items()]

    return Registry(
        {
            "attention": points("outrider.attention_backends", attention),
            "speculative": points("outrider.speculative", speculative),
        }
    )


@pytest.fixture
def registry(specs_module: str) -> Registry:
    return _registry(
        specs_module,
        {
            "alpha": ":ALPHA",
            "cuda-only": ":CUDA_ONLY",
            "no-caps": ":NO_CAPS",
            "future": ":FUTURE",
            "chain": ":CHAIN",  # a speculative spec in the attention group
            "number": ":NOT_A_SPEC",
            "broken": "_broken:SPEC",
        },
        {"chain": ":CHAIN", "raising": ":RAISING"},
    )


def _ctx(
    routes: dict[Phase, str] | str = "alpha",
    speculative: str = "none",
    device: Literal["cpu", "cuda"] = "cpu",
    page_size: int = 16,
) -> CheckContext:
    if isinstance(routes, str):
        routes = {phase: routes for phase in PHASES}
    return CheckContext(
        device=device,
        dtype="float32",
        page_size=page_size,
        overlap=True,
        attention_routes=routes,
        speculative_algorithm=speculative,
    )


def test_specs_are_imported_only_when_asked(specs_module: str, registry: Registry) -> None:
    assert specs_module not in sys.modules
    assert registry.get("attention", "alpha").name == "alpha"
    assert specs_module in sys.modules


def test_bad_entries_are_listed_with_their_errors(registry: Registry) -> None:
    errors = {e.name: e.error for e in registry.entries("attention")}
    assert errors["alpha"] is None
    assert errors["cuda-only"] is None
    assert "RuntimeError: no GPU library" in str(errors["broken"])
    assert "not a PluginSpec" in str(errors["number"])
    assert "api_version 99" in str(errors["future"])
    assert "kind is 'speculative'" in str(errors["chain"])
    assert "AttentionCapabilities" in str(errors["no-caps"])
    assert [e.name for e in registry.entries("attention")] == sorted(errors)


def test_get_names_what_is_available(registry: Registry) -> None:
    with pytest.raises(PluginError) as unknown:
        registry.get("attention", "fa9")
    message = str(unknown.value)
    assert "unknown attention backend 'fa9'" in message
    assert "available: alpha, cuda-only" in message
    assert "failed to load: broken" in message
    with pytest.raises(PluginError, match="'broken' cannot be used: import of"):
        registry.get("attention", "broken")


def test_same_name_twice_is_an_error_for_both(specs_module: str) -> None:
    registry = Registry(
        {
            "attention": [
                EntryPoint("alpha", f"{specs_module}:ALPHA", "outrider.attention_backends"),
                EntryPoint("alpha", f"{specs_module}:CUDA_ONLY", "outrider.attention_backends"),
            ]
        }
    )
    entries = registry.entries("attention")
    assert len(entries) == 2
    assert all(e.spec is None and "also registered by" in str(e.error) for e in entries)
    with pytest.raises(PluginError, match="also registered"):
        registry.get("attention", "alpha")


def test_check_passes_a_usable_configuration(registry: Registry) -> None:
    assert registry.check(_ctx("alpha")) == []


def test_check_names_the_flag_of_an_unknown_backend(registry: Registry) -> None:
    [problem] = registry.check(_ctx("fa9"))
    assert problem.option == "--attention-backend"
    assert "unknown attention backend 'fa9'" in problem.message

    routes: dict[Phase, str] = {phase: "alpha" for phase in PHASES}
    routes.update(extend="fa9", draft_decode="fa8", draft_extend="fa8")
    options = [p.option for p in registry.check(_ctx(routes))]
    assert options == ["--prefill-attention-backend", "--draft-attention-backend"]


def test_check_reports_every_problem_together(registry: Registry) -> None:
    routes: dict[Phase, str] = {phase: "cuda-only" for phase in PHASES}
    routes["decode"] = "broken"
    problems = registry.check(_ctx(routes, speculative="chain", page_size=1))
    assert {p.option for p in problems} == {
        "--device",
        "--page-size",
        "--decode-attention-backend",
        "--speculative-config",
    }
    assert Problem("--device", "cuda-only does not run on cpu") in problems


def test_check_reports_unknown_and_raising_algorithms(registry: Registry) -> None:
    [unknown] = registry.check(_ctx(speculative="medusa"))
    assert unknown.option == "--speculative-algorithm"
    assert "unknown speculative algorithm 'medusa'; available: chain, raising" in unknown.message
    [raised] = registry.check(_ctx(speculative="raising"))
    assert raised.option == "--speculative-algorithm"
    assert "ZeroDivisionError" in raised.message


def test_discover_finds_the_builtin_backend() -> None:
    [torch_entry] = [e for e in discover().entries("attention") if e.name == "torch"]
    assert torch_entry.dist == "outrider"
    assert torch_entry.target == "outrider.plugins.attention.torch_backend:SPEC"
