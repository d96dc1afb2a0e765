"""Filling a model from its checkpoint: the one weight loader of targets and drafts
(ARCHITECTURE.md 4.5).

A model's checkpoint table (``checkpoint_table``) maps each checkpoint name onto its
destination: a parameter or persistent buffer, named by its module path, or one part's rows
of a fused parameter (``FusedLinear``: q/k/v, gate/up), holding the rank's cut under tensor
parallelism (``parallel.Split``). A module that names its tensors its own way
(``NamesCheckpoint``: a mixture of experts, one checkpoint tensor per expert and projection
into stacked parameters) gives the entries of its whole subtree. ``CheckpointRules`` say what
the table cannot: the model's label in errors, the tensors its checkpoint may carry that it
takes from elsewhere (skipped), and those the checkpoint may lack.

Invariants:
- every checkpoint tensor lands in exactly one destination, or is skipped by a rule;
- every destination is filled exactly once, unless a rule lets it be missing;
- a sharded destination reads only the rank's cut of a file (safetensors slices);
- every unexpected, repeated or missing tensor is named in one ValueError; a wrong shape,
  or an FP8 tensor for 16-bit storage or the reverse (a copy would cast it without its
  scales), raises at once, naming the tensor.

Dummy weights (``init_dummy``) are the same cut of what a single rank draws, so any world
size runs the same model; a ``SelfDrawn`` module (an FP8 linear) draws its own that way.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch
from torch.nn import Parameter

from outrider.plugins.models.config import model_dir
from outrider.plugins.models.fp8.reference import FP8
from outrider.plugins.models.layers import FusedLinear, RMSNorm
from outrider.plugins.models.parallel import Sharded, Split, TensorSource

log = logging.getLogger(__name__)

LoadFormat = Literal["auto", "dummy"]
# (shard index from 1, shard count, file name), called after each shard is loaded.
LoadProgress = Callable[[int, int, str], None]

# Our fused module -> the checkpoint projection of each of its parts.
_PART_NAMES: dict[str, dict[str, str]] = {
    "qkv_proj": {"q": "q_proj", "k": "k_proj", "v": "v_proj"},
    "gate_up_proj": {"gate": "gate_proj", "up": "up_proj"},
}
# Buffers some older checkpoints saved next to the weights; we recompute them.
_RECOMPUTED_SUFFIXES = (".rotary_emb.inv_freq",)
_DUMMY_STD = 0.02
_STORED_FP8 = "F8_E4M3"  # safetensors' name of float8_e4m3fn


@dataclass(frozen=True)
class Destination:
    """Where one checkpoint tensor lands: ``tensor`` (a parameter or persistent buffer), or
    its ``rows`` (of a fused parameter: a slice; of stacked experts: ``expert`` or
    ``(expert, slice)``), holding the rank's cut (``split``; None: all of it)."""

    tensor: torch.Tensor
    rows: slice | int | tuple[int, slice] | None
    split: Split | None

    @property
    def data(self) -> torch.Tensor:
        """The storage filled, outside autograd."""
        return self.tensor.data if self.rows is None else self.tensor.data[self.rows]

    def checkpoint_shape(self) -> tuple[int, ...]:
        local = tuple(self.data.shape)
        return local if self.split is None else self.split.full_shape(local)


def param_split(module: torch.nn.Module, name: str) -> Split | None:
    """How ``module``'s parameter ``name`` is cut from its checkpoint tensor."""
    return module.param_split(name) if isinstance(module, Sharded) else None


class NamesCheckpoint:
    """A module that maps its own subtree onto checkpoint names."""

    def checkpoint_destinations(self, path: str) -> dict[str, Destination]:
        """Checkpoint name -> destination for every parameter of this module and its
        children; ``path``: the module's path in the model."""
        raise NotImplementedError


