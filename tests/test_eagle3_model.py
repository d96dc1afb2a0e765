"""The EAGLE-3 draft against a dense reference, its save/load round trip, the public key set,
load errors, the default taps and the draft-to-target id map."""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CONFIGS
from draft_fixtures import DenseShape, dense_eagle3, draft_logits, rms
from model_fixtures import PagedRows, torch_backend
from safetensors.torch import load_file, save_file

from outrider.plugins.models.weights import checkpoint_tensors
from outrider.plugins.speculative.eagle3_model import (
    Eagle3Config,
    Eagle3Draft,
    build_eagle3,
    default_aux_layers,
    load_eagle3,
)
from recipe.export import save_eagle3

REFERENCE = CONFIGS / "Llama-3.1-8B-EAGLE3.config.json"
H, HQ, HKV, D, HT = 64, 4, 2, 16, 48
VOCAB, DRAFT_VOCAB = 300, 64
THETA = 10000.0
TINY: dict[str, Any] = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "hidden_size": H,
    "intermediate_size": 96,
    "num_hidden_layers": 1,
    "num_attention_heads": HQ,
    "num_key_value_heads": HKV,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": THETA,
    "vocab_size": VOCAB,
    "draft_vocab_size": DRAFT_VOCAB,
    "target_hidden_size": HT,
}
PUBLIC_KEYS = {
    "fc.weight",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(
        f"midlayer.{n}.weight"
        for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")
    ),
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}
SLOTS, PREFILL = (3, 0, 5), (5, 9, 2)
ATOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _draft_targets() -> torch.Tensor:
    """A non-trivial draft vocab: 64 sorted target ids out of 300."""
    gen = torch.Generator().manual_seed(7)
    return torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB].sort().values


def _random_draft(config: dict[str, Any] = TINY) -> Eagle3Draft:
    model = build_eagle3(
        Eagle3Config.from_dict(config), max_positions=64, dtype=torch.float32, device="cpu"
    )
    gen = torch.Generator().manual_seed(0)
    for name, tensor in checkpoint_tensors(model).items():
        if name.endswith("norm.weight"):
            tensor.copy_(1 + 0.1 * torch.randn(tensor.shape, generator=gen))
        elif tensor.is_floating_point():
            tensor.copy_(0.1 * torch.randn(tensor.shape, generator=gen))
    targets = _draft_targets()
    model.d2t.copy_(targets - torch.arange(DRAFT_VOCAB))
    model.t2d.zero_()
    model.t2d[targets] = True
    return model


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    total = sum(PREFILL)
    embeds = torch.randn(total, H, generator=gen)
    features = torch.randn(total, 3 * HT, generator=gen)
    step_embeds = torch.randn(len(SLOTS), H, generator=gen)
    return embeds, features, step_embeds


