"""What a serving configuration needs, checked before anything is spawned or loaded: the
model and draft directories (their config.json, the target's architecture, whole safetensors
files), the CURVE key files and the step log's file (``preflight``), and the plugins it
routes, the attention slots left to ``auto`` chosen first (``resolve_plugins``).

Each problem is one line naming its flag (and path); every one is reported at once. Nothing
here imports torch or transformers, so a light install can run it too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outrider.daemon.config import ConfigError, ServeConfig
from outrider.daemon.frontdoor.curve_auth import CurveKeyError, load_client_keys, load_server_keys
from outrider.daemon.processes.attention_choice import AttentionChoice, choose_for
from outrider.plugins.checks import PluginProblems
from outrider.plugins.models.config import (
    TENSOR_PARALLEL_FLAG,
    model_type_problem,
    tensor_parallel_problems,
)
from outrider.plugins.models.fp8.config import quantization_problems as fp8_problems
from outrider.plugins.models.registry import architecture_problem
from outrider.plugins.registry import ResolvedPlugins, discover

_INDEX = "model.safetensors.index.json"
_LENGTH_BYTES = 8  # a safetensors file opens with its header's length, u64 little-endian
_GENERATION_CONFIG = "generation_config.json"
CANNOT_RUN = "the configuration cannot run:"


def preflight(config: ServeConfig) -> list[str]:
    """Every problem of ``config``'s files; empty when serving may start."""
    problems = model_problems("--model", config.model, config.load_format)
    if not problems:
        problems += architecture_problems(config) or (
            sharding_problems(config) + quantization_problems(config)
        )
    if config.draft_model:
        problems += model_problems("--draft-model", config.draft_model, config.load_format)
    if config.curve_secret_key_file:
        problems += _curve_problem(lambda: load_server_keys(config.curve_secret_key_file))
    if config.curve_client_keys:
        problems += _curve_problem(lambda: load_client_keys(config.curve_client_keys))
    if config.step_log:
        problems += _step_log_problem(Path(config.step_log))
    return problems


def _step_log_problem(path: Path) -> list[str]:
    """The step log's file must open for appending (it is created if missing)."""
    try:
        with path.open("a", encoding="utf-8"):
            return []
    except OSError as exc:
        return [f"--step-log {path}: cannot append to it: {exc.strerror}"]


def model_problems(flag: str, path: str, load_format: str) -> list[str]:
    """``path`` is a model directory with a config.json, or a config.json file; a
    generation_config.json beside it is a JSON object; with ``--load-format auto`` its
    directory holds safetensors weights (what the loader reads)."""
    where = f"{flag} {path}"
    given = Path(path)
    if given.is_dir():
        directory, config_file = given, given / "config.json"
        if not config_file.is_file():
            return [f"{where}: no config.json in the directory"]
    elif given.is_file():
        directory, config_file = given.parent, given
    elif given.exists():
        return [f"{where}: neither a directory nor a config.json file"]
    else:
        return [f"{where}: no such file or directory"]
    problem = _config_problem(config_file)
    generation = directory / _GENERATION_CONFIG
    if problem is None and generation.is_file():
        # Read at load for its EOS ids, whatever --generation-config says.
        problem = _config_problem(generation)
    if problem is None and load_format == "auto":
        problem = _weights_problem(directory)
    return [] if problem is None else [f"{where}: {problem}"]


def architecture_problems(config: ServeConfig) -> list[str]:
    """The target's ``model_type`` and ``architectures[0]`` against the models built here.
    ``config.model`` must pass ``model_problems``."""
    loaded = _target_config(config)
    architectures = loaded.get("architectures") or [None]
    problem = model_type_problem(loaded)
    if problem is None and isinstance(architectures[0], str):
        problem = architecture_problem(architectures[0])
    return [] if problem is None else [f"--model {config.model}: {problem}"]


