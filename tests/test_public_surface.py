"""The public surface for plugins (``outrider.plugins.api.PUBLIC_MODULES``, what ``API_VERSION``
covers): the example third-party package imports nothing else of Outrider, and no module of
``outrider.plugins`` imports the daemon (layers point one way: protocol <- plugins <- daemon).
Imports are read from the source with ``ast``, wherever they sit (functions and
``TYPE_CHECKING`` blocks included)."""

from __future__ import annotations

import ast
import importlib
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from outrider.plugins.api import PUBLIC_MODULES

TESTS = Path(__file__).parent
PLUGINS = TESTS.parent / "plugins"
EXAMPLE = TESTS / "fixtures" / "thirdparty_plugin" / "outrider_example_plugin"


@dataclass(frozen=True)
class Import:
    """One import statement: the module it names (absolute) and what ``from`` takes from it
    (empty for ``import``)."""

    module: str
    names: tuple[str, ...] = ()

    @property
    def reached(self) -> tuple[str, ...]:
        """The dotted names it may reach: the module, and each name taken as a submodule."""
        return (self.module, *(f"{self.module}.{name}" for name in self.names))

    @property
    def outrider(self) -> bool:
        return self.module == "outrider" or self.module.startswith("outrider.")


def imports_of(source: str, package: str) -> list[Import]:
    """Every import of ``source``, a module of ``package``; relative ones made absolute."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{module}" if module else base
            found.append(Import(module, tuple(alias.name for alias in node.names)))
    return found


def outside_surface(source: str, package: str) -> list[str]:
    """The imports of Outrider that ``source`` makes outside ``PUBLIC_MODULES``."""
    public = set(PUBLIC_MODULES)
    return [
        imp.module
        for imp in imports_of(source, package)
        if imp.outrider
        and imp.module not in public
        and not (imp.names and all(f"{imp.module}.{name}" in public for name in imp.names))
    ]


def daemon_imports(source: str, package: str) -> list[str]:
    """The imports of ``source`` that reach ``outrider.daemon``, each by the first name of it
    there."""
    found = []
    for imp in imports_of(source, package):
        names = [
            n for n in imp.reached if n == "outrider.daemon" or n.startswith("outrider.daemon.")
        ]
        found += names[:1]
    return found


def _package_of(path: Path, root: Path, root_package: str) -> str:
    return ".".join([root_package, *path.parent.relative_to(root).parts])


def test_the_checks_see_real_imports() -> None:
    """Each way of reaching a private module or the daemon is caught; public ones pass."""
    private = (
        "from outrider.plugins.checks import ATTENTION_FLAG\n"
        "from outrider.plugins import registry\n"
        "from outrider.plugins import device, speculative\n"
        "import outrider.plugins.speculative.ngram_impl\n"
        "def later():\n"
        "    from outrider.daemon.engine import runner\n"
    )
    assert sorted(outside_surface(private, "example")) == [
        "outrider.daemon.engine",
        "outrider.plugins",
        "outrider.plugins",
        "outrider.plugins.checks",
        "outrider.plugins.speculative.ngram_impl",
    ]
    public = (
        "from outrider.plugins import api, device\n"
        "import outrider.plugins.models.loader\n"
        "from outrider.plugins.speculative.base import SpeculativeWorker\n"
        "from . import spec\n"
        "import torch\n"
    )
    assert outside_surface(public, "example") == []
    reaching = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from outrider.daemon.config import ServeConfig\n"
        "from ...daemon import internal\n"
        "from outrider import daemon\n"
        "import outrider.daemon\n"
        "from outrider.plugins import device\n"
    )
    assert sorted(daemon_imports(reaching, "outrider.plugins.speculative")) == [
        "outrider.daemon",  # from ...daemon import internal
        "outrider.daemon",  # from outrider import daemon
        "outrider.daemon",  # import outrider.daemon
        "outrider.daemon.config",
    ]


def test_the_example_package_imports_only_the_public_surface() -> None:
    used: set[str] = set()
    for path in sorted(EXAMPLE.rglob("*.py")):
        source = path.read_text()
        package = _package_of(path, EXAMPLE, EXAMPLE.name)
        assert outside_surface(source, package) == [], path.name
        used |= {imp.module for imp in imports_of(source, package) if imp.outrider}
    # It builds both plugin kinds on the surface, a draft model included.
    assert {
        "outrider.plugins.api",
        "outrider.plugins.attention.base",
        "outrider.plugins.speculative.base",
        "outrider.plugins.models.loader",
    } <= used


def test_no_plugin_module_imports_the_daemon() -> None:
    paths = sorted(PLUGINS.rglob("*.py"))
    assert len(paths) > 40
    for path in paths:
        package = _package_of(path, PLUGINS, "outrider.plugins")
        assert daemon_imports(path.read_text(), package) == [], path


def test_every_public_module_is_a_plugins_module_that_imports() -> None:
    pytest.importorskip("torch")
    for name in PUBLIC_MODULES:
        assert name.startswith("outrider.plugins."), name
        importlib.import_module(name)


def test_the_readme_lists_the_public_modules() -> None:
    readme = (TESTS.parent / "README.md").read_text()
    table = readme.split("| module (`outrider.plugins.`) |", 1)[1].split("\n\n", 1)[0]
    first_cells = [row.split("|")[1] for row in table.splitlines()[2:]]
    listed = {name for cell in first_cells for name in re.findall(r"`([\w.]+)`", cell)}
    assert listed == {name.removeprefix("outrider.plugins.") for name in PUBLIC_MODULES}
