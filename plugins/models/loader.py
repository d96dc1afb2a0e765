"""Build a model and fill it from HF safetensors, or with dummy weights (ARCHITECTURE.md 4.5).

The model is built on the meta device and materialised once in the serving dtype on the
serving device; shards are then read one at a time straight onto that device. Every
checkpoint tensor must land in a parameter and every parameter must be filled.

Under tensor parallelism each rank builds its shard of the model and reads only its cut of
each sharded tensor (safetensors slices: ``parallel.Split``); dummy weights are the same cut
of what a single rank would draw, so any world size runs the same model.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, TypeVar

import torch

from outrider.plugins.models.config import ModelConfig, model_dir
from outrider.plugins.models.kernels import TORCH_KERNELS, select_kernels, use_kernels
from outrider.plugins.models.layers import DecoderForCausalLM, FusedLinear, RMSNorm, RotaryEmbedding
from outrider.plugins.models.parallel import SINGLE, Sharded, Split, TensorSource, TPGroup
from outrider.plugins.models.registry import model_class

log = logging.getLogger(__name__)

# (shard index from 1, shard count, file name), called after each shard is loaded.
LoadProgress = Callable[[int, int, str], None]

# Checkpoint projection -> (our fused module, its shard).
_FUSED: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
_UNFUSED = {value: key for key, value in _FUSED.items()}
# Buffers some older checkpoints saved next to the weights; we recompute them.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_DUMMY_STD = 0.02


class StoredTensors(Protocol):
    """An open safetensors file (``safe_open``)."""

    def get_tensor(self, name: str) -> torch.Tensor: ...

    def get_slice(self, name: str) -> StoredSlice: ...


class StoredSlice(TensorSource, Protocol):
    """One tensor of a safetensors file, read only as far as it is indexed."""

    def get_shape(self) -> list[int]: ...


@dataclass(frozen=True)
class Target:
    """The parameter (or a fused parameter's rows) a checkpoint tensor fills, and the rank's
    cut of that tensor (None: all of it)."""

    param: torch.nn.Parameter
    rows: slice | None
    split: Split | None

    @property
    def dest(self) -> torch.Tensor:
        return self.param.data if self.rows is None else self.param.data[self.rows]

    def checkpoint_shape(self) -> tuple[int, ...]:
        local = tuple(self.dest.shape)
        return local if self.split is None else self.split.full_shape(local)


def param_split(module: torch.nn.Module, name: str) -> Split | None:
    """How ``module``'s parameter ``name`` is cut from its checkpoint tensor."""
    return module.param_split(name) if isinstance(module, Sharded) else None


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor goes: a parameter, or one shard's rows of a fused one."""

    param: str
    shard: str | None = None


def slot_for(checkpoint_name: str) -> Slot:
    module_path, _, kind = checkpoint_name.rpartition(".")
    parent, _, leaf = module_path.rpartition(".")
    if leaf in _FUSED:
        fused, shard = _FUSED[leaf]
        return Slot(f"{parent}.{fused}.{kind}", shard)
    return Slot(checkpoint_name)


def checkpoint_name(slot: Slot) -> str:
    if slot.shard is None:
        return slot.param
    module_path, _, kind = slot.param.rpartition(".")
    parent, _, fused = module_path.rpartition(".")
    return f"{parent}.{_UNFUSED[(fused, slot.shard)]}.{kind}"


class WeightFiller:
    """Tracks which parameter rows a checkpoint has filled; ``finish`` raises listing what is
    missing and what was unexpected."""

    def __init__(self, model: DecoderForCausalLM) -> None:
        self.tied = model.config.tie_word_embeddings
        self.targets: dict[Slot, Target] = {}
        for module_name, module in model.named_modules():
            for name, param in module.named_parameters(recurse=False):
                full = f"{module_name}.{name}"
                split = param_split(module, name)
                if isinstance(module, FusedLinear):
                    for shard, rows in module.shards.items():
                        self.targets[Slot(full, shard)] = Target(param, rows, split)
                else:
                    self.targets[Slot(full)] = Target(param, None, split)
        self.pending = set(self.targets)
        self.unexpected: list[str] = []

    def fill(self, name: str, tensor: torch.Tensor) -> None:
        """Fill from ``tensor``, the whole checkpoint tensor ``name``."""
        target = self._claim(name, tuple(tensor.shape))
        if target is not None:
            split = target.split
            target.dest.copy_(tensor if split is None else split.take(tensor, tensor.shape))

    def fill_from(self, name: str, stored: StoredTensors) -> None:
        """Fill from tensor ``name`` of an open safetensors file, reading only the rank's cut."""
        if not self._wanted(name):
            return
        source = stored.get_slice(name)
        shape = tuple(source.get_shape())
        target = self._claim(name, shape)
        if target is None:
            return
        if target.split is None:
            target.dest.copy_(stored.get_tensor(name))
        else:
            target.dest.copy_(target.split.take(source, shape))

    def _wanted(self, name: str) -> bool:
        # A tied checkpoint that still ships lm_head.weight: HF ties it to the embedding too.
        return not (name.endswith(_IGNORED_SUFFIXES) or (self.tied and name == "lm_head.weight"))

    def _claim(self, name: str, shape: tuple[int, ...]) -> Target | None:
        """The target of checkpoint tensor ``name`` of ``shape`` (marked filled); None for a
        tensor to skip or an unexpected one (recorded)."""
        if not self._wanted(name):
            return None
        slot = slot_for(name)
        if slot not in self.pending:
            self.unexpected.append(name if slot not in self.targets else f"{name} (twice)")
            return None
        target = self.targets[slot]
        expected = target.checkpoint_shape()
        if shape != expected:
            raise ValueError(f"checkpoint tensor {name} has shape {shape}, expected {expected}")
        self.pending.discard(slot)
        return target

    def finish(self) -> None:
        problems = []
        if self.unexpected:
            problems.append(f"unexpected checkpoint tensors: {_listing(self.unexpected)}")
        if self.pending:
            missing = [checkpoint_name(slot) for slot in self.pending]
            problems.append(f"missing checkpoint tensors: {_listing(missing)}")
        if problems:
            raise ValueError("; ".join(problems))


def _listing(names: list[str], limit: int = 20) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def build_model(
    config: ModelConfig,
    *,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TPGroup = SINGLE,
) -> DecoderForCausalLM:
    """The model (the rank's shard under tensor parallelism) with uninitialised parameters in
    ``dtype`` on ``device`` (meta: no memory). ValueError naming the flag for a group size
    that does not divide the model."""
    return materialize(
        lambda: model_class(config.architecture)(config, max_positions, tp), dtype, device
    )


M = TypeVar("M", bound=torch.nn.Module)


def materialize(build: Callable[[], M], dtype: torch.dtype, device: torch.device | str) -> M:
    """``build()`` on the meta device, then given uninitialised storage in ``dtype`` (floating
    tensors only) on ``device``, rotary tables computed, gradients off, and the layer kernels
    of that device and dtype chosen."""
    with torch.device("meta"):
        model = build()
    model = model.to(dtype=dtype).to_empty(device=device)
    head_dim = 0
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.init_table()
            head_dim = module.head_dim
    model.requires_grad_(False)
    kernels = select_kernels(torch.device(device), dtype, head_dim)
    use_kernels(model, kernels)
    if kernels is not TORCH_KERNELS:
        log.info("%s runs %s layer kernels", type(model).__name__, kernels.name)
    return model


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the parameter (or a fused parameter's rows, as a view) it loads
    into, for a model named in the HF layout. Under tensor parallelism a sharded one holds
    the rank's cut only (``checkpoint_splits``)."""
    out: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}"
            if isinstance(module, FusedLinear):
                for shard, rows in module.shards.items():
                    out[checkpoint_name(Slot(full, shard))] = param.data[rows]
            else:
                out[full] = param.data
    return out


def checkpoint_splits(model: torch.nn.Module) -> dict[str, Split]:
    """Checkpoint name -> the rank's cut of it, for the sharded tensors of
    ``checkpoint_tensors`` (none in a world of one)."""
    out: dict[str, Split] = {}
    for module_name, module in model.named_modules():
        for name, _param in module.named_parameters(recurse=False):
            split = param_split(module, name)
            if split is None:
                continue
            full = f"{module_name}.{name}"
            if isinstance(module, FusedLinear):
                for shard in module.shards:
                    out[checkpoint_name(Slot(full, shard))] = split
            else:
                out[full] = split
    return out


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    load_format: Literal["auto", "dummy"] = "auto",
    max_positions: int,
    progress: LoadProgress | None = None,
    tp: TPGroup = SINGLE,
) -> tuple[DecoderForCausalLM, ModelConfig]:
    """Load the model at ``path`` (a directory or a config.json path); under tensor
    parallelism (``tp``), this rank's shard of it. ``max_positions`` sizes the rotary tables:
    serving context length plus the largest reservation. ``progress`` defaults to
    ``default_progress()``."""
    config = ModelConfig.from_pretrained(path)
    model = build_model(config, max_positions=max_positions, dtype=dtype, device=device, tp=tp)
    if load_format == "dummy":
        init_dummy(model)
    else:
        files = checkpoint_files(model_dir(path))
        load_weights(model, files, torch.device(device), progress or default_progress())
    return model, config


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


