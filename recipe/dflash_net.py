"""The DFlash draft's training twin: the daemon's ``DFlashDraft`` math on plain batched tensors,
many blocks per sequence at once.

Context: for every position ``j`` of a sequence, ``ctx_j = hidden_norm(fc(taps_j))``; each
layer's context K/V are ``rope(k_norm(k_proj(ctx_j)), j)`` and ``v_proj(ctx_j)`` (no input
norm: exactly what the daemon materialises). A block anchored at ``p`` is ``[x_p, MASK, ...]``
at positions ``p .. p + B - 1``; its queries see the context strictly before ``p`` and the
whole block (non-causal), never another block::

    keys of block a:   context 0 .. p_a - 1   |   block a, slots 0 .. B - 1

Parameter names are the public checkpoint's (``fc``, ``hidden_norm``, ``layers.{i}.*``,
``norm``); the embedding and LM head are the target's.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from recipe.draft_layers import DraftShape, RMSNorm, SwiGLU, merge_heads, rope, split_heads


class DFlashAttention(nn.Module):
    def __init__(self, shape: DraftShape) -> None:
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.shape = shape
        self.q_proj = nn.Linear(h, shape.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, shape.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, shape.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, shape.rms_norm_eps)
        self.k_norm = RMSNorm(d, shape.rms_norm_eps)

    def kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x: [B, T, H]`` -> ``k, v: [B, Hq, T, D]`` (repeated per query group)."""
        s = self.shape
        k = self.k_norm(split_heads(self.k_proj(x), s.num_kv_heads, s.group))
        return rope(k, positions, s.rope_theta), split_heads(
            self.v_proj(x), s.num_kv_heads, s.group
        )

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        context: tuple[torch.Tensor, torch.Tensor],
        visible: torch.Tensor,
        block_size: int,
    ) -> torch.Tensor:
        """``x: [B, A * block_size, H]`` (A blocks, normed), ``positions`` ``[B, A * block]``,
        ``context`` K/V ``[B, Hq, T, D]``, ``visible: [B, A * block, T]`` -> ``[B, A * block,
        H]``."""
        s = self.shape
        q = rope(self.q_norm(split_heads(self.q_proj(x), s.num_heads)), positions, s.rope_theta)
        k, v = self.kv(x, positions)
        ctx_k, ctx_v = context
        b, heads, rows, d = q.shape
        blocks = rows // block_size
        scale = 1.0 / math.sqrt(d)
        on_context = (q @ ctx_k.transpose(-1, -2)) * scale  # [B, Hq, A * block, T]
        on_context = on_context.masked_fill(~visible[:, None], float("-inf"))
        qb = q.view(b, heads, blocks, block_size, d)
        kb, vb = (t.view(b, heads, blocks, block_size, d) for t in (k, v))
        on_block = (qb @ kb.transpose(-1, -2)) * scale  # [B, Hq, A, block, block]
        scores = torch.cat((on_context.view(b, heads, blocks, block_size, -1), on_block), -1)
        probs = scores.float().softmax(-1).to(q.dtype)
        width = ctx_k.shape[-2]
        out = probs[..., :width].reshape(b, heads, rows, width) @ ctx_v
        out = out + (probs[..., width:] @ vb).view(b, heads, rows, d)
        return self.o_proj(merge_heads(out))


class DFlashLayer(nn.Module):
    def __init__(self, shape: DraftShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = DFlashAttention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = SwiGLU(shape.hidden_size, shape.intermediate_size)


class DFlashNet(nn.Module):
    def __init__(
        self, shape: DraftShape, num_layers: int, num_taps: int, target_hidden: int
    ) -> None:
        super().__init__()
        self.fc = nn.Linear(num_taps * target_hidden, shape.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(shape) for _ in range(num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(
        self, embeds: torch.Tensor, anchors: torch.Tensor, taps: torch.Tensor
    ) -> torch.Tensor:
        """``embeds: [B, A, block, H]`` the target's embedding of each block ``[x_p, MASK,
        ...]``, ``anchors: [B, A]`` their positions ``p``, ``taps: [B, T, L * H_t]`` the
        target's features -> the final-norm hidden states ``[B, A, block, H]``."""
        b, blocks, block_size, hidden = embeds.shape
        width = taps.shape[1]
        offsets = torch.arange(block_size, device=anchors.device)
        positions = (anchors[..., None] + offsets).view(b, -1)  # [B, A * block]
        columns = torch.arange(width, device=anchors.device)
        visible = columns[None, None] < anchors[..., None]  # [B, A, T]
        visible = visible.repeat_interleave(block_size, dim=1)  # [B, A * block, T]
        ctx = self.hidden_norm(self.fc(taps))  # [B, T, H]
        ctx_positions = torch.arange(width, device=taps.device)
        x = embeds.reshape(b, -1, hidden)
        for layer in self.layers:
            assert isinstance(layer, DFlashLayer)
            context = layer.self_attn.kv(ctx, ctx_positions)
            h = layer.input_layernorm(x)
            x = x + layer.self_attn(h, positions, context, visible, block_size)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x).view(b, blocks, block_size, hidden)