def sharding_problems(config: ServeConfig) -> list[str]:
    """``--tensor-parallel-size`` against the model's shape: what does not divide.
    ``config.model`` must pass ``model_problems``."""
    size = config.tensor_parallel_size
    if size == 1:
        return []
    return tensor_parallel_problems(_target_config(config), size)


def quantization_problems(config: ServeConfig) -> list[str]:
    """The target's ``quantization_config``: a format served here (FP8), and one whose
    blocks each rank's share of the projections holds whole. ``config.model`` must pass
    ``model_problems``."""
    size = config.tensor_parallel_size
    problems = fp8_problems(_target_config(config), size, TENSOR_PARALLEL_FLAG)
    return [f"--model {config.model}: {problem}" for problem in problems]


def _target_config(config: ServeConfig) -> dict[str, Any]:
    given = Path(config.model)
    loaded: dict[str, Any] = json.loads(
        (given / "config.json" if given.is_dir() else given).read_text()
    )
    return loaded


def _config_problem(config_file: Path) -> str | None:
    try:
        loaded = json.loads(config_file.read_text())
    except OSError as exc:
        return f"cannot read {config_file.name}: {exc.strerror}"
    except ValueError:
        return f"{config_file.name} is not JSON"
    return None if isinstance(loaded, dict) else f"{config_file.name} is not a JSON object"


def _weights_problem(directory: Path) -> str | None:
    index = directory / _INDEX
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return f"{_INDEX} is unreadable or has no weight_map"
        missing = sorted(name for name in shards if not (directory / name).is_file())
        if missing:
            return f"{_INDEX} names missing shards: {', '.join(missing)}"
        return _first(_safetensors_problem(directory / name) for name in sorted(shards))
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return _first(_safetensors_problem(path) for path in files)
    problem = "no *.safetensors weights (--load-format dummy runs without them)"
    if any(directory.glob("*.bin")):
        problem += "; *.bin checkpoints are not read: convert them to safetensors"
    return problem


def _safetensors_problem(path: Path) -> str | None:
    """``path`` holds the whole of what its header describes: an 8-byte little-endian header
    length, the JSON header, then every tensor's bytes up to the largest ``data_offsets``
    end. Reads the header only."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(_LENGTH_BYTES), "little")
            if _LENGTH_BYTES + header_len > size:
                return f"{path.name} is truncated or not safetensors ({size} bytes)"
            header = json.loads(f.read(header_len))
        ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    except OSError as exc:
        return f"cannot read {path.name}: {exc.strerror}"
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return f"{path.name} has no readable safetensors header"
    described = _LENGTH_BYTES + header_len + max(ends, default=0)
    if described > size:
        return f"{path.name} is truncated: {size} bytes of the {described} its header describes"
    return None


def _first(problems: Iterable[str | None]) -> str | None:
    return next((p for p in problems if p is not None), None)


def _curve_problem(load: Callable[[], object]) -> list[str]:
    try:
        load()
    except CurveKeyError as exc:
        return [str(exc)]
    return []


@dataclass(frozen=True)
class ServedPlugins:
    """The resolved plugins and how their attention routes were chosen."""

    plugins: ResolvedPlugins
    attention: AttentionChoice


def resolve_plugins(
    config: ServeConfig, dtype: str, cuda_capability: tuple[int, int] | None
) -> ServedPlugins:
    """The plugins ``config`` routes, run in ``dtype``, its open attention slots chosen for
    this device (attention_choice.py), checked and resolved with one discovery: what the
    daemon builds its engine from and ``outrider plugins --check`` reports. Raises
    ``ConfigError`` naming every problem, one per line."""
    registry = discover()
    choice = choose_for(config, dtype, cuda_capability, registry)
    ctx = config.check_context(dtype, cuda_capability, choice.phase_routes)
    try:
        return ServedPlugins(registry.resolve(ctx), choice)
    except PluginProblems as exc:
        problems = "\n  ".join(map(str, exc.problems))
        raise ConfigError(f"{CANNOT_RUN}\n  {problems}") from None
