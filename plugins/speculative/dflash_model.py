"""The DFlash draft model and its loader (ARCHITECTURE.md 4.2 and 4.5). Imported inside the
daemon only.

A stack of D Qwen3 decoder layers (per-head q/k RMSNorm, GQA, SwiGLU) that drafts a block of
B tokens in one forward. It has no embedding and no LM head: the target's are shared.

Context (``materialize``), once per committed position t, no attention computed::

    ctx_t = hidden_norm(fc(concat(target features of the tapped layers at t)))   [H]
    layer i:  K = rope(k_norm(k_proj_i(ctx_t)), t),  V = v_proj_i(ctx_t)  -> draft KV at t

Block (``forward``): ``[root, MASK * (B-1)]`` embedded by the target at positions p .. p+B-1;
every layer is a plain decoder layer whose attention is non-causal (``causal`` False): each
block query sees the whole cached context below ``seq_lens``, the block included. The
output is ``norm`` of the last layer, ``[T, H]``; the caller applies the target's LM head.

The draft owns a ``KVCache`` of D layers in the target's page layout; layer i of the draft
is layer i of that cache. Its RoPE comes from its own config.json, its tables are sized by
``max_positions``.

Under tensor parallelism (``tp``) the layers are sharded as the target's are (a rank holds its
heads, their KV, its MLP rows; o_proj and down_proj all-reduce); ``fc`` and the norms are
replicated, so the context vectors and the output are whole on every rank.

Public checkpoint layout (the attribute names of the public ``DFlashDraftModel`` class, saved
without a prefix)::

    fc.weight                                    [H, L_tap * H_t]
    hidden_norm.weight, norm.weight              [H]
    layers.{i}.self_attn.{q,k,v}_proj.weight     [Hq*D | Hkv*D, H]  -> our fused qkv_proj
    layers.{i}.self_attn.o_proj.weight           [H, Hq*D]
    layers.{i}.self_attn.{q,k}_norm.weight       [D]
    layers.{i}.mlp.{gate,up}_proj.weight         [I, H]             -> our fused gate_up_proj
    layers.{i}.mlp.down_proj.weight              [H, I]
    layers.{i}.{input,post_attention}_layernorm.weight   [H]

plus ``.bias`` rows of q/k/v/o when ``attention_bias`` is set; an embedding or LM head in the
checkpoint is the target's (skipped).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from outrider.plugins.device import AttentionShape, BatchLayout, KVCache
from outrider.plugins.models.config import ModelConfig, tensor_parallel_problems
from outrider.plugins.models.kernels import Rotation
from outrider.plugins.models.layers import (
    Attention,
    DecoderLayer,
    RMSNorm,
    RotaryEmbedding,
    run_layers,
)
from outrider.plugins.models.loader import materialize
from outrider.plugins.models.parallel import SINGLE, TPGroup
from outrider.plugins.models.weights import (
    CheckpointRules,
    LoadFormat,
    fill_checkpoint,
    load_weights,
)

if TYPE_CHECKING:
    from outrider.plugins.device import ForwardBatch

ARCHITECTURE = "DFlashDraftModel"
# The target's embedding and LM head are shared: a checkpoint that carries them is skipped.
_RULES = CheckpointRules(
    "DFlash draft",
    shared=frozenset({"embed_tokens.weight", "model.embed_tokens.weight", "lm_head.weight"}),
)


@dataclass(frozen=True)
class DFlashConfig:
    """A draft's config.json, parsed once."""

    model: ModelConfig  # the draft decoder's shape and RoPE; vocab_size = the target's
    block_size: int  # B: tokens per drafted block, root included
    mask_token_id: int | None  # dflash_config.mask_token_id; wins over mask_token
    mask_token: str | None  # a token string the caller resolves through the target's tokenizer
    target_layer_ids: tuple[int, ...]  # output-of-layer convention, in fc's concat order
    num_target_layers: int
    target_hidden_size: int  # H_t: fc takes len(target_layer_ids) * H_t

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> DFlashConfig:
        """Parse a draft directory or its config.json (through transformers' AutoConfig, as
        ``ModelConfig`` does). Raises ValueError for a config that is not a DFlash draft."""
        from transformers import AutoConfig

        return cls.from_dict(AutoConfig.from_pretrained(str(path)).to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DFlashConfig:
        architectures = d.get("architectures") or [None]
        if architectures[0] != ARCHITECTURE:
            raise ValueError(
                f"not a DFlash draft: architectures is {d.get('architectures')!r}, "
                f"a DFlash draft has [{ARCHITECTURE!r}]"
            )
        if d.get("model_type") != "qwen3":
            raise ValueError(
                f"a DFlash draft has model_type 'qwen3' (q/k norm layers), "
                f"not {d.get('model_type')!r}"
            )
        model = ModelConfig.from_dict(d)
        dflash = d.get("dflash_config") or {}
        block_size = dflash.get("block_size", d.get("block_size"))
        if block_size is None or int(block_size) < 2:
            raise ValueError(f"a DFlash draft needs block_size >= 2, got {block_size!r}")
        if d.get("num_target_layers") is None:
            raise ValueError("a DFlash draft config names num_target_layers")
        num_target_layers = int(d["num_target_layers"])
        written = dflash.get("target_layer_ids")
        if written is None:
            target_layer_ids = default_target_layers(num_target_layers, model.num_layers)
        else:
            target_layer_ids = tuple(int(i) for i in written)
            _check_taps(target_layer_ids, num_target_layers, "dflash_config.target_layer_ids")
        mask_token_id = dflash.get("mask_token_id")
        mask_token = dflash.get("mask_token", d.get("mask_token"))
        if mask_token_id is None and not mask_token:
            raise ValueError(
                "a DFlash draft names its mask token: dflash_config.mask_token_id, or a "
                "mask_token string"
            )
        if mask_token_id is not None and not 0 <= int(mask_token_id) < model.vocab_size:
            raise ValueError(
                f"dflash_config.mask_token_id {mask_token_id} is not a row of the "
                f"{model.vocab_size}-row embedding"
            )
        return cls(
            model=model,
            block_size=int(block_size),
            mask_token_id=None if mask_token_id is None else int(mask_token_id),
            mask_token=str(mask_token) if mask_token else None,
            target_layer_ids=target_layer_ids,
            num_target_layers=num_target_layers,
            target_hidden_size=int(d.get("target_hidden_size") or model.hidden_size),
        )


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The default taps in the output-of-layer convention: ``[N // 2]`` for one draft layer,
    else ``round(1 + i * (N - 4) / (D - 1))`` for i < D (Python's round, half to even).
    Raises ValueError where they collide or leave the target (small N): such targets need
    explicit ids."""
    n, d = num_target_layers, num_draft_layers
    if d < 1:
        raise ValueError(f"a DFlash draft has at least one layer, got {d}")
    if d == 1:
        taps: tuple[int, ...] = (n // 2,)
    else:
        taps = tuple(round(1 + i * (n - 4) / (d - 1)) for i in range(d))
    _check_taps(taps, n, f"the default taps of a {n}-layer target for {d} draft layers")
    return taps


def _check_taps(taps: tuple[int, ...], num_target_layers: int, what: str) -> None:
    # NOTE: the public drafts were trained on HF hidden_states[L + 1]; for the last layer that
    # is after the target's final norm, which our captures never are: refuse it.
    last = num_target_layers - 2
    if not taps or len(set(taps)) != len(taps) or not all(0 <= t <= last for t in taps):
        raise ValueError(
            f"{what} ({list(taps)}) must be distinct layers in 0..{last}: write "
            "dflash_config.target_layer_ids explicitly"
        )


class DFlashDraft(nn.Module):
    """The DFlash draft (the rank's shard under tensor parallelism: ``tp``). Parameter names
    follow the public layout except for the fused ``qkv_proj`` and ``gate_up_proj`` (the
    loader maps the public names onto them). ValueError naming the flag for a group size
    that does not divide its layers."""

    def __init__(self, config: DFlashConfig, max_positions: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        m = config.model
        problems = tensor_parallel_problems(m.layer_shares, tp.size, "the DFlash draft's")
        if problems:
            raise ValueError("; ".join(problems))
        self.config = config
        self.tp = tp
        self.fc = nn.Linear(config.num_taps * config.target_hidden_size, m.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(m, i, tp) for i in range(m.num_layers))
        self.norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(m.head_dim, m.rope, max_positions)

    @property
    def num_layers(self) -> int:
        return self.config.model.num_layers

    @property
    def num_kv_heads(self) -> int:
        """The rank's KV heads (what its KV cache holds)."""
        return self.config.model.num_kv_heads // self.tp.size

    @property
    def head_dim(self) -> int:
        return self.config.model.head_dim

    @property
    def attention_shape(self) -> AttentionShape:
        """The rank's attention: its heads, the draft's head dim and scale."""
        m = self.config.model
        heads, dtype = m.num_q_heads // self.tp.size, self.fc.weight.dtype
        return AttentionShape(heads, self.num_kv_heads, m.head_dim, m.head_dim**-0.5, dtype)

    def materialize(self, features: torch.Tensor, layout: BatchLayout, kv: KVCache) -> None:
        """``features: [T, L_tap * H_t]`` (the tapped target layers at ``layout.positions``,
        in ``target_layer_ids`` order, concatenated) -> the context K/V of every draft layer,
        stored at ``layout.out_loc`` into ``kv``. No attention runs."""
        ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))  # [T, H]
        rotation = self.rotary_emb(layout.positions)
        for layer_id, layer in enumerate(self.layers):
            attn = cast("Attention", layer.self_attn)
            k, v = _context_kv(attn, ctx, rotation)  # [T, Hkv, D] each
            kv.store(layer_id, layout.out_loc, k, v)

    def forward(self, embeds: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """``embeds: [T, H]`` the target's embedding of each row's block ``[root, MASK, ...]``
        at ``fb.layout.positions`` -> the final-norm hidden states ``[T, H]``. Stores the
        block's K/V at ``fb.layout.out_loc``; each block query attends to its row's KV below
        ``fb.layout.seq_lens`` (context materialised before, plus the whole block). The layout
        must not be causal."""
        if fb.layout.causal:
            raise ValueError("the DFlash block attends non-causally: build it with causal=False")
        # A copy: the layers update their input in place, and the caller's embeddings may be
        # aliased by a capture.
        x = embeds.to(self.fc.weight.dtype, copy=True)
        rotation = self.rotary_emb(fb.layout.positions)
        return run_layers(self.layers, x, self.norm, rotation, fb, self.tp)


def _context_kv(
    attn: Attention, ctx: torch.Tensor, rotation: Rotation
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the context vectors ``ctx: [T, H]`` through the k/v rows of the layer's
    fused projection, k_norm and RoPE: exactly what the layer computes for a block token."""
    qkv = attn.qkv_proj
    rows = slice(qkv.shards["k"].start, qkv.shards["v"].stop)  # k then v: contiguous rows
    bias = None if qkv.bias is None else qkv.bias[rows]
    k, v = F.linear(ctx, qkv.weight[rows], bias).split(qkv.sizes[1:], dim=-1)
    k = k.view(-1, attn.num_kv_heads, attn.head_dim)  # [T, Hkv, D]
    v = v.view(-1, attn.num_kv_heads, attn.head_dim)
    if attn.k_norm is not None:
        k = attn.k_norm(k)
    return rotation.rotate_keys(k), v


def build_dflash(
    config: DFlashConfig,
    *,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TPGroup = SINGLE,
) -> DFlashDraft:
    """The draft (the rank's shard) with uninitialised weights in ``dtype`` on ``device``
    (meta: no memory)."""
    return materialize(lambda: DFlashDraft(config, max_positions, tp), dtype, device)


def load_dflash(
    path: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int,
    load_format: LoadFormat = "auto",
    tp: TPGroup = SINGLE,
) -> DFlashDraft:
    """Load the draft at ``path`` (a directory or its config.json); under tensor parallelism
    (``tp``), this rank's shard of it. ``max_positions`` sizes the rotary tables: the serving
    context length plus the largest reservation. ``dummy`` fills random weights (norms 1, the
    rest N(0, 0.02); a shard is the cut of what one rank draws)."""
    config = DFlashConfig.from_pretrained(path)
    model = build_dflash(config, max_positions=max_positions, dtype=dtype, device=device, tp=tp)
    load_weights(model, path, _RULES, load_format=load_format)
    return model


def fill_dflash(model: DFlashDraft, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy public-layout ``(name, tensor)`` pairs into ``model``. Raises ValueError naming
    every unexpected, repeated or missing tensor, or the first one of a wrong shape."""
    fill_checkpoint(model, tensors, _RULES)