def _prefill_then_step(model: Eagle3Draft) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefill every row, then one token per row whose feat is the row's last output (as
    while drafting): ``(feat [T, H], y_prefill [T, H], y_step [bs, H])``."""
    embeds, features, step_embeds = _inputs()
    rows = PagedRows(num_layers=1, shape=model.attention_shape, page_size=4, max_len=16)
    backend = torch_backend(model.attention_shape)
    with torch.no_grad():
        _, fb = rows.batch(backend, [(s, [0] * n) for s, n in zip(SLOTS, PREFILL, strict=True)])
        feat = model.project(features)
        y = model(embeds, feat, fb)
        last = torch.tensor(PREFILL).cumsum(0) - 1
        _, fb = rows.batch(backend, [(s, [0]) for s in SLOTS], kv_slack=3)
        y_step = model(step_embeds, y[last], fb)
    return feat, y, y_step


@pytest.mark.parametrize(
    "flags",
    [{}, {"norm_before_residual": True}, {"norm_before_fc": True}],
    ids=["plain", "norm_before_residual", "norm_before_fc"],
)
def test_forward_matches_dense_reference(flags: dict[str, bool]) -> None:
    """The draft's prefill, step and logits against the dense reference; with
    ``norm_before_residual`` (written in ``eagle_config``) the residual is the normed feat,
    with ``norm_before_fc`` the taps are normalized by ``input_norm`` before ``fc``."""
    model = _random_draft(TINY | {"eagle_config": flags})
    assert model.config.norm_before_residual == flags.get("norm_before_residual", False)
    assert model.config.norm_before_fc == flags.get("norm_before_fc", False)
    shape = DenseShape.of(model.config)
    w = checkpoint_tensors(model)
    embeds, features, step_embeds = _inputs()
    feat, y, y_step = _prefill_then_step(model)
    taps = features
    if model.config.norm_before_fc:
        taps = rms(features, w["input_norm.weight"], shape.eps)
    torch.testing.assert_close(feat, taps @ w["fc.weight"].T, atol=ATOL, rtol=0)
    starts = [0, *torch.tensor(PREFILL).cumsum(0).tolist()]
    for row, (a, b) in enumerate(itertools.pairwise(starts)):
        ref = dense_eagle3(w, embeds[a:b], feat[a:b], shape)
        torch.testing.assert_close(y[a:b], ref, atol=ATOL, rtol=0)
        # The step token reads the cached K/V of the row's prefill.
        ref_step = dense_eagle3(
            w,
            torch.cat((embeds[a:b], step_embeds[row : row + 1])),
            torch.cat((feat[a:b], ref[-1:])),
            shape,
        )
        torch.testing.assert_close(y_step[row], ref_step[-1], atol=ATOL, rtol=0)
    with torch.no_grad():
        logits = model.compute_logits(y)
    ref_logits = draft_logits(w, y, shape)
    assert logits.dtype == torch.float32 and logits.shape == (sum(PREFILL), DRAFT_VOCAB)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)


def test_save_load_round_trip(tmp_path: Path) -> None:
    model = _random_draft()
    with pytest.raises(ValueError, match="hidden_size"):
        save_eagle3(model, tmp_path, {"hidden_size": 32})
    # A target-like template: the draft's identity is set, its shape filled in.
    template = {"num_hidden_layers": 36, "eos_token_id": 2, "eagle_config": {"note": "kept"}}
    save_eagle3(model, tmp_path, template)
    assert set(load_file(tmp_path / "model.safetensors")) == PUBLIC_KEYS
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLMEagle3"]
    assert written["num_hidden_layers"] == 1 and written["draft_vocab_size"] == DRAFT_VOCAB
    assert written["eagle_config"] == {"note": "kept"}
    loaded = load_eagle3(tmp_path, dtype=torch.float32, device="cpu", max_positions=64)
    assert loaded.config.target_hidden_size == HT
    assert loaded.attention_shape == model.attention_shape
    for name, tensor in checkpoint_tensors(model).items():
        assert torch.equal(checkpoint_tensors(loaded)[name], tensor), name
    for got, expected in zip(_prefill_then_step(loaded), _prefill_then_step(model), strict=True):
        assert torch.equal(got, expected)


def test_reference_config_builds_on_meta() -> None:
    config = Eagle3Config.from_pretrained(REFERENCE)
    assert (config.draft_vocab_size, config.target_hidden_size) == (32000, 4096)
    assert config.aux_layer_ids is None and config.model.vocab_size == 128256
    model = build_eagle3(config, max_positions=4096, dtype=torch.bfloat16, device="meta")
    tensors = checkpoint_tensors(model)
    assert set(tensors) == PUBLIC_KEYS
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers()))
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    assert shapes["fc.weight"] == (4096, 12288)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (4096, 8192)
    assert shapes["midlayer.self_attn.k_proj.weight"] == (1024, 8192)
    assert shapes["midlayer.self_attn.o_proj.weight"] == (4096, 4096)
    assert shapes["lm_head.weight"] == (32000, 4096)
    assert shapes["d2t"] == (32000,) and shapes["t2d"] == (128256,)
    assert model.d2t.dtype == torch.int64 and model.t2d.dtype == torch.bool
    assert model.attention_shape.num_kv_heads == 8 and model.head_dim == 128


def _edit_checkpoint(directory: Path, edit: dict[str, torch.Tensor | None]) -> None:
    file = directory / "model.safetensors"
    tensors = load_file(file)
    for name, tensor in edit.items():
        if tensor is None:
            tensors.pop(name)
        else:
            tensors[name] = tensor
    save_file(tensors, file, metadata={"format": "pt"})


def _load(directory: Path) -> Eagle3Draft:
    return load_eagle3(directory, dtype=torch.float32, device="cpu", max_positions=64)


def test_load_errors_name_the_key(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save_eagle3(_random_draft(), tmp_path, {})
    _edit_checkpoint(tmp_path, {"embed_tokens.weight": torch.zeros(VOCAB, H)})
    with caplog.at_level(logging.INFO):
        _load(tmp_path)  # the shared embedding is skipped, with a log line
    assert "embed_tokens.weight" in caplog.text
    _edit_checkpoint(tmp_path, {"midlayer.extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"unexpected checkpoint tensors: midlayer\.extra\.weight"):
        _load(tmp_path)
    _edit_checkpoint(tmp_path, {"midlayer.extra.weight": None, "midlayer.hidden_norm.weight": None})
    with pytest.raises(ValueError, match=r"missing checkpoint tensors: midlayer\.hidden_norm"):
        _load(tmp_path)
    _edit_checkpoint(tmp_path, {"midlayer.hidden_norm.weight": torch.ones(H + 1)})
    with pytest.raises(ValueError, match=r"midlayer\.hidden_norm\.weight has shape \(65,\)"):
        _load(tmp_path)
    _edit_checkpoint(tmp_path, {"midlayer.hidden_norm.weight": torch.ones(H), "d2t": None})
    with pytest.raises(ValueError, match=r"missing checkpoint tensors: d2t"):
        _load(tmp_path)


@pytest.mark.parametrize(
    ("key", "value"),
    [("fc_norm", True), ("norm_output", True), ("use_aux_hidden_state", False)],
)  # fmt: skip
@pytest.mark.parametrize("nested", [False, True], ids=["top", "eagle_config"])
def test_other_layouts_are_refused_by_name(key: str, value: bool, nested: bool) -> None:
    """A flag of another EAGLE-3 layout, at the config's top or in ``eagle_config``, is
    refused naming it; the value this layout serves, and the flag's absence, load."""

    def config(v: bool) -> dict[str, Any]:
        return TINY | ({"eagle_config": {key: v}} if nested else {key: v})

    with pytest.raises(ValueError) as refused:
        Eagle3Config.from_dict(config(value))
    assert str(refused.value) == (
        f"an EAGLE-3 draft with {key} {str(value).lower()} is not supported: its arithmetic "
        "differs from the LlamaForCausalLMEagle3 layout served here"
    )
    Eagle3Config.from_dict(config(not value))
    Eagle3Config.from_dict(TINY)


