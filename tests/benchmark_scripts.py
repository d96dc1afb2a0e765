"""Scripts of benchmarks/ loaded as modules, for tests of their host-side parts."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


@contextmanager
def benchmark_script(name: str) -> Iterator[ModuleType]:
    """``benchmarks/{name}.py`` as a module, with benchmarks/ on ``sys.path`` while it is in
    use (scripts import their neighbours)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
        sys.path.remove(str(BENCHMARKS))