def load_weights(
    model: DecoderForCausalLM, files: list[Path], device: torch.device, progress: LoadProgress
) -> None:
    from safetensors import safe_open

    start = time.monotonic()
    filler = WeightFiller(model)
    for index, file in enumerate(files, start=1):
        with safe_open(str(file), framework="pt", device=str(device)) as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open is not a mapping)
                filler.fill_from(name, shard)
        progress(index, len(files), file.name)
    filler.finish()
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    log.info("loaded %.2f GB of weights in %.1f s", size / 1e9, time.monotonic() - start)


def init_dummy(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights, deterministic per device: norms 1, everything else N(0, 0.02). A
    sharded parameter is the rank's cut of the whole one drawn in full (the same draws on
    every rank), so the sharded model is the model of a single rank."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            split = param_split(module, name)
            if isinstance(module, RMSNorm):
                param.data.fill_(1.0)
            elif split is None:
                param.data.normal_(0.0, _DUMMY_STD, generator=generator)
            else:
                param.data.copy_(_dummy_cut(module, param, split, generator))


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
    """A tqdm bar when stderr is a TTY, else one log line per shard."""
    if not sys.stderr.isatty():

        def log_shard(index: int, count: int, name: str) -> None:
            log.info("loaded weight shard %d/%d: %s", index, count, name)

        return log_shard
    from tqdm import tqdm

    bar = tqdm(desc="Loading weights", unit="shard", total=None)

    def update_bar(index: int, count: int, name: str) -> None:
        bar.total = count
        bar.set_postfix_str(name, refresh=False)
        bar.update(1)
        if index == count:
            bar.close()

    return update_bar


