"""Layers shared by the dense decoder LMs (Llama 3.x, Qwen2, Qwen3).

Parameter names follow the HF layout (``model.layers.{i}.self_attn...``) except for the two
fused projections, ``qkv_proj`` and ``gate_up_proj``; the loader maps HF names onto them
through ``FusedLinear.shards``.

A decoder layer's MLP block (``mlp.``) is the model's choice (``DecoderForCausalLM.feed_forward``):
the dense ``MLP`` here, or a mixture of experts (``moe/block.py``) in the layers its config names.

Every layer takes the rank's ``TPGroup`` (``parallel.py``): under tensor parallelism a rank
runs its share of the heads and of the MLP's rows, and its modules' sizes are the rank's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from outrider.plugins.device import AttentionShape
from outrider.plugins.models.kernels import Rotation, UsesKernels
from outrider.plugins.models.parallel import (
    SINGLE,
    ColumnParallelLinear,
    RowParallelLinear,
    Sharded,
    Split,
    TPGroup,
    VocabParallelEmbedding,
    gather_vocab,
    vocab_argmax,
)
from outrider.plugins.models.rope import rope_inv_freq

if TYPE_CHECKING:
    from outrider.plugins.device import ForwardBatch
    from outrider.plugins.models.config import ModelConfig
    from outrider.plugins.models.rope_config import RopeConfig


class RMSNorm(nn.Module, UsesKernels):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [..., dim]`` normalised over its last dim."""
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def add(
        self, x: torch.Tensor, residual: torch.Tensor, tp: TPGroup = SINGLE
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + s), residual + s)``, ``s`` the sum of ``x`` over ``tp``'s ranks
        (``x`` a rank's part of a block's output); may overwrite both inputs."""
        fused = tp.fused_sum_norm(x, residual)
        if fused is not None:
            return fused(x, residual, self.weight, self.eps)
        return self.kernels.add_rms_norm(tp.all_reduce(x), residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module, UsesKernels):
    """cos/sin tables for positions ``0 .. max_positions - 1`` (the serving context length
    plus the largest reservation, never a checkpoint's max_position_embeddings)."""

    cos: torch.Tensor  # [max_positions, D/2]
    sin: torch.Tensor
    _cos_sin: torch.Tensor | None = None  # [max_positions, D] float32, made on first use

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.init_table()

    def init_table(self) -> None:
        """(Re)compute the tables in float32 and store them in the buffers' dtype, which is
        what the HF reference rounds to. Call again after ``to_empty``."""
        self._cos_sin = None
        if self.cos.is_meta:
            return
        inv_freq = rope_inv_freq(self.head_dim, self.rope).to(self.cos.device)
        positions = torch.arange(self.max_positions, device=self.cos.device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [P, D/2]
        scale = self.rope.attention_factor
        with torch.no_grad():
            self.cos.copy_(freqs.cos() * scale)
            self.sin.copy_(freqs.sin() * scale)

    def cos_sin_float32(self) -> torch.Tensor:
        """``[max_positions, D]`` float32: cos in the first half, sin in the second (the
        fused kernels' table; made at the first call, which warm-up makes before capture)."""
        if self._cos_sin is None:
            inv_freq = rope_inv_freq(self.head_dim, self.rope).to(self.cos.device)
            positions = torch.arange(self.max_positions, device=self.cos.device).float()
            freqs = torch.outer(positions, inv_freq)  # [P, D/2]
            scale = self.rope.attention_factor
            self._cos_sin = torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)
        return self._cos_sin

    def forward(self, positions: torch.Tensor) -> Rotation:
        """The rotation of ``positions: [T]`` (each < max_positions)."""
        return self.kernels.rotation(self, positions)


class FusedLinear(ColumnParallelLinear):
    """Several projections of the same input stacked along the output rows; ``shards`` maps
    each checkpoint projection to its rows of ``weight`` (and ``bias``). ``shard_rows`` are
    the checkpoint's rows; under tensor parallelism each projection is cut separately and the
    rank holds its part of each, stacked in the same order."""

    def __init__(
        self, in_features: int, shard_rows: dict[str, int], bias: bool, tp: TPGroup = SINGLE
    ) -> None:
        local = {name: tp.part(rows, f"{name} rows") for name, rows in shard_rows.items()}
        super().__init__(in_features, sum(shard_rows.values()), bias, tp)
        self.checkpoint_rows = dict(shard_rows)
        self.sizes = list(local.values())
        self.shards: dict[str, slice] = {}
        start = 0
        for name, rows in local.items():
            self.shards[name] = slice(start, start + rows)
            start += rows

    def part_rows(self, leaf: str) -> dict[str, slice]:
        """Each checkpoint projection's rows of parameter ``leaf`` (``weight``, ``bias``)."""
        return self.shards


class Attention(nn.Module, Sharded, UsesKernels):
    """Self-attention over the rank's ``num_q_heads`` and ``num_kv_heads`` (the model's
    divided by the group's size); its KV cache holds those KV heads only. Its output is
    summed over the ranks, or with ``summed`` False the rank's part (``RowParallelLinear``)."""

    def __init__(
        self, config: ModelConfig, layer_id: int, tp: TPGroup = SINGLE, summed: bool = True
    ) -> None:
        super().__init__()
        self.tp = tp
        self.layer_id = layer_id
        self.num_q_heads = tp.part(config.num_q_heads, "num_attention_heads")
        self.num_kv_heads = tp.part(config.num_kv_heads, "num_key_value_heads")
        self.head_dim = config.head_dim
        q_rows = config.num_q_heads * config.head_dim
        kv_rows = config.num_kv_heads * config.head_dim
        self.qkv_proj = FusedLinear(
            config.hidden_size,
            {"q": q_rows, "k": kv_rows, "v": kv_rows},
            config.attention_bias,
            tp,
        )
        self.o_proj = RowParallelLinear(q_rows, config.hidden_size, config.o_proj_bias, tp, summed)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        # Each head's sink logit (``AttentionShape.sinks``): the rank's heads'.
        self.sinks = nn.Parameter(torch.empty(self.num_q_heads)) if config.sinks else None

    def param_split(self, name: str) -> Split | None:
        assert name == "sinks", f"{name}: Attention's own parameters are its sinks"
        return self.tp.split(0)  # one a head

    def forward(self, x: torch.Tensor, rotation: Rotation, fb: ForwardBatch) -> torch.Tensor:
        # x: [T, hidden]
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.sizes, dim=-1)
        q = q.view(num_tokens, self.num_q_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.kernels.qk_norm_rotate(
                q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, rotation
            )
        else:
            q, k = rotation.rotate(q, k)
        out = fb.attend(self.layer_id, q, k, v, self.sinks)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.num_q_heads * self.head_dim))


