"""Every Triton kernel a CPU test launches, compiled for a Hopper GPU.

Without a GPU the tests run Triton's kernels in its interpreter, which executes them as Python
and so never type-checks them: a kernel can pass every CPU test and still fail to compile where
it is meant to run (a value whose type a runtime branch changes, a shape a branch widens). The
recorder notes each distinct launch the interpreter runs (the kernel, its arguments' types and
its compile-time constants); `compile_for_hopper` compiles them for sm_90 as a GPU's launch
would, through Triton's own compiler and assembler, in a child process that imports the kernels
uninterpreted (no device needed).

Invariant: a recorded launch compiles with the constants it was launched with, except those a
launch on a Hopper GPU sets otherwise (``GPU_CONSTANTS``): ``PDL`` is compiled on (the
interpreter runs it off), ``LIBDEVICE`` too (race_kernel.py: the interpreter has no libdevice).
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

_LAUNCH_OPTIONS = ("num_warps", "num_stages")
GPU_CONSTANTS = {"PDL": True, "LIBDEVICE": True}
UNRECORDABLE = "not recordable: "
HOPPER = ("cuda", 90, 32)  # backend, compute capability, warp size

# A launch as the child reads it: module, kernel, [[argument, type]...], {constant: value},
# {option: value}. JSON text, so that one launch is recorded once.
_launches: dict[str, None] = {}


def _argument_type(value: Any) -> str:
    from triton.runtime.jit import mangle_type

    if value is None or isinstance(value, str):
        return "constexpr"
    return str(mangle_type(value))


def _record(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    names: list[str] = kernel.arg_names
    bound = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    parameters = inspect.signature(kernel.fn).parameters
    signature, constants = [], {}
    for name in names:
        value = bound[name]
        # An annotation is a string in a module with postponed annotations.
        declared = "constexpr" in str(parameters[name].annotation)
        kind = "constexpr" if declared else _argument_type(value)
        signature.append([name, kind])
        if kind == "constexpr":
            constants[name] = GPU_CONSTANTS.get(name, value)
    options = {k: int(kwargs[k]) for k in _LAUNCH_OPTIONS if k in kwargs}
    launch = [kernel.fn.__module__, kernel.fn.__name__, signature, constants, options]
    # Never raises inside the test that launched: a constant JSON cannot carry fails the
    # compile check instead, named.
    _launches[json.dumps(launch, default=lambda v: f"{UNRECORDABLE}{v!r}")] = None


def install_recorder() -> None:
    """Note every launch Triton's interpreter runs from now on (idempotent)."""
    from triton.runtime.interpreter import InterpretedFunction

    if getattr(InterpretedFunction.run, "_records_launches", False):
        return
    run = InterpretedFunction.run

    def recording_run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        _record(self, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    recording_run._records_launches = True  # type: ignore[attr-defined]
    InterpretedFunction.run = recording_run  # type: ignore[method-assign]


def recorded_launches() -> list[str]:
    return list(_launches)


def compile_for_hopper(launches: list[str]) -> list[str]:
    """Compile each recorded launch to a cubin for sm_90 in a child process without the
    interpreter; returns one line per launch that failed, naming it and Triton's error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run(
        [sys.executable, str(Path(__file__))],
        input="\n".join(launches),
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if child.returncode != 0:
        return [f"the compiling process failed: {child.stderr[-4000:]}"]
    return [line for line in child.stdout.splitlines() if line]


def _compile_one(launch: str) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name, signature, constants, options = json.loads(launch)
    for argument, value in constants.items():
        if isinstance(value, str) and value.startswith(UNRECORDABLE):
            raise ValueError(f"the constant {argument} is {value}")
    kernel = getattr(importlib.import_module(module), name)
    index = {argument: i for i, argument in enumerate(kernel.arg_names)}
    source = ASTSource(
        kernel,
        signature=dict(signature),
        constexprs={(index[argument],): value for argument, value in constants.items()},
    )
    triton.compile(source, target=GPUTarget(*HOPPER), options=options)


def _failure(launch: str) -> str | None:
    """``launch``'s compile error in one line, None where it compiles."""
    try:
        _compile_one(launch)
    except Exception as error:  # every launch's error is reported
        message = " ".join(str(error).split())
        return f"{launch}: {type(error).__name__}: {message}"
    return None


def _main() -> None:
    """Compile the launches read from stdin on every CPU (about a second each, without a
    cache): print one line per failure."""
    launches = sys.stdin.read().splitlines()
    with ProcessPoolExecutor(max_workers=min(len(launches), os.cpu_count() or 1)) as pool:
        for failure in pool.map(_failure, launches):
            if failure is not None:
                print(failure)


if __name__ == "__main__":
    _main()
