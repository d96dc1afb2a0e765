"""The DFlash draft against a dense reference (context K/V from target features, a non-causal
block over paged KV), its save/load round trip, the public key set, the reference config on
the meta device, the default taps and the config and load errors."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import CONFIGS
from model_fixtures import PagedRows, torch_backend
from safetensors.torch import load_file, save_file

from outrider.plugins.models.weights import checkpoint_tensors
from outrider.plugins.speculative.dflash_model import (
    DFlashConfig,
    DFlashDraft,
    build_dflash,
    default_target_layers,
    load_dflash,
)
from recipe.export import save_dflash

REFERENCE = CONFIGS / "Qwen3-8B-DFlash-b16.config.json"
H, HQ, HKV, D, HT, LAYERS = 64, 4, 2, 16, 48, 2
VOCAB, BLOCK, MASK = 300, 4, 299
TAPS = (1, 3, 5)
EPS, THETA = 1e-6, 10000.0
TINY: dict[str, Any] = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": H,
    "intermediate_size": 96,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HQ,
    "num_key_value_heads": HKV,
    "head_dim": D,
    "max_position_embeddings": 256,
    "rms_norm_eps": EPS,
    "rope_theta": THETA,
    "vocab_size": VOCAB,
    "block_size": BLOCK,
    "num_target_layers": 8,
    "target_hidden_size": HT,
    "dflash_config": {"mask_token_id": MASK, "target_layer_ids": list(TAPS)},
}
SLOTS, CONTEXT = (3, 0), (5, 9)  # two rows of different context lengths
COMMIT = (2, 4)  # tokens each row commits before its second block
ATOL = 1e-5


def _public_keys(num_layers: int) -> set[str]:
    per_layer = [
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    layers = {f"layers.{i}.{name}" for i in range(num_layers) for name in per_layer}
    return {"fc.weight", "hidden_norm.weight", "norm.weight", *layers}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _random_draft(config: dict[str, Any] = TINY) -> DFlashDraft:
    model = build_dflash(
        DFlashConfig.from_dict(config), max_positions=64, dtype=torch.float32, device="cpu"
    )
    gen = torch.Generator().manual_seed(0)
    for name, tensor in sorted(checkpoint_tensors(model).items()):
        if name.endswith("norm.weight"):
            tensor.copy_(1 + 0.1 * torch.randn(tensor.shape, generator=gen))
        else:
            tensor.copy_(0.1 * torch.randn(tensor.shape, generator=gen))
    return model


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D], rotate-half convention
    inv_freq = 1.0 / THETA ** (torch.arange(0, D, 2).float() / D)
    angles = positions.float()[:, None] * inv_freq  # [T, D/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _dense_block(
    w: dict[str, torch.Tensor], features: torch.Tensor, embeds: torch.Tensor
) -> torch.Tensor:
    """One row: context ``features [n, 3*HT]`` at positions 0 .. n-1, then the block ``embeds
    [B, H]`` at n .. n+B-1 attending to all of context and block -> normed ``[B, H]``."""
    n, b = features.shape[0], embeds.shape[0]
    ctx_pos, block_pos = torch.arange(n), torch.arange(n, n + b)
    ctx = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])  # [n, H]
    x = embeds
    for i in range(LAYERS):
        a, p = f"layers.{i}.self_attn", f"layers.{i}.mlp"

        def kv(src: torch.Tensor, pos: torch.Tensor, a: str = a) -> tuple[torch.Tensor, ...]:
            k = (src @ w[f"{a}.k_proj.weight"].T).view(-1, HKV, D)
            v = (src @ w[f"{a}.v_proj.weight"].T).view(-1, HKV, D)
            return _rope(_rms(k, w[f"{a}.k_norm.weight"]), pos), v

        hn = _rms(x, w[f"layers.{i}.input_layernorm.weight"])
        q = _rms((hn @ w[f"{a}.q_proj.weight"].T).view(b, HQ, D), w[f"{a}.q_norm.weight"])
        q = _rope(q, block_pos).transpose(0, 1)  # [HQ, B, D]
        (k_ctx, v_ctx), (k_blk, v_blk) = kv(ctx, ctx_pos), kv(hn, block_pos)
        k = torch.cat((k_ctx, k_blk)).transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        v = torch.cat((v_ctx, v_blk)).transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        scores = (q @ k.transpose(1, 2)) / D**0.5  # [HQ, B, n+B]: no mask
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(b, HQ * D)
        h = x + attn @ w[f"{a}.o_proj.weight"].T
        m = _rms(h, w[f"layers.{i}.post_attention_layernorm.weight"])
        gate, up = m @ w[f"{p}.gate_proj.weight"].T, m @ w[f"{p}.up_proj.weight"].T
        x = h + (F.silu(gate) * up) @ w[f"{p}.down_proj.weight"].T
    return _rms(x, w["norm.weight"])


def _inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    bs = len(SLOTS)
    return {
        "ctx1": torch.randn(sum(CONTEXT), len(TAPS) * HT, generator=gen),
        "block1": torch.randn(bs * BLOCK, H, generator=gen),
        "ctx2": torch.randn(sum(COMMIT), len(TAPS) * HT, generator=gen),
        "block2": torch.randn(bs * BLOCK, H, generator=gen),
    }


def _draft_twice(model: DFlashDraft) -> tuple[torch.Tensor, torch.Tensor]:
    """Context, block; then commit ``COMMIT`` tokens per row (their context K/V overwrite the
    block's) and draft the next block. Returns both blocks' outputs ``[bs * B, H]``."""
    x = _inputs()
    rows = PagedRows(num_layers=LAYERS, shape=model.attention_shape, page_size=4, max_len=24)
    backend = torch_backend(model.attention_shape)

    def step(lengths: Sequence[int], features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        _, fb = rows.batch(backend, [(s, [0] * n) for s, n in zip(SLOTS, lengths, strict=True)])
        model.materialize(features, fb.layout, fb.kv)
        block = [(s, [MASK] * BLOCK) for s in SLOTS]
        _, fb = rows.batch(backend, block, causal=False, kv_slack=5)
        out = model(embeds, fb)
        for slot in SLOTS:  # the block is not committed: the next context overwrites it
            rows.lengths[slot] -= BLOCK
        return out

    with torch.no_grad():
        first = step(CONTEXT, x["ctx1"], x["block1"])
        second = step(COMMIT, x["ctx2"], x["block2"])
    return first, second


def test_block_matches_dense_reference() -> None:
    model = _random_draft()
    w = checkpoint_tensors(model)
    x = _inputs()
    first, second = _draft_twice(model)
    ctx1 = x["ctx1"].split(CONTEXT)
    ctx2 = x["ctx2"].split(COMMIT)
    for row in range(len(SLOTS)):
        rows = slice(row * BLOCK, (row + 1) * BLOCK)
        ref = _dense_block(w, ctx1[row], x["block1"][rows])
        torch.testing.assert_close(first[rows], ref, atol=ATOL, rtol=0)
        ref = _dense_block(w, torch.cat((ctx1[row], ctx2[row])), x["block2"][rows])
        torch.testing.assert_close(second[rows], ref, atol=ATOL, rtol=0)


def test_block_refuses_causal_batch() -> None:
    model = _random_draft()
    rows = PagedRows(num_layers=LAYERS, shape=model.attention_shape, page_size=4, max_len=8)
    backend = torch_backend(model.attention_shape)
    _, fb = rows.batch(backend, [(0, [MASK] * BLOCK)])
    with pytest.raises(ValueError, match="causal=False"):
        model(torch.zeros(BLOCK, H), fb)


def test_save_load_round_trip(tmp_path: Path) -> None:
    model = _random_draft()
    with pytest.raises(ValueError, match="hidden_size"):
        save_dflash(model, tmp_path, {"hidden_size": 32})
    with pytest.raises(ValueError, match="mask_token_id"):
        save_dflash(model, tmp_path, {"dflash_config": {"mask_token_id": 5}})
    # A target-like template: the draft's identity is set, its shape and taps filled in.
    template = {"num_hidden_layers": 36, "eos_token_id": 2, "dflash_config": {"note": "kept"}}
    save_dflash(model, tmp_path, template)
    assert set(load_file(tmp_path / "model.safetensors")) == _public_keys(LAYERS)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["DFlashDraftModel"]
    assert written["num_hidden_layers"] == LAYERS and written["block_size"] == BLOCK
    assert written["dflash_config"] == {
        "note": "kept",
        "target_layer_ids": list(TAPS),
        "mask_token_id": MASK,
    }
    loaded = load_dflash(tmp_path, dtype=torch.float32, device="cpu", max_positions=64)
    c, lc = model.config, loaded.config
    assert (lc.block_size, lc.mask_token_id, lc.mask_token) == (BLOCK, MASK, None)
    assert (lc.target_layer_ids, lc.num_target_layers) == (TAPS, c.num_target_layers)
    assert lc.target_hidden_size == HT and lc.model.rope == c.model.rope
    assert loaded.attention_shape == model.attention_shape and loaded.num_layers == LAYERS
    loaded_tensors = checkpoint_tensors(loaded)
    assert set(loaded_tensors) == _public_keys(LAYERS)
    for name, tensor in checkpoint_tensors(model).items():
        assert torch.equal(loaded_tensors[name], tensor), name
    for got, expected in zip(_draft_twice(loaded), _draft_twice(model), strict=True):
        assert torch.equal(got, expected)


def test_dummy_load(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    model = load_dflash(
        tmp_path, dtype=torch.float32, device="cpu", max_positions=64, load_format="dummy"
    )
    assert bool((model.hidden_norm.weight == 1).all())
    assert model.fc.weight.shape == (H, len(TAPS) * HT) and model.fc.weight.std() > 0


def test_reference_config_builds_on_meta() -> None:
    config = DFlashConfig.from_pretrained(REFERENCE)
    assert config.target_layer_ids == (1, 9, 17, 25, 33) and config.num_target_layers == 36
    assert (config.mask_token_id, config.mask_token, config.block_size) == (151669, None, 16)
    assert config.target_hidden_size == 4096 and config.model.rope.theta == 1e6
    model = build_dflash(config, max_positions=4096, dtype=torch.bfloat16, device="meta")
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers()))
    tensors = checkpoint_tensors(model)
    assert set(tensors) == _public_keys(5) and model.num_layers == 5
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    assert shapes["fc.weight"] == (4096, 5 * 4096)
    assert shapes["layers.4.self_attn.q_proj.weight"] == (4096, 4096)
    assert shapes["layers.4.self_attn.k_proj.weight"] == (1024, 4096)
    assert shapes["layers.4.self_attn.k_norm.weight"] == (128,)
    assert shapes["layers.4.mlp.down_proj.weight"] == (4096, 12288)
    assert model.attention_shape.num_kv_heads == 8 and model.head_dim == 128


def test_default_target_layers() -> None:
    assert default_target_layers(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layers(7, 3) == (1, 2, 4)
    assert default_target_layers(36, 1) == (18,)
    with pytest.raises(ValueError, match="distinct"):
        default_target_layers(4, 3)  # [1, 1, 1]
    dflash = {"mask_token_id": MASK}
    assert DFlashConfig.from_dict({**TINY, "dflash_config": dflash}).target_layer_ids == (1, 5)
    for bad in ([1, 7], [3, 3], [2, -1]):  # 7: the target's last layer (after its final norm)
        with pytest.raises(ValueError, match="target_layer_ids"):
            DFlashConfig.from_dict({**TINY, "dflash_config": {**dflash, "target_layer_ids": bad}})


def test_config_errors_and_mask_token() -> None:
    with pytest.raises(ValueError, match="not a DFlash draft"):
        DFlashConfig.from_pretrained(CONFIGS / "Qwen3-8B.config.json")
    ids = {"target_layer_ids": list(TAPS)}
    by_name = DFlashConfig.from_dict({**TINY, "dflash_config": ids, "mask_token": "<|MASK|>"})
    assert (by_name.mask_token_id, by_name.mask_token) == (None, "<|MASK|>")
    nested = {**TINY, "dflash_config": {**ids, "mask_token": "<|MASK|>"}}
    assert DFlashConfig.from_dict(nested).mask_token == "<|MASK|>"
    with pytest.raises(ValueError, match="mask token"):
        DFlashConfig.from_dict({**TINY, "dflash_config": ids})
    with pytest.raises(ValueError, match="mask_token_id 300"):
        DFlashConfig.from_dict({**TINY, "dflash_config": {**ids, "mask_token_id": VOCAB}})
    with pytest.raises(ValueError, match="block_size"):
        DFlashConfig.from_dict({key: v for key, v in TINY.items() if key != "block_size"})


def _edit_checkpoint(directory: Path, edit: dict[str, torch.Tensor | None]) -> None:
    file = directory / "model.safetensors"
    tensors = load_file(file)
    for name, tensor in edit.items():
        if tensor is None:
            tensors.pop(name)
        else:
            tensors[name] = tensor
    save_file(tensors, file, metadata={"format": "pt"})


def _load(directory: Path) -> DFlashDraft:
    return load_dflash(directory, dtype=torch.float32, device="cpu", max_positions=64)


def test_load_errors_name_the_key(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save_dflash(_random_draft(), tmp_path, {})
    shared = {"embed_tokens.weight": torch.zeros(VOCAB, H), "lm_head.weight": torch.zeros(VOCAB, H)}
    _edit_checkpoint(tmp_path, dict(shared))
    with caplog.at_level(logging.INFO):
        _load(tmp_path)  # the target's embedding and LM head are shared: skipped, logged
    assert "embed_tokens.weight" in caplog.text and "lm_head.weight" in caplog.text
    _edit_checkpoint(tmp_path, {"layers.2.mlp.up_proj.weight": torch.zeros(96, H)})
    with pytest.raises(ValueError, match=r"unexpected checkpoint tensors: layers\.2\.mlp\.up_proj"):
        _load(tmp_path)
    _edit_checkpoint(
        tmp_path, {"layers.2.mlp.up_proj.weight": None, "layers.1.self_attn.k_norm.weight": None}
    )
    with pytest.raises(
        ValueError, match=r"missing checkpoint tensors: layers\.1\.self_attn\.k_norm"
    ):
        _load(tmp_path)
    _edit_checkpoint(tmp_path, {"layers.1.self_attn.k_norm.weight": torch.ones(D + 1)})
    with pytest.raises(ValueError, match=r"k_norm\.weight has shape \(17,\)"):
        _load(tmp_path)
    _edit_checkpoint(
        tmp_path, {"layers.1.self_attn.k_norm.weight": torch.ones(D), "fc.weight": None}
    )
    with pytest.raises(ValueError, match=r"missing checkpoint tensors: fc\.weight"):
        _load(tmp_path)
