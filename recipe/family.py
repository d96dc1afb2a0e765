"""Stage ``family``: the exports gathered into the ``outrider-family`` distribution.

Copies ``target/model``, ``eagle3/model`` and ``dflash/model`` (the exported files only) into
``family/outrider_family/{target,eagle3,dflash}`` of the repository, and writes there the
evaluation prompts, ``heldout_prompts.jsonl``: the first ``count`` held-out conversations (file
order) whose opening user turn, rendered through the chat template with the generation prompt,
takes at most ``max_prompt_tokens`` tokens. Rows: ``{"id", "messages"}`` (that one user turn).
The held-out split is never trained on, so these prompts measure acceptance honestly.

``adopt_target`` goes the other way: it records the shipped target as the ``target`` stage's
output under the default config, so that the later stages (answers, drafts) can be rerun
against the very weights the family ships, without retraining the target.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from recipe import chat, data, model, target
from recipe.manifest import Manifest, Produced, input_hashes, require, run_once, sha256_file
from recipe.regenerate import encode_prompt

PROMPTS = "heldout_prompts.jsonl"
PARTS = {"target": "target/model", "eagle3": "eagle3/model", "dflash": "dflash/model"}
VERSION = 1


@dataclass(frozen=True)
class FamilyConfig:
    count: int = 100
    max_prompt_tokens: int = 256


def heldout_prompts(out: Path, config: FamilyConfig) -> list[dict[str, object]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out / PARTS["target"])
    rows: list[dict[str, object]] = []
    for conversation in data.read_jsonl(out / "data" / data.HELDOUT):
        first = conversation.messages[0]
        assert first["role"] == chat.USER, conversation.id
        if len(encode_prompt(tokenizer, [first])) <= config.max_prompt_tokens:
            rows.append({"id": conversation.id, "messages": [first]})
            if len(rows) == config.count:
                break
    return rows


def run(config: FamilyConfig, out: Path, dest: Path) -> Manifest | None:
    """Gather the family into ``dest`` (``family/outrider_family``), which is also the stage
    directory: its manifest ships with the weights and records where they came from."""
    upstream = [require(out / stage, stage) for stage in ("data", *PARTS)]

    def produce(stage_dir: Path) -> Produced:
        names: list[str] = []
        for part, path in PARTS.items():
            source, target_dir = out / path, stage_dir / part
            shutil.rmtree(target_dir, ignore_errors=True)
            target_dir.mkdir(parents=True)
            for f in sorted(source.iterdir()):
                shutil.copyfile(f, target_dir / f.name)
                names.append(f"{part}/{f.name}")
        prompts = heldout_prompts(out, config)
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in prompts)
        (stage_dir / PROMPTS).write_text(text, encoding="utf-8")
        return Produced(outputs=[*names, PROMPTS], stats={"prompts": len(prompts)})

    config_dict = {**asdict(config), "version": VERSION}
    return run_once("family", dest, config_dict, input_hashes(*upstream), produce)


def adopt_target(out: Path, source: Path) -> Manifest | None:
    """Stage 3 from the shipped family in ``source``: its target files, checked against the
    hashes its manifest records, become ``out/target/model``, provided ``out``'s data and
    tokenizer are the ones the family was built from."""
    shipped = Manifest.read(source)
    if shipped is None:
        raise FileNotFoundError(f"no family manifest in {source}")
    upstream = target.stage_inputs(out)
    # data/<file> was recorded as is, tokenizer/<file> as its copy in the target's export
    expected = {
        name: shipped.inputs[name if stage == "data" else f"{PARTS['target']}/{file}"]
        for name in upstream
        for stage, _, file in [name.partition("/")]
    }
    differing = sorted(name for name, digest in expected.items() if upstream[name] != digest)
    if differing:
        raise ValueError(f"{out} was not what the family was built from: {differing} differ")
    for name in model.EXPORT_FILES:
        if sha256_file(source / "target" / name) != shipped.outputs[f"target/{name}"]:
            raise ValueError(f"{source / 'target' / name} differs from the family manifest")

    def produce(stage_dir: Path) -> Produced:
        export = stage_dir / target.EXPORT_DIR
        export.mkdir(exist_ok=True)
        for name in model.EXPORT_FILES:
            shutil.copyfile(source / "target" / name, export / name)
        stats = {"adopted_from": str(source), "family_key": shipped.key}
        return Produced([f"{target.EXPORT_DIR}/{name}" for name in model.EXPORT_FILES], stats)

    identity = target.stage_identity(target.TargetConfig())
    return run_once("target", out / "target", identity, upstream, produce)
