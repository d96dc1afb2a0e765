"""Writers of the trained drafts in the public checkpoint layout the daemon's loaders read
(``load_eagle3``, ``load_dflash``): ``model.safetensors`` and a ``config.json`` whose shape,
RoPE and taps are the model's own."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from outrider.plugins.models.config import ModelConfig
from outrider.plugins.models.weights import checkpoint_tensors
from outrider.plugins.speculative import dflash_model, eagle3_model
from outrider.plugins.speculative.dflash_model import DFlashConfig, DFlashDraft
from outrider.plugins.speculative.eagle3_model import Eagle3Config, Eagle3Draft


def save_eagle3(model: Eagle3Draft, directory: str | Path, config_json: dict[str, Any]) -> None:
    """Write ``config.json`` and ``model.safetensors`` in the public layout. ``config_json``
    gives the keys the model cannot know (e.g. eos ids); ``architectures``, ``model_type``,
    ``num_hidden_layers`` and ``tie_word_embeddings`` are set, and the model's shape, RoPE
    (where ``config_json`` names none) and taps filled in. A shape, RoPE or tap value of
    ``config_json`` that contradicts the model raises ValueError naming it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write(directory, _eagle3_config_json(model, config_json), checkpoint_tensors(model))


def save_dflash(model: DFlashDraft, directory: str | Path, config_json: dict[str, Any]) -> None:
    """Write ``config.json`` and ``model.safetensors`` in the public layout. ``config_json``
    gives the keys the model cannot know (e.g. eos ids); ``architectures``, ``model_type``,
    ``num_hidden_layers``, ``layer_types`` and ``tie_word_embeddings`` are set, and the
    model's shape, RoPE (where ``config_json`` names none), block size, taps and mask token
    filled in. A value of ``config_json`` that contradicts the model raises ValueError
    naming it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write(directory, _dflash_config_json(model, config_json), checkpoint_tensors(model))


def _eagle3_config_json(model: Eagle3Draft, config_json: dict[str, Any]) -> dict[str, Any]:
    c, m = model.config, model.config.model
    identity = {
        "architectures": [eagle3_model.ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
    }
    shape = {
        **_decoder_shape(m),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "attention_bias": m.attention_bias,
        "hidden_act": "silu",
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.norm_before_fc,
    }
    out = _public_config(config_json, identity, shape, m, model.fc.weight.dtype)
    if c.aux_layer_ids is not None:
        eagle = dict(out.get("eagle_config") or {})
        ids = list(c.aux_layer_ids)
        if eagle.setdefault("eagle_aux_hidden_state_layer_ids", ids) != ids:
            raise ValueError(
                "config_json's eagle_config.eagle_aux_hidden_state_layer_ids "
                f"{eagle['eagle_aux_hidden_state_layer_ids']} differ from the model's {ids}"
            )
        out["eagle_config"] = eagle
    _check_rope(Eagle3Config.from_dict(out).model, m)
    return out


def _dflash_config_json(model: DFlashDraft, config_json: dict[str, Any]) -> dict[str, Any]:
    c, m = model.config, model.config.model
    identity = {
        "architectures": [dflash_model.ARCHITECTURE],
        "model_type": "qwen3",
        "num_hidden_layers": m.num_layers,
        "layer_types": ["full_attention"] * m.num_layers,
        "tie_word_embeddings": False,
    }
    shape = {
        **_decoder_shape(m),
        "attention_bias": m.attention_bias,
        "hidden_act": "silu",
        "block_size": c.block_size,
        "num_target_layers": c.num_target_layers,
        "target_hidden_size": c.target_hidden_size,
    }
    out = _public_config(config_json, identity, shape, m, model.fc.weight.dtype)
    # Taps are always written: readers disagree on the default rule, never on explicit ids.
    dflash = dict(out.get("dflash_config") or {})
    written: dict[str, Any] = {"target_layer_ids": list(c.target_layer_ids)}
    if c.mask_token_id is not None:
        written["mask_token_id"] = c.mask_token_id
    if c.mask_token is not None:
        written["mask_token"] = c.mask_token
    for key, value in written.items():
        if dflash.setdefault(key, value) != value:
            raise ValueError(
                f"config_json's dflash_config.{key} {dflash[key]!r} differs from the model's "
                f"{value!r}"
            )
    out["dflash_config"] = dflash
    _check_rope(DFlashConfig.from_dict(out).model, m)
    return out


def _decoder_shape(m: ModelConfig) -> dict[str, Any]:
    return {
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "num_attention_heads": m.num_q_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "rms_norm_eps": m.rms_norm_eps,
        "vocab_size": m.vocab_size,
    }


def _public_config(
    config_json: dict[str, Any],
    identity: dict[str, Any],
    shape: dict[str, Any],
    m: ModelConfig,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """``config_json`` with ``identity`` (what makes it this kind of draft) set over it and
    ``shape`` filled in, RoPE where it names none, then the model's context length and
    dtype where absent. Raises ValueError naming a ``shape`` key it gives another value."""
    out = {**config_json, **identity}
    for key, value in shape.items():
        if key in out and out[key] != value:
            raise ValueError(f"config_json[{key!r}] = {out[key]!r}, the model has {value!r}")
        out[key] = value
    if not {"rope_theta", "rope_scaling", "rope_parameters"} & out.keys():
        out["rope_theta"] = m.rope.theta
        if m.rope.llama3 is not None:
            out["rope_scaling"] = {"rope_type": "llama3", **asdict(m.rope.llama3)}
    out.setdefault("max_position_embeddings", m.max_position_embeddings)
    out.setdefault("torch_dtype", str(dtype).removeprefix("torch."))
    return out


def _check_rope(written: ModelConfig, m: ModelConfig) -> None:
    if written.rope != m.rope:
        raise ValueError(f"config_json's RoPE ({written.rope}) is not the model's ({m.rope})")


def _write(directory: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    owned = {name: t.detach().to("cpu").clone() for name, t in tensors.items()}
    save_file(owned, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
