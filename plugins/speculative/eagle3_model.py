"""The EAGLE-3 draft model and its loader (ARCHITECTURE.md 4.2 and 4.5). Imported inside the
daemon only.

One Llama decoder layer whose q/k/v read a 2H-wide input::

    feat = fc(concat(h_low, h_mid, h_high))                  [T, 3*H_t] -> [T, H]
    x    = concat(input_layernorm(embed), hidden_norm(feat))  [T, 2H], embedding first
    h    = feat + attention(x)                                residual: feat, un-normed
    y    = h + mlp(post_attention_layernorm(h))               fed back as the next feat
    logits = lm_head(norm(y))                                 [T, draft_vocab]

Two flags of config.json (at its top or in ``eagle_config``, the nested one first) change
that: ``norm_before_residual`` takes the residual after the norm (``h = hidden_norm(feat) +
attention(x)``), ``norm_before_fc`` normalizes the concatenated taps first (``feat =
fc(input_norm(concat(...)))``, ``input_norm.weight [3*H_t]``; gpt-oss's published drafts have
it). Flags of other layouts that change the arithmetic (``fc_norm``, ``norm_output``,
``use_aux_hidden_state`` false) are refused by name: ignoring one would leave the draft
loading and proposing worse, silently.

The embedding is the target's (shared, not in the draft). The draft owns a one-layer
``KVCache`` in the target's page layout and writes its K/V into layer 0 at ``fb.layout.out_loc``.
Its RoPE comes from its own config.json, its tables are sized by ``max_positions``.

Under tensor parallelism (``tp``) the layer is sharded as the target's are (a rank holds its
heads, their KV, its MLP rows; o_proj and down_proj all-reduce) and ``lm_head`` is
column-parallel over the draft vocabulary (``local_logits``: the rank's slice); ``fc``, the
norms and ``d2t``/``t2d`` are replicated.

Public checkpoint layout::

    fc.weight                                 [H, 3*H_t]
    input_norm.weight                         [3*H_t]             (norm_before_fc only)
    midlayer.self_attn.{q,k,v}_proj.weight    [Hq*D | Hkv*D, 2H]  -> our fused qkv_proj
    midlayer.self_attn.o_proj.weight          [H, Hq*D]
    midlayer.mlp.{gate,up}_proj.weight        [I, H]              -> our fused gate_up_proj
    midlayer.mlp.down_proj.weight             [H, I]
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight   [H]
    norm.weight [H], lm_head.weight [draft_vocab, H]
    d2t [draft_vocab] int64 (target_id - draft_id), t2d [vocab] bool (in the draft vocab)

``d2t``/``t2d`` may both be absent when ``draft_vocab_size == vocab_size`` (identity);
``embed_tokens.weight`` is the target's (skipped).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from outrider.plugins.device import AttentionShape
from outrider.plugins.models.config import ModelConfig, tensor_parallel_problems
from outrider.plugins.models.kernels import Rotation
from outrider.plugins.models.layers import MLP, Attention, FusedLinear, RMSNorm, RotaryEmbedding
from outrider.plugins.models.loader import materialize
from outrider.plugins.models.parallel import SINGLE, ColumnParallelLinear, TPGroup, gather_vocab
from outrider.plugins.models.weights import (
    CheckpointRules,
    LoadFormat,
    fill_checkpoint,
    load_weights,
)

if TYPE_CHECKING:
    from outrider.plugins.device import ForwardBatch

ARCHITECTURE = "LlamaForCausalLMEagle3"
NUM_TAPS = 3  # fc reads three target layers
# The target's embedding is shared: a checkpoint that carries it is skipped.
_SHARED = frozenset({"embed_tokens.weight"})
_VOCAB_MAP = frozenset({"d2t", "t2d"})


@dataclass(frozen=True)
class Eagle3Config:
    """A draft's config.json, parsed once."""

    model: ModelConfig  # decoder shape and RoPE; vocab_size = the target's vocab
    draft_vocab_size: int
    target_hidden_size: int  # H_t: fc takes NUM_TAPS * H_t
    # eagle_config.eagle_aux_hidden_state_layer_ids exactly as written (engines disagree by
    # one on their convention: the caller interprets them); None when absent.
    aux_layer_ids: tuple[int, ...] | None
    norm_before_residual: bool = False  # the residual taken after hidden_norm
    norm_before_fc: bool = False  # the taps normalized before fc

    @property
    def identity_vocab(self) -> bool:
        return self.draft_vocab_size == self.model.vocab_size

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Eagle3Config:
        """Parse a draft directory or its config.json (through transformers' AutoConfig, as
        ``ModelConfig`` does). Raises ValueError for a config that is not an EAGLE-3 draft."""
        from transformers import AutoConfig

        return cls.from_dict(AutoConfig.from_pretrained(str(path)).to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Eagle3Config:
        model = ModelConfig.from_dict(d)
        if model.architecture != ARCHITECTURE:
            raise ValueError(
                f"an EAGLE-3 draft has architectures [{ARCHITECTURE!r}], "
                f"not [{model.architecture!r}]"
            )
        if model.model_type != "llama":
            raise ValueError(f"an EAGLE-3 draft has model_type 'llama', not {model.model_type!r}")
        if model.num_layers != 1:
            raise ValueError(f"an EAGLE-3 draft has num_hidden_layers 1, not {model.num_layers}")
        draft_vocab_size = int(d.get("draft_vocab_size") or model.vocab_size)
        if not 0 < draft_vocab_size <= model.vocab_size:
            raise ValueError(
                f"draft_vocab_size {draft_vocab_size} must be in 1..vocab_size ({model.vocab_size})"
            )
        written = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        aux_layer_ids = None if written is None else tuple(int(i) for i in written)
        if aux_layer_ids is not None and len(aux_layer_ids) != NUM_TAPS:
            raise ValueError(
                f"eagle_config.eagle_aux_hidden_state_layer_ids must name {NUM_TAPS} layers, "
                f"got {list(aux_layer_ids)}"
            )
        flag = partial(_layout_flag, d)
        for name, unsupported in _OTHER_LAYOUTS.items():
            if flag(name, not unsupported) == unsupported:
                raise ValueError(
                    f"an EAGLE-3 draft with {name} {str(unsupported).lower()} is not "
                    f"supported: {_OTHER_LAYOUT_NOTE}"
                )
        return cls(
            model=model,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=int(d.get("target_hidden_size") or model.hidden_size),
            aux_layer_ids=aux_layer_ids,
            norm_before_residual=flag("norm_before_residual", False),
            norm_before_fc=flag("norm_before_fc", False),
        )


# Layout flags of other EAGLE-3 variants, each with the value this draft cannot serve.
_OTHER_LAYOUTS = {"fc_norm": True, "norm_output": True, "use_aux_hidden_state": False}
_OTHER_LAYOUT_NOTE = "its arithmetic differs from the LlamaForCausalLMEagle3 layout served here"


def _layout_flag(d: dict[str, Any], name: str, default: bool) -> bool:
    """A boolean layout flag of a draft's config: in ``eagle_config`` first (where some
    publishers write it), else at the top, else ``default``."""
    nested = d.get("eagle_config") or {}
    value = nested.get(name, d.get(name))
    return default if value is None else bool(value)


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The default taps ``[1, N//2 - 1, N - 4]`` in the output-of-layer convention. Raises
    ValueError where they collide (N < 7): such targets need explicit ids."""
    n = num_target_layers
    taps = (1, n // 2 - 1, n - 4)
    if not taps[0] < taps[1] < taps[2]:
        raise ValueError(
            f"the default EAGLE-3 taps of a {n}-layer target collide ({list(taps)}): "
            "write eagle_config.eagle_aux_hidden_state_layer_ids explicitly"
        )
    return taps


class Eagle3Attention(Attention):
    """``Attention`` whose q/k/v read the 2H-wide concat; o_proj still returns H."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__(config, layer_id=0, tp=tp)
        # NOTE: replaces the H-wide qkv_proj built above; build on the meta device (as
        # build_eagle3 does) so the discarded one costs no memory.
        q_rows = config.num_q_heads * config.head_dim
        kv_rows = config.num_kv_heads * config.head_dim
        rows = {"q": q_rows, "k": kv_rows, "v": kv_rows}
        self.qkv_proj = FusedLinear(2 * config.hidden_size, rows, config.attention_bias, tp)


class Eagle3Layer(nn.Module):
    """The draft's decoder layer: HF's ``midlayer.`` prefix."""

    def __init__(
        self, config: ModelConfig, tp: TPGroup = SINGLE, norm_before_residual: bool = False
    ) -> None:
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(
        self,
        embeds: torch.Tensor,
        feat: torch.Tensor,
        rotation: Rotation,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        # embeds, feat: [T, H]; never updated in place (captures may alias them), so the
        # residual adds stay outside the norms.
        normed = self.hidden_norm(feat)
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)  # [T, 2H]
        h = (normed if self.norm_before_residual else feat) + self.self_attn(x, rotation, fb)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    """The EAGLE-3 draft (the rank's shard under tensor parallelism: ``tp``). Parameter names
    follow the public layout except for the fused ``qkv_proj`` and ``gate_up_proj`` (the
    loader maps the public names onto them). ValueError naming the flag for a group size
    that does not divide its layer or its draft vocabulary."""

    d2t: torch.Tensor  # [draft_vocab] int64: target_id - draft_id
    t2d: torch.Tensor  # [vocab] bool: target id is in the draft vocab

    def __init__(self, config: Eagle3Config, max_positions: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        m = config.model
        shares = m.layer_shares | {"draft_vocab_size": config.draft_vocab_size}
        whose = "the EAGLE-3 draft's"
        problems = tensor_parallel_problems(shares, tp.size, whose, "draft_vocab_size")
        if problems:
            raise ValueError("; ".join(problems))
        self.config = config
        self.tp = tp
        taps = NUM_TAPS * config.target_hidden_size
        self.input_norm = RMSNorm(taps, m.rms_norm_eps) if config.norm_before_fc else None
        self.fc = nn.Linear(taps, m.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(m, tp, config.norm_before_residual)
        self.norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.lm_head = ColumnParallelLinear(m.hidden_size, config.draft_vocab_size, False, tp)
        self.rotary_emb = RotaryEmbedding(m.head_dim, m.rope, max_positions)
        # NOTE: uninitialised after build_eagle3's to_empty; the load paths always fill them.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(m.vocab_size, dtype=torch.bool))

    @property
    def num_layers(self) -> int:
        return 1

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

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """``features: [T, 3*H_t]`` (the tapped target layers, low to high, concatenated)
        -> ``feat: [T, H]``."""
        if self.input_norm is not None:
            features = self.input_norm(features)
        return self.fc(features)

    def forward(self, embeds: torch.Tensor, feat: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """``embeds: [T, H]`` the target's embedding of the input tokens, ``feat: [T, H]``
        (``project``'s output, or the draft's own previous output while drafting) -> ``y:
        [T, H]`` before the final norm. Writes K/V into layer 0 of ``fb.kv`` at
        ``fb.layout.out_loc``; positions are ``fb.layout.positions``."""
        return self.midlayer(embeds, feat, self.rotary_emb(fb.layout.positions), fb)

    def compute_logits(self, y: torch.Tensor) -> torch.Tensor:
        """``y: [n, H]`` -> ``[n, draft_vocab]`` float32, the whole draft vocabulary on every
        rank (gathered under tensor parallelism: greedy choices use ``local_logits``)."""
        return gather_vocab(self.local_logits(y), self.tp)

    def local_logits(self, y: torch.Tensor) -> torch.Tensor:
        """``y: [n, H]`` -> ``[n, draft_vocab / N]`` float32: the rank's slice of the draft
        vocabulary (draft ids from ``rank * draft_vocab / N``), with no communication."""
        return self.lm_head(self.norm(y)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids (any shape, int64) -> target ids (identity when the
        vocabularies are the same)."""
        return draft_ids + self.d2t[draft_ids]


def build_eagle3(
    config: Eagle3Config,
    *,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TPGroup = SINGLE,
) -> Eagle3Draft:
    """The draft (the rank's shard) with uninitialised weights in ``dtype`` on ``device``
    (meta: no memory). ``d2t``/``t2d`` keep their integer and bool dtypes."""
    return materialize(lambda: Eagle3Draft(config, max_positions, tp), dtype, device)


def load_eagle3(
    path: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int,
    load_format: LoadFormat = "auto",
    tp: TPGroup = SINGLE,
) -> Eagle3Draft:
    """Load the draft at ``path`` (a directory or its config.json); under tensor parallelism
    (``tp``), this rank's shard of it. ``max_positions`` sizes the rotary tables: the serving
    context length plus the largest reservation. ``dummy`` fills random weights (norms 1, the
    rest N(0, 0.02); a shard is the cut of what one rank draws) and maps draft id i to target
    id i."""
    config = Eagle3Config.from_pretrained(path)
    model = build_eagle3(config, max_positions=max_positions, dtype=dtype, device=device, tp=tp)
    _identity_vocab_map(model, load_weights(model, path, _rules(config), load_format=load_format))
    _check_vocab_map(model)
    return model


def fill_eagle3(model: Eagle3Draft, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy public-layout ``(name, tensor)`` pairs into ``model``. Raises ValueError naming
    every unexpected, repeated or missing tensor, or the first one of a wrong shape. With one
    vocabulary, ``d2t`` and ``t2d`` may both be absent (the identity)."""
    _identity_vocab_map(model, fill_checkpoint(model, tensors, _rules(model.config)))


def _rules(config: Eagle3Config) -> CheckpointRules:
    optional = _VOCAB_MAP if config.identity_vocab else frozenset()
    return CheckpointRules("EAGLE-3 draft", shared=_SHARED, optional=optional)


def _identity_vocab_map(model: Eagle3Draft, unfilled: frozenset[str]) -> None:
    """Map draft id i to target id i when neither ``d2t`` nor ``t2d`` was loaded (``unfilled``:
    what the loader left); one without the other is missing."""
    if not unfilled:
        return
    if unfilled != _VOCAB_MAP:
        raise ValueError(
            f"EAGLE-3 draft: missing checkpoint tensors: {', '.join(sorted(unfilled))}"
        )
    model.d2t.zero_()
    ids = torch.arange(model.t2d.shape[0], device=model.t2d.device)
    model.t2d.copy_(ids < model.config.draft_vocab_size)


def _check_vocab_map(model: Eagle3Draft) -> None:
    """``d2t`` maps the draft ids one to one onto target ids, and ``t2d`` marks exactly
    those. Syncs with the host: load time only."""
    draft_vocab, vocab = model.d2t.shape[0], model.t2d.shape[0]
    targets = model.to_target_ids(torch.arange(draft_vocab, device=model.d2t.device))
    if not bool(((targets >= 0) & (targets < vocab)).all()):
        raise ValueError("EAGLE-3 draft: d2t maps draft ids outside the target vocab")
    if targets.unique().numel() != draft_vocab:
        raise ValueError("EAGLE-3 draft: d2t maps two draft ids onto one target id")
    if not bool(model.t2d[targets].all()) or int(model.t2d.sum()) != draft_vocab:
        raise ValueError("EAGLE-3 draft: t2d does not mark exactly the targets of d2t")
