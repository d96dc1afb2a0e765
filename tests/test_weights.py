"""The one weight loader (plugins/models/weights.py) on a tiny module: a fused gate/up
projection, a row-parallel one and a persistent buffer, read whole or as a rank's cut."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from outrider.plugins.models.layers import FusedLinear
from outrider.plugins.models.parallel import SINGLE, RowParallelLinear, TPGroup
from outrider.plugins.models.weights import CheckpointRules, fill_checkpoint, load_checkpoint

HIDDEN, INTER = 4, 6
RULES = CheckpointRules("tiny", shared=frozenset({"embed.weight"}), optional=frozenset({"d2t"}))


def _tiny(tp: TPGroup) -> nn.Module:
    model = nn.Module()
    model.mlp = nn.ModuleDict(
        {
            "gate_up_proj": FusedLinear(HIDDEN, {"gate": INTER, "up": INTER}, False, tp),
            "down_proj": RowParallelLinear(INTER, HIDDEN, False, tp),
        }
    )
    model.register_buffer("d2t", torch.zeros(3, dtype=torch.int64))
    return model.requires_grad_(False)


def _checkpoint() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "mlp.gate_proj.weight": torch.randn(INTER, HIDDEN, generator=gen),
        "mlp.up_proj.weight": torch.randn(INTER, HIDDEN, generator=gen),
        "mlp.down_proj.weight": torch.randn(HIDDEN, INTER, generator=gen),
        "d2t": torch.arange(3),
    }


def test_files_and_pairs_fill_the_same_cut(tmp_path: Path) -> None:
    tensors = _checkpoint()
    save_file(tensors, tmp_path / "model.safetensors")
    from_pairs, from_file = _tiny(TPGroup(1, 2)), _tiny(TPGroup(1, 2))
    assert fill_checkpoint(from_pairs, tensors.items(), RULES) == frozenset()
    assert load_checkpoint(from_file, [tmp_path / "model.safetensors"], RULES) == frozenset()
    # Rank 1 of 2: the second half of each fused part's rows, of down_proj's columns.
    gate, up = tensors["mlp.gate_proj.weight"], tensors["mlp.up_proj.weight"]
    assert torch.equal(from_file.mlp.gate_up_proj.weight, torch.cat([gate[3:], up[3:]]))
    assert torch.equal(from_file.mlp.down_proj.weight, tensors["mlp.down_proj.weight"][:, 3:])
    assert torch.equal(from_file.d2t, tensors["d2t"])
    pairs, files = from_pairs.state_dict().items(), from_file.state_dict().items()
    for (name, a), (_, b) in zip(pairs, files, strict=True):
        assert torch.equal(a, b), name


def test_every_problem_in_one_error(caplog: pytest.LogCaptureFixture) -> None:
    tensors = _checkpoint()
    down = tensors.pop("mlp.down_proj.weight")
    extra = [
        ("mlp.up_proj.weight", tensors["mlp.up_proj.weight"]),
        ("extra.weight", torch.zeros(1)),
        ("embed.weight", torch.zeros(1)),
    ]
    problems = (
        r"^tiny: unexpected checkpoint tensors: extra\.weight, mlp\.up_proj\.weight \(twice\); "
        r"missing checkpoint tensors: mlp\.down_proj\.weight$"
    )
    with caplog.at_level(logging.INFO), pytest.raises(ValueError, match=problems):
        fill_checkpoint(_tiny(SINGLE), [*tensors.items(), *extra], RULES)
    assert "skipping embed.weight" in caplog.text
    tensors["mlp.down_proj.weight"] = down
    del tensors["d2t"]
    assert fill_checkpoint(_tiny(SINGLE), tensors.items(), RULES) == {"d2t"}
    wrong = r"^tiny: checkpoint tensor d2t has shape \(4,\), expected \(3,\)$"
    with pytest.raises(ValueError, match=wrong):
        fill_checkpoint(_tiny(SINGLE), [("d2t", torch.arange(4))], RULES)