def test_norm_before_residual_reads_eagle_config_first() -> None:
    """Where both levels write it, ``eagle_config``'s value holds (a publisher's nested
    flags are the checkpoint's own)."""
    both = TINY | {"norm_before_residual": False, "eagle_config": {"norm_before_residual": True}}
    assert Eagle3Config.from_dict(both).norm_before_residual
    assert Eagle3Config.from_dict(TINY | {"norm_before_residual": True}).norm_before_residual
    assert not Eagle3Config.from_dict(TINY).norm_before_residual


def test_a_draft_with_norm_before_fc_round_trips(tmp_path: Path) -> None:
    """The public layout plus ``input_norm.weight`` [3*H_t], and both flags in the config
    written; the loaded draft runs as the saved one."""
    model = _random_draft(TINY | {"norm_before_fc": True, "norm_before_residual": True})
    save_eagle3(model, tmp_path, {})
    assert set(load_file(tmp_path / "model.safetensors")) == PUBLIC_KEYS | {"input_norm.weight"}
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["norm_before_fc"] is True and written["norm_before_residual"] is True
    loaded = load_eagle3(tmp_path, dtype=torch.float32, device="cpu", max_positions=64)
    assert tuple(checkpoint_tensors(loaded)["input_norm.weight"].shape) == (3 * HT,)
    for got, expected in zip(_prefill_then_step(loaded), _prefill_then_step(model), strict=True):
        assert torch.equal(got, expected)


def test_default_and_explicit_aux_layers() -> None:
    assert default_aux_layers(36) == (1, 17, 32)
    assert default_aux_layers(32) == (1, 15, 28)
    with pytest.raises(ValueError, match="collide"):
        default_aux_layers(6)
    config = Eagle3Config.from_dict(
        {**TINY, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 5, 9]}}
    )
    assert config.aux_layer_ids == (2, 5, 9)
    with pytest.raises(ValueError, match="3 layers"):
        Eagle3Config.from_dict({**TINY, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1]}})


def test_to_target_ids(tmp_path: Path) -> None:
    model = _random_draft()
    targets = _draft_targets()
    ids = torch.tensor([[0, 5, 63], [17, 17, 1]])
    assert torch.equal(model.to_target_ids(ids), targets[ids])
    assert bool(model.t2d[model.to_target_ids(torch.arange(DRAFT_VOCAB))].all())
    # Dummy weights map draft id i to target id i.
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    dummy = load_eagle3(
        tmp_path, dtype=torch.float32, device="cpu", max_positions=64, load_format="dummy"
    )
    assert torch.equal(dummy.to_target_ids(ids), ids)
    assert torch.equal(dummy.t2d, torch.arange(VOCAB) < DRAFT_VOCAB)
    assert bool((dummy.norm.weight == 1).all())


def test_same_vocab_needs_no_map(tmp_path: Path) -> None:
    config = {**TINY, "draft_vocab_size": VOCAB}
    model = build_eagle3(
        Eagle3Config.from_dict(config), max_positions=64, dtype=torch.float32, device="cpu"
    )
    for tensor in checkpoint_tensors(model).values():
        tensor.fill_(1 if tensor.dtype == torch.bool else 0)
    save_eagle3(model, tmp_path, config)
    _edit_checkpoint(tmp_path, {"d2t": None, "t2d": None})
    loaded = _load(tmp_path)
    ids = torch.tensor([0, 150, VOCAB - 1])
    assert torch.equal(loaded.to_target_ids(ids), ids)