def checkpoint_table(model: torch.nn.Module) -> dict[str, Destination]:
    """Checkpoint name -> destination, for every parameter and persistent buffer of ``model``
    (named in the HF layout, the fused projections split into their parts)."""
    table: dict[str, Destination] = {}
    owners = [(path, m) for path, m in model.named_modules() if isinstance(m, NamesCheckpoint)]
    for path, owner in owners:
        table.update(owner.checkpoint_destinations(path))
    owned = tuple(f"{path}." for path, _ in owners)
    for name, tensor in model.state_dict(keep_vars=True).items():
        if owned and name.startswith(owned):
            continue
        module_path, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_path)
        split = param_split(module, leaf)
        if not isinstance(module, FusedLinear):
            table[name] = Destination(tensor, None, split)
            continue
        parent, _, fused = module_path.rpartition(".")
        for part, rows in module.part_rows(leaf).items():
            part_name = f"{_PART_NAMES[fused][part]}.{leaf}"
            full_name = f"{parent}.{part_name}" if parent else part_name
            table[full_name] = Destination(tensor, rows, split)
    return table


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the storage it loads into (a fused parameter's rows as a view);
    under tensor parallelism a sharded one holds the rank's cut only."""
    return {name: dest.data for name, dest in checkpoint_table(model).items()}


class SelfDrawn:
    """A module that draws its own dummy parameters (FP8 linears: quantized draws)."""

    def init_dummy(self, generator: torch.Generator, std: float) -> None:
        """Fill every parameter, the rank's cut of what a single rank draws."""
        raise NotImplementedError


@dataclass(frozen=True)
class CheckpointRules:
    """What a model's checkpoint table cannot say about its checkpoint."""

    label: str  # names the model in errors and logs: "target", "EAGLE-3 draft"
    # Tensors the model takes from elsewhere (a draft: the target's; a tied LM head: the
    # embedding): skipped with a log line.
    shared: frozenset[str] = frozenset()
    # Destinations the checkpoint may lack: the loader returns those it did, for the caller
    # to fill.
    optional: frozenset[str] = frozenset()


class StoredTensors(Protocol):
    """An open safetensors file (``safe_open``)."""

    def get_tensor(self, name: str) -> torch.Tensor: ...

    def get_slice(self, name: str) -> StoredSlice: ...


class StoredSlice(TensorSource, Protocol):
    """One tensor of a safetensors file, read only as far as it is indexed."""

    def get_shape(self) -> list[int]: ...

    def get_dtype(self) -> str: ...


class CheckpointFiller:
    """Fills ``model`` tensor by tensor from its checkpoint, as its ``rules`` say; ``finish``
    raises naming every problem."""

    def __init__(self, model: torch.nn.Module, rules: CheckpointRules) -> None:
        self.rules = rules
        self.table = checkpoint_table(model)
        self.pending = set(self.table)
        self.unexpected: list[str] = []

    @property
    def nbytes(self) -> int:
        return sum(dest.data.numel() * dest.data.element_size() for dest in self.table.values())

    def fill(self, name: str, tensor: torch.Tensor) -> None:
        """Fill from ``tensor``, the whole checkpoint tensor ``name``."""
        dest = self._claim(name, tuple(tensor.shape), tensor.dtype == FP8)
        if dest is not None:
            split = dest.split
            dest.data.copy_(tensor if split is None else split.take(tensor, tensor.shape))

    def fill_from(self, name: str, stored: StoredTensors) -> None:
        """Fill from tensor ``name`` of an open safetensors file, reading only the rank's cut."""
        source = stored.get_slice(name)
        shape = tuple(source.get_shape())
        dest = self._claim(name, shape, source.get_dtype() == _STORED_FP8)
        if dest is None:
            return
        if dest.split is None:
            dest.data.copy_(stored.get_tensor(name))
        else:
            dest.data.copy_(dest.split.take(source, shape))

    def _claim(self, name: str, shape: tuple[int, ...], fp8: bool) -> Destination | None:
        """The destination of checkpoint tensor ``name`` of ``shape`` (``fp8``: stored as
        float8_e4m3fn; marked filled); None for a tensor to skip or an unexpected one
        (recorded)."""
        if name.endswith(_RECOMPUTED_SUFFIXES):
            return None
        if name in self.rules.shared:
            log.info("%s checkpoint: skipping %s (shared, not loaded)", self.rules.label, name)
            return None
        if name not in self.pending:
            self.unexpected.append(f"{name} (twice)" if name in self.table else name)
            return None
        dest = self.table[name]
        expected = dest.checkpoint_shape()
        if shape != expected:
            raise ValueError(
                f"{self.rules.label}: checkpoint tensor {name} has shape {shape}, "
                f"expected {expected}"
            )
        # NOTE: a copy would cast FP8 values to and from 16 bits silently, without their scales.
        if fp8 != (dest.data.dtype == FP8):
            stored = "FP8" if fp8 else "not FP8"
            raise ValueError(
                f"{self.rules.label}: checkpoint tensor {name} is {stored}, expected "
                f"{dest.data.dtype} (is its quantization_config that of the checkpoint?)"
            )
        self.pending.discard(name)
        return dest

    def finish(self) -> frozenset[str]:
        """The optional destinations left unfilled. ValueError naming every unexpected,
        repeated or missing tensor."""
        problems = []
        if self.unexpected:
            problems.append(f"unexpected checkpoint tensors: {_listing(self.unexpected)}")
        missing = self.pending - self.rules.optional
        if missing:
            problems.append(f"missing checkpoint tensors: {_listing(missing)}")
        if problems:
            raise ValueError(f"{self.rules.label}: " + "; ".join(problems))
        return frozenset(self.pending)


def _listing(names: Iterable[str], limit: int = 20) -> str:
    ordered = sorted(names)
    more = f" and {len(ordered) - limit} more" if len(ordered) > limit else ""
    return ", ".join(ordered[:limit]) + more


def fill_checkpoint(
    model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], rules: CheckpointRules
) -> frozenset[str]:
    """Fill ``model`` from whole ``(name, tensor)`` pairs, cut here under tensor parallelism;
    returns the optional destinations left unfilled. Raises as ``CheckpointFiller`` does."""
    filler = CheckpointFiller(model, rules)
    for name, tensor in tensors:
        filler.fill(name, tensor)
    return filler.finish()