def expected_checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name (and shape) a HF checkpoint of ``config`` holds, derived from the
    config alone."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_rows, kv_rows = config.num_q_heads * head_dim, config.num_kv_heads * head_dim
    inter = config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for proj, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            shapes[f"{attn}.{proj}.weight"] = (rows, hidden)
            if config.attention_bias:
                shapes[f"{attn}.{proj}.bias"] = (rows,)
        shapes[f"{attn}.o_proj.weight"] = (hidden, q_rows)
        if config.o_proj_bias:
            shapes[f"{attn}.o_proj.bias"] = (hidden,)
        if config.qk_norm:
            shapes[f"{attn}.q_norm.weight"] = (head_dim,)
            shapes[f"{attn}.k_norm.weight"] = (head_dim,)
        shapes[f"{mlp}.gate_proj.weight"] = (inter, hidden)
        shapes[f"{mlp}.up_proj.weight"] = (inter, hidden)
        shapes[f"{mlp}.down_proj.weight"] = (hidden, inter)
        shapes[f"model.layers.{i}.input_layernorm.weight"] = (hidden,)
        shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = (hidden,)
    return shapes


def check_checkpoint_layout(config: ModelConfig, tensor_parallel_size: int = 1) -> None:
    """Run the real fill path on the meta device with the tensors a checkpoint of ``config``
    would hold, as the last rank of ``tensor_parallel_size`` would: raises as ``load_model``
    would, without allocating any weights."""
    tp = TPGroup(rank=tensor_parallel_size - 1, size=tensor_parallel_size)
    model = build_model(config, max_positions=1, dtype=torch.float32, device="meta", tp=tp)
    filler = WeightFiller(model)
    for name, shape in expected_checkpoint_shapes(config).items():
        filler.fill(name, torch.empty(shape, device="meta"))
    filler.finish()
