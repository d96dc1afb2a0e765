"""Stage manifests: what a stage was asked to do and the sha256 of what it wrote.

A stage is complete when ``<out>/<stage>/manifest.json`` records the same key (a hash of the
stage's config and of its inputs' hashes) and every output it lists still has its recorded
sha256. Re-running a complete stage is then a no-op, which is what makes the recipe resumable.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def stage_key(config: dict[str, Any], inputs: dict[str, str]) -> str:
    """The identity of a stage run: its config and the hashes of the files it reads."""
    return hashlib.sha256(canonical_json({"config": config, "inputs": inputs}).encode()).hexdigest()


@dataclass(frozen=True)
class Manifest:
    stage: str
    key: str
    config: dict[str, Any]
    inputs: dict[str, str]  # input file (relative to the output root) -> sha256
    outputs: dict[str, str]  # output file (relative to the stage directory) -> sha256
    stats: dict[str, Any] = field(default_factory=dict)

    def write(self, stage_dir: Path) -> None:
        text = json.dumps(self.__dict__, sort_keys=True, indent=2, ensure_ascii=False) + "\n"
        (stage_dir / MANIFEST).write_text(text, encoding="utf-8")

    @classmethod
    def read(cls, stage_dir: Path) -> Manifest | None:
        path = stage_dir / MANIFEST
        if not path.is_file():
            return None
        return cls(**json.loads(path.read_text(encoding="utf-8")))

    def outputs_intact(self, stage_dir: Path) -> bool:
        return all(
            (stage_dir / name).is_file() and sha256_file(stage_dir / name) == digest
            for name, digest in self.outputs.items()
        )


def hash_outputs(stage_dir: Path, names: list[str]) -> dict[str, str]:
    return {name: sha256_file(stage_dir / name) for name in sorted(names)}


def completed(stage_dir: Path, key: str) -> Manifest | None:
    """The stage's manifest if it recorded ``key`` and its outputs are intact, else None."""
    manifest = Manifest.read(stage_dir)
    if manifest is None or manifest.key != key or not manifest.outputs_intact(stage_dir):
        return None
    return manifest


def require(stage_dir: Path, stage: str) -> Manifest:
    """The manifest of an upstream stage, which must be complete and intact."""
    manifest = Manifest.read(stage_dir)
    if manifest is None:
        raise FileNotFoundError(f"stage {stage!r} has not run: no {stage_dir / MANIFEST}")
    if not manifest.outputs_intact(stage_dir):
        raise ValueError(f"outputs of stage {stage!r} in {stage_dir} differ from its manifest")
    return manifest


def input_hashes(*manifests: Manifest) -> dict[str, str]:
    """Upstream outputs as inputs: ``<stage>/<file>`` -> sha256."""
    return {f"{m.stage}/{name}": digest for m in manifests for name, digest in m.outputs.items()}


@dataclass(frozen=True)
class Produced:
    """What a stage wrote into its directory, and figures worth keeping."""

    outputs: list[str]
    stats: dict[str, Any]


def run_once(
    stage: str,
    stage_dir: Path,
    config: dict[str, Any],
    inputs: dict[str, str],
    produce: Callable[[Path], Produced | None],
) -> Manifest | None:
    """Run ``produce`` unless the stage already completed with this config and these inputs.
    ``produce`` returns None when it stopped before finishing (a resumable stage): no manifest
    is written then. Returns the manifest of the completed stage, or None."""
    key = stage_key(config, inputs)
    done = completed(stage_dir, key)
    if done is not None:
        print(f"[{stage}] complete with this config, skipped ({stage_dir / MANIFEST})")
        return done
    stage_dir.mkdir(parents=True, exist_ok=True)
    (stage_dir / MANIFEST).unlink(missing_ok=True)
    produced = produce(stage_dir)
    if produced is None:
        return None
    outputs = hash_outputs(stage_dir, produced.outputs)
    manifest = Manifest(stage, key, config, inputs, outputs, produced.stats)
    manifest.write(stage_dir)
    print(f"[{stage}] done: {stage_dir / MANIFEST}")
    return manifest