class MLP(nn.Module, UsesKernels):
    """SwiGLU of ``rows`` intermediate rows (None: the config's ``intermediate_size``); its
    output summed over the ranks, or with ``summed`` False the rank's part."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TPGroup = SINGLE,
        rows: int | None = None,
        summed: bool = True,
    ) -> None:
        super().__init__()
        rows = config.intermediate_size if rows is None else rows
        self.gate_up_proj = FusedLinear(config.hidden_size, {"gate": rows, "up": rows}, False, tp)
        self.down_proj = RowParallelLinear(rows, config.hidden_size, False, tp, summed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.silu_mul_forward(self.gate_up_proj(x))


# Builds layer ``layer_id``'s MLP block: ``[T, hidden] -> [T, hidden]``, the rank's part of
# the block's output (the next ``RMSNorm.add`` sums the ranks' parts).
FeedForward = Callable[["ModelConfig", int, TPGroup], nn.Module]


def dense_mlp(config: ModelConfig, layer_id: int, tp: TPGroup) -> nn.Module:
    return MLP(config, tp, summed=False)


class DecoderLayer(nn.Module):
    """Attention and the MLP block, each with its residual add. Both blocks end in the rank's
    part of their output: the norm after each sums the parts with the residual add (one
    kernel where the ranks share peer memory: ``RMSNorm.add``)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        tp: TPGroup = SINGLE,
        feed_forward: FeedForward = dense_mlp,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id, tp, summed=False)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = feed_forward(config, layer_id, tp)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor, rotation: Rotation, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h: [T, hidden]``, the layer's input after ``input_layernorm`` (which the caller
        runs: it sums the previous layer's output into ``residual``, the residual stream).
        Returns the rank's part of the MLP block's output and the stream after attention.
        The adds are fused into the norms, which may update their inputs in place: pass
        tensors the model owns."""
        h = self.self_attn(h, rotation, fb)
        h, residual = self.post_attention_layernorm.add(h, residual, self.tp)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm: HF's ``model.`` prefix."""

    def __init__(
        self, config: ModelConfig, max_positions: int, tp: TPGroup, feed_forward: FeedForward
    ) -> None:
        super().__init__()
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, tp, feed_forward) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope, max_positions)

    def forward(self, input_ids: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return run_layers(
            self.layers,
            self.embed_tokens(input_ids),
            self.norm,
            self.rotary_emb(fb.layout.positions),
            fb,
            self.tp,
        )


def run_layers(
    layers: nn.ModuleList,
    x: torch.Tensor,
    norm: RMSNorm,
    rotation: Rotation,
    fb: ForwardBatch,
    tp: TPGroup = SINGLE,
) -> torch.Tensor:
    """``x: [T, hidden]`` (a tensor the caller hands over, the same on every rank: it becomes
    the residual stream) through ``layers`` and the final ``norm``. Each layer's output is
    summed over the ranks by the next layer's ``input_layernorm`` (the last one's by
    ``norm``), which gives the stream after the layer: captured there (a fresh tensor) for
    each layer in ``fb.capture_layers`` into ``fb.captured``."""
    norms = [cast("DecoderLayer", layer).input_layernorm for layer in layers] + [norm]
    residual, h = x, norms[0](x)
    for layer_id, (layer, after) in enumerate(zip(layers, norms[1:], strict=True)):
        part, residual = layer(h, residual, rotation, fb)
        h, residual = after.add(part, residual, tp)
        if layer_id in fb.capture_layers:
            fb.captured[layer_id] = residual.clone()
    return h


class DecoderForCausalLM(nn.Module, UsesKernels):
    """What every model offers the engine. ``model_type`` names the config family a subclass
    accepts; the architecture-specific shape (biases, q/k norm) comes from ``ModelConfig``.
    Under tensor parallelism (``tp``) each rank builds its shard: the shapes it reports
    (``num_kv_heads``, ``attention_shape``) are the rank's."""

    model_type: str

    def __init__(self, config: ModelConfig, max_positions: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        if config.model_type != self.model_type:
            raise ValueError(
                f"{type(self).__name__} takes model_type {self.model_type!r}, "
                f"not {config.model_type!r}"
            )
        problems = config.tensor_parallel_problems(tp.size)
        if problems:
            raise ValueError("; ".join(problems))
        self.config = config
        self.tp = tp
        self.model = DecoderModel(config, max_positions, tp, self.feed_forward)
        self.lm_head: ColumnParallelLinear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size, False, tp)

    def feed_forward(self, config: ModelConfig, layer_id: int, tp: TPGroup) -> nn.Module:
        """Layer ``layer_id``'s MLP block (a ``FeedForward``): the dense MLP here."""
        return dense_mlp(config, layer_id, tp)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def num_q_heads(self) -> int:
        """The rank's query heads."""
        return self.config.num_q_heads // self.tp.size

    @property
    def num_kv_heads(self) -> int:
        """The rank's KV heads (what its KV cache holds)."""
        return self.config.num_kv_heads // self.tp.size

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def attention_shape(self) -> AttentionShape:
        """The rank's attention: its heads, the model's head dim and scale, its layers'
        sliding windows and sinks."""
        config, head_dim = self.config, self.config.head_dim
        dtype = self.model.embed_tokens.weight.dtype
        return AttentionShape(
            self.num_q_heads, self.num_kv_heads, head_dim, head_dim**-0.5, dtype,
            windows=config.windows, sinks=config.sinks,
        )  # fmt: skip

    def forward(self, input_ids: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """``input_ids: [T]`` int64 -> final-norm hidden states ``[T, hidden]``. Captures the
        residual stream after each layer in ``fb.capture_layers`` into ``fb.captured``."""
        return self.model(input_ids, fb)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden: [n, hidden]`` -> ``[n, vocab]`` float32, the whole vocabulary on every
        rank (gathered under tensor parallelism: greedy choices use ``greedy_tokens``)."""
        return gather_vocab(self.local_logits(hidden), self.tp)

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden: [n, hidden]`` -> ``[n, vocab / N]`` float32: the rank's vocabulary
        slice (``vocab_start ..`` of the embedding), with no communication."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.kernels.linear(hidden, weight, None).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden: [n, hidden]`` -> ``[n]`` int64 argmax ids over the whole vocabulary,
        without gathering the logits (the same on every rank)."""
        return vocab_argmax(self.local_logits(hidden), self.tp)
