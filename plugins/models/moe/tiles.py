"""Tile configurations of the fused MoE GEMMs (``moe/kernels.py``): the record, the JSON tables
shipped in ``moe/configs/`` and the lookup.

A table file serves one GPU: ``<device name>.json`` (the name as torch reports it, spaces as
underscores, written by ``moe/tune.py``), else ``sm<major><minor>.json`` for its generation. It
maps an MoE shape (``MoeShape.key``) or ``"default"`` to token buckets, each to a config:

    {"tuned": false, "note": "...",
     "shapes": {"experts=128,hidden=2048,intermediate=768,topk=8":
                    {"64": {"block_m": 16, "gate_up": {...tiles}, "down": {...tiles}}, ...}}}

A batch of T tokens takes the smallest bucket >= T, else the largest. Where no file or no
entry serves a shape, ``heuristic_config`` does, from the average rows an expert receives.

A file's ``"decode"`` maps a shape to its decode path (``DecodePath``): the largest batch the
GEMVs serve faster than the grouped GEMMs, and their tiles. The crossover is a property of
the shape: the GEMVs read each pair's expert once, so they win while a batch's pairs land
on distinct experts (measured on an H200: through 16 tokens of Qwen3-30B-A3B's 128 experts,
8 a token; 1 token of Mixtral's 8 experts, 2 a token). Where no file names a shape,
``DecodePath.default``.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
import triton

CONFIG_DIR = Path(__file__).parent / "configs"
DEFAULT_SHAPE = "default"


@dataclass(frozen=True)
class MoeShape:
    """One MoE layer as its kernels see it (per tensor-parallel rank: ``intermediate`` is the
    shard's)."""

    experts: int
    hidden: int
    intermediate: int
    topk: int

    @property
    def key(self) -> str:
        return (
            f"experts={self.experts},hidden={self.hidden},"
            f"intermediate={self.intermediate},topk={self.topk}"
        )


@dataclass(frozen=True)
class GemmTiles:
    """One grouped GEMM's launch: output columns and reduction step a program, programs
    grouped along M for L2 reuse, warps, pipeline stages."""

    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class GemvTiles:
    """The decode path's GEMVs: output rows a program, reduction step (at most the reduced
    length's power of two), warps, pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def step(self, k: int) -> int:
        return min(self.block_k, triton.next_power_of_2(k))


# Where no table names a shape: the decode path up to this many (token, slot) pairs, with
# the tiles that were fastest at one token for both shapes timed (Qwen3-30B-A3B, Mixtral).
DEFAULT_DECODE_PAIRS = 64
DEFAULT_DECODE_TILES = GemvTiles(block_n=4, block_k=1024, num_warps=4, num_stages=3)


@dataclass(frozen=True)
class DecodePath:
    """One shape's decode path: batches of up to ``max_tokens`` tokens take the GEMVs with
    ``tiles`` (0: none does), larger ones the grouped GEMMs."""

    max_tokens: int
    tiles: GemvTiles

    def to_json(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "tiles": asdict(self.tiles)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> DecodePath:
        return cls(raw["max_tokens"], GemvTiles(**raw["tiles"]))

    @classmethod
    def default(cls, shape: MoeShape) -> DecodePath:
        return cls(max(1, DEFAULT_DECODE_PAIRS // shape.topk), DEFAULT_DECODE_TILES)


@dataclass(frozen=True)
class MoeKernelConfig:
    """Both GEMMs of one MoE layer. They share ``block_m``: the rows are aligned to it once."""

    block_m: int
    gate_up: GemmTiles
    down: GemmTiles

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> MoeKernelConfig:
        return cls(raw["block_m"], GemmTiles(**raw["gate_up"]), GemmTiles(**raw["down"]))


Table = dict[str, dict[int, MoeKernelConfig]]  # shape key -> token bucket -> config
DecodeTable = dict[str, DecodePath]  # shape key -> its decode path


def load_table(path: Path) -> Table:
    """A table file's shapes (its ``tuned`` flag and note are for people)."""
    raw = json.loads(path.read_text())
    return {
        shape: {int(bucket): MoeKernelConfig.from_json(cfg) for bucket, cfg in buckets.items()}
        for shape, buckets in raw["shapes"].items()
    }


def load_decode(path: Path) -> DecodeTable:
    """A table file's decode paths (none in a file that names none)."""
    raw = json.loads(path.read_text()).get("decode", {})
    return {shape: DecodePath.from_json(entry) for shape, entry in raw.items()}


def pick_bucket(buckets: dict[int, MoeKernelConfig], tokens: int) -> MoeKernelConfig:
    """The config of the smallest bucket >= ``tokens``, else of the largest."""
    fitting = [b for b in buckets if b >= tokens]
    return buckets[min(fitting) if fitting else max(buckets)]


def heuristic_config(shape: MoeShape, tokens: int) -> MoeKernelConfig:
    """A config from the average rows an expert receives: small row blocks and long reduction
    steps while the GEMMs read weights at memory speed, larger square tiles once they compute."""
    rows = tokens * shape.topk / shape.experts
    if rows <= 16:
        tiles = GemmTiles(block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
        return MoeKernelConfig(16, tiles, tiles)
    if rows <= 64:
        tiles = GemmTiles(block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3)
        return MoeKernelConfig(32, tiles, tiles)
    if rows <= 256:
        tiles = GemmTiles(block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
        return MoeKernelConfig(64, tiles, tiles)
    # Gate/up holds two accumulators a program: half the columns of the down GEMM's.
    return MoeKernelConfig(
        128,
        GemmTiles(block_n=64, block_k=64, group_m=16, num_warps=8, num_stages=3),
        GemmTiles(block_n=128, block_k=64, group_m=16, num_warps=8, num_stages=3),
    )


def table_file_names(device_name: str, capability: tuple[int, int]) -> tuple[str, str]:
    """The files that may serve a GPU, most specific first."""
    return f"{device_file_stem(device_name)}.json", f"sm{capability[0]}{capability[1]}.json"


def device_file_stem(device_name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"NVIDIA_H100_80GB_HBM3"``."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", device_name).strip("_")


def table_file_for_gpu(
    device_name: str, capability: tuple[int, int], directory: Path
) -> Path | None:
    """The first file of ``table_file_names`` in ``directory``; None if none is there."""
    paths = [directory / name for name in table_file_names(device_name, capability)]
    return next((path for path in paths if path.exists()), None)


def table_for_gpu(device_name: str, capability: tuple[int, int], directory: Path) -> Table:
    """The table of ``table_file_for_gpu``; empty if none."""
    path = table_file_for_gpu(device_name, capability, directory)
    return load_table(path) if path else {}


@cache
def _device_file(index: int) -> Path | None:
    name = torch.cuda.get_device_name(index)
    return table_file_for_gpu(name, torch.cuda.get_device_capability(index), CONFIG_DIR)


@cache
def _device_table(index: int) -> Table:
    path = _device_file(index)
    return load_table(path) if path else {}


@cache
def _device_decode(index: int) -> DecodeTable:
    path = _device_file(index)
    return load_decode(path) if path else {}


def _cuda_index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def config_from_table(table: Table, shape: MoeShape, tokens: int) -> MoeKernelConfig:
    """The table's config for ``shape`` at ``tokens`` (its entry, else its default entry),
    else the heuristic's."""
    buckets = table.get(shape.key) or table.get(DEFAULT_SHAPE)
    return pick_bucket(buckets, tokens) if buckets else heuristic_config(shape, tokens)


def config_for(shape: MoeShape, tokens: int, device: torch.device) -> MoeKernelConfig:
    """The config of a batch of ``tokens`` on ``device`` (its GPU's files read once; the
    heuristic elsewhere: the CPU interpreter)."""
    if device.type != "cuda":
        return heuristic_config(shape, tokens)
    return config_from_table(_device_table(_cuda_index(device)), shape, tokens)


def decode_for(shape: MoeShape, device: torch.device) -> DecodePath:
    """``shape``'s decode path on ``device`` (its GPU's table, else the default; the default
    elsewhere: the CPU interpreter)."""
    if device.type != "cuda":
        return DecodePath.default(shape)
    return _device_decode(_cuda_index(device)).get(shape.key) or DecodePath.default(shape)