def load_checkpoint(
    model: torch.nn.Module,
    files: Sequence[Path],
    rules: CheckpointRules,
    progress: LoadProgress | None = None,
) -> frozenset[str]:
    """Fill ``model`` from safetensors ``files``, one open at a time, read onto the model's
    device; returns the optional destinations left unfilled. Raises as ``CheckpointFiller``
    does."""
    from safetensors import safe_open

    start = time.monotonic()
    device = next(model.parameters()).device
    filler = CheckpointFiller(model, rules)
    for index, file in enumerate(files, start=1):
        with safe_open(str(file), framework="pt", device=str(device)) as stored:
            for name in stored.keys():  # noqa: SIM118 (safe_open is not a mapping)
                filler.fill_from(name, stored)
        if progress is not None:
            progress(index, len(files), file.name)
    unfilled = filler.finish()
    size, seconds = _size(filler.nbytes), time.monotonic() - start
    where = ", ".join(sorted({str(file.parent) for file in files}))
    log.info("%s: loaded %s of weights from %s in %.1f s", rules.label, size, where, seconds)
    return unfilled


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def load_weights(
    model: torch.nn.Module,
    path: str | Path,
    rules: CheckpointRules,
    *,
    load_format: LoadFormat,
    progress: LoadProgress | None = None,
) -> frozenset[str]:
    """Fill ``model`` with dummy weights or from the checkpoint at ``path`` (its directory or
    config.json). Returns the destinations left for the caller: with dummy weights the
    persistent buffers (no random value means anything for them), else the optional ones the
    checkpoint lacked."""
    if load_format == "dummy":
        init_dummy(model)
        table = checkpoint_table(model).items()
        return frozenset(name for name, dest in table if not isinstance(dest.tensor, Parameter))
    return load_checkpoint(model, checkpoint_files(model_dir(path)), rules, progress)


def checkpoint_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {directory} (--load-format dummy runs without weights)"
        )
    return files


def init_dummy(model: torch.nn.Module, seed: int = 0) -> None:
    """Random parameters, deterministic per device: norms 1, everything else N(0, 0.02). A
    sharded parameter is the rank's cut of the whole one drawn in full (the same draws on
    every rank), so the sharded model is the model of a single rank."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    owners = [m for m in model.modules() if isinstance(m, NamesCheckpoint)]
    owned = {id(child) for owner in owners for child in owner.modules()}
    for module in model.modules():
        if isinstance(module, NamesCheckpoint):
            _dummy_destinations(module, generator)
        if isinstance(module, SelfDrawn):
            module.init_dummy(generator, _DUMMY_STD)
        if id(module) in owned or isinstance(module, SelfDrawn):
            continue
        for name, param in module.named_parameters(recurse=False):
            split = param_split(module, name)
            if isinstance(module, RMSNorm):
                param.data.fill_(1.0)
            elif split is None:
                param.data.normal_(0.0, _DUMMY_STD, generator=generator)
            else:
                param.data.copy_(_dummy_cut(module, param, split, generator))


def _dummy_destinations(owner: NamesCheckpoint, generator: torch.Generator) -> None:
    """Each checkpoint tensor of ``owner`` drawn whole, then the rank's cut taken (but those
    of the ``SelfDrawn`` modules in its subtree, which draw their own)."""
    assert isinstance(owner, torch.nn.Module)
    drawn = {id(p) for m in owner.modules() if isinstance(m, SelfDrawn) for p in m.parameters()}
    for dest in owner.checkpoint_destinations("").values():
        if id(dest.tensor) in drawn:
            continue
        whole = dest.data.new_empty(dest.checkpoint_shape())
        whole.normal_(0.0, _DUMMY_STD, generator=generator)
        dest.data.copy_(whole if dest.split is None else dest.split.take(whole, whole.shape))


def _dummy_cut(
    module: torch.nn.Module, param: torch.Tensor, split: Split, generator: torch.Generator
) -> torch.Tensor:
    """The rank's cut of a whole parameter drawn as a single rank draws it (a fused one
    drawn in one piece, then cut projection by projection)."""
    if not isinstance(module, FusedLinear):
        whole = param.new_empty(split.full_shape(tuple(param.shape)))
        whole.normal_(0.0, _DUMMY_STD, generator=generator)
        return split.take(whole, tuple(whole.shape))
    rows = list(module.checkpoint_rows.values())
    whole = param.new_empty((sum(rows), *param.shape[1:]))
    whole.normal_(0.0, _DUMMY_STD, generator=generator)
    parts = whole.split(rows)
    return torch.cat([split.take(part, tuple(part.shape)) for part in parts])


def default_progress() -> LoadProgress:
    """A tqdm bar when stderr is a TTY (opened at the first shard), else one log line per
    shard."""
    if not sys.stderr.isatty():

        def log_shard(index: int, count: int, name: str) -> None:
            log.info("loaded weight shard %d/%d: %s", index, count, name)

        return log_shard
    from tqdm import tqdm

    bar: tqdm | None = None

    def update_bar(index: int, count: int, name: str) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(desc="Loading weights", unit="shard", total=count)
        bar.set_postfix_str(name, refresh=False)
        bar.update(1)
        if index == count:
            bar.close()

    return update_bar
