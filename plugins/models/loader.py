"""Build a model (ARCHITECTURE.md 4.5): the target, a standalone draft, or any module built
from the shared layers, and load a target-layout model with its weights.

A model is built on the meta device and materialised once in the serving dtype on the serving
device; its weights are then filled in place (``weights.py``). Under tensor parallelism each
rank builds its shard of the model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from outrider.plugins.models.config import ModelConfig
from outrider.plugins.models.fp8.config import Fp8Config
from outrider.plugins.models.fp8.layers import fp8_layout, use_fp8
from outrider.plugins.models.fp8.reference import FP8
from outrider.plugins.models.gpt_oss import gpt_oss_checkpoint_shapes
from outrider.plugins.models.kernels import TORCH_KERNELS, select_kernels, use_kernels
from outrider.plugins.models.layers import DecoderForCausalLM, RotaryEmbedding
from outrider.plugins.models.moe.block import moe_checkpoint_shapes
from outrider.plugins.models.parallel import SINGLE, TPGroup
from outrider.plugins.models.registry import model_class
from outrider.plugins.models.weights import (
    CheckpointRules,
    LoadFormat,
    LoadProgress,
    default_progress,
    fill_checkpoint,
    load_weights,
)

log = logging.getLogger(__name__)


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
        lambda: model_class(config.architecture)(config, max_positions, tp),
        dtype,
        device,
        fp8=config.fp8,
    )


M = TypeVar("M", bound=torch.nn.Module)


def materialize(
    build: Callable[[], M],
    dtype: torch.dtype,
    device: torch.device | str,
    fp8: Fp8Config | None = None,
) -> M:
    """``build()`` on the meta device, then given uninitialised storage in ``dtype`` (floating
    tensors only; with ``fp8``, the FP8 linears keep their FP8 weights and float32 scales) on
    ``device``, rotary tables computed, gradients off, and the layer kernels of that device
    and dtype chosen."""
    with torch.device("meta"):
        model = build()
    model = model.to(dtype=dtype)
    if fp8 is not None:
        use_fp8(model, fp8)
    model = model.to_empty(device=device)
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


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    load_format: LoadFormat = "auto",
    max_positions: int,
    progress: LoadProgress | None = None,
    tp: TPGroup = SINGLE,
    label: str = "target",
) -> tuple[DecoderForCausalLM, ModelConfig]:
    """Load the model at ``path`` (a directory or a config.json path); under tensor
    parallelism (``tp``), this rank's shard of it. ``max_positions`` sizes the rotary tables:
    serving context length plus the largest reservation. ``progress`` defaults to
    ``default_progress()``; ``label`` names the model in errors."""
    config = ModelConfig.from_pretrained(path)
    model = build_model(config, max_positions=max_positions, dtype=dtype, device=device, tp=tp)
    rules = _decoder_rules(config, label)
    load_weights(
        model, path, rules, load_format=load_format, progress=progress or default_progress()
    )
    return model, config


def _decoder_rules(config: ModelConfig, label: str) -> CheckpointRules:
    """A decoder LM's checkpoint: a tied checkpoint may still ship ``lm_head.weight`` (HF ties
    it to the embedding too)."""
    tied = frozenset({"lm_head.weight"}) if config.tie_word_embeddings else frozenset()
    return CheckpointRules(label, shared=tied)


def expected_checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name (and shape) a HF checkpoint of ``config`` holds, derived from the
    config alone (a mixture of experts: one tensor per expert and projection)."""
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
        if config.model_type == "gpt_oss":
            shapes.update(gpt_oss_checkpoint_shapes(config, i))
        elif config.moe is not None and i in config.moe.sparse_layers:
            shapes.update(moe_checkpoint_shapes(config, i))
        else:
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
    shapes = expected_checkpoint_shapes(config)
    fp8_weights: frozenset[str] = frozenset()
    if config.fp8 is not None:
        layout = fp8_layout(shapes, config.fp8)
        shapes |= layout.scales
        fp8_weights = layout.fp8_weights
    meta = (
        (name, torch.empty(shape, device="meta", dtype=FP8 if name in fp8_weights else None))
        for name, shape in shapes.items()
    )
    fill_checkpoint(model, meta, _decoder_rules(config, config.architecture))
