"""The classes a compiled Triton kernel is specialized on, read from the launches Triton's
interpreter runs (CPU tests).

Triton compiles a kernel once per class of each integer argument it specializes on: equal to
1, a multiple of 16, or neither; the ones its ``do_not_specialize`` names are left alone.
``launch_classes`` runs a callable and gives, for each kernel it launched, the classes its
launches took: two batches whose classes are equal are served by the same compiled kernels, so
the second compiles nothing (triton_launch.py, ``batch_jit``). ``classes_by_tokens`` does so
for a path at several token counts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import pytest

# One launch's classes: (argument, class) for each integer argument Triton specializes on.
Classes = tuple[tuple[str, str], ...]
# Token counts whose (token, expert) pairs at top-k 2 fall in each class: 2, 16, 26, 160.
CLASS_TOKENS = (1, 8, 13, 80)


def integer_class(value: int) -> str:
    """Triton's specialization of an integer argument."""
    if value == 1:
        return "one"
    return "multiple of 16" if value % 16 == 0 else "other"


def _classes(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Classes:
    names: list[str] = kernel.arg_names
    bound = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    left_alone = {
        names[n] if isinstance(n, int) else n for n in kernel.kwargs.get("do_not_specialize") or ()
    }
    parameters = inspect.signature(kernel.fn).parameters
    return tuple(
        (name, integer_class(value))
        for name, value in bound.items()
        if isinstance(value, int)
        and not isinstance(value, bool)
        and name not in left_alone
        and "constexpr" not in str(parameters[name].annotation)
    )


def launch_classes(
    monkeypatch: pytest.MonkeyPatch, run: Callable[[], object]
) -> dict[str, set[Classes]]:
    """Run ``run`` in Triton's interpreter; for each kernel it launched (by name), the
    classes of its launches."""
    from triton.runtime.interpreter import InterpretedFunction

    found: dict[str, set[Classes]] = {}
    launch = InterpretedFunction.run

    def recording(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        found.setdefault(self.fn.__name__, set()).add(_classes(self, args, kwargs))
        return launch(self, *args, grid=grid, warmup=warmup, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(InterpretedFunction, "run", recording)
        run()
    return found


def classes_by_tokens(
    monkeypatch: pytest.MonkeyPatch,
    run_at: Callable[[int], Callable[[], object]],
    token_counts: Sequence[int],
) -> dict[int, dict[str, set[Classes]]]:
    """``launch_classes`` of ``run_at(tokens)`` (a batch of that many tokens through a path,
    its inputs made outside the callable) for each of ``token_counts``."""
    return {tokens: launch_classes(monkeypatch, run_at(tokens)) for tokens in token_counts}
