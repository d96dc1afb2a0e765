"""The EAGLE-3 draft's training twin: the daemon's ``Eagle3Draft`` math on plain batched
tensors, unrolled for the training-time test.

Positions, as the daemon's worker reads them: draft row ``t`` takes the token at ``t + 1``
and the target's feature at ``t`` and predicts the token at ``t + 2``. While drafting, the row
at ``t + k`` (step ``k``) takes the draft's own output of row ``t + k - 1`` as its feature and
attends to the rows ``<= t`` (target features) plus the rows ``t + 1 .. t + k`` drafted before
it. The unroll computes exactly that for every base row ``i`` at once::

    step k, base row i:  token x[i+k+1], position i+k, predicts x[i+k+2]
                         feat = fc(taps[i]) at k = 0, else y[k-1][i]
                         keys = step-0 rows 0..i, and row i of steps 1..k

Parameter names are the public checkpoint's (``fc``, ``midlayer.*``, ``norm``, ``lm_head``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from recipe.draft_layers import DraftShape, RMSNorm, SwiGLU, merge_heads, rope, split_heads


class Eagle3Attention(nn.Module):
    """q/k/v read the 2H-wide ``concat(input_layernorm(embed), hidden_norm(feat))``."""

    def __init__(self, shape: DraftShape) -> None:
        super().__init__()
        width, d = 2 * shape.hidden_size, shape.head_dim
        self.q_proj = nn.Linear(width, shape.num_heads * d, bias=False)
        self.k_proj = nn.Linear(width, shape.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(width, shape.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * d, shape.hidden_size, bias=False)


class Eagle3Layer(nn.Module):
    """HF's ``midlayer``."""

    def __init__(self, shape: DraftShape) -> None:
        super().__init__()
        self.shape = shape
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.hidden_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Eagle3Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = SwiGLU(shape.hidden_size, shape.intermediate_size)

    def qkv(
        self, embeds: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``embeds, feat: [B, n, H]`` -> ``q, k, v: [B, Hq, n, D]`` (K/V repeated per query
        group, RoPE at ``positions: [n]``)."""
        s, a = self.shape, self.self_attn
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(feat)), dim=-1)
        q = rope(split_heads(a.q_proj(x), s.num_heads), positions, s.rope_theta)
        k = rope(split_heads(a.k_proj(x), s.num_kv_heads, s.group), positions, s.rope_theta)
        return q, k, split_heads(a.v_proj(x), s.num_kv_heads, s.group)

    def out(self, feat: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """``attn: [B, Hq, n, D]`` -> ``y: [B, n, H]`` (o_proj, residual ``feat``, MLP)."""
        h = feat + self.self_attn.o_proj(merge_heads(attn))
        return h + self.mlp(self.post_attention_layernorm(h))


def unrolled_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]
) -> torch.Tensor:
    """Row ``i`` of ``q: [B, Hq, n, D]`` attends to rows ``0 .. i`` of ``keys[0]`` (causal)
    and to row ``i`` of each later entry (its own rows of the steps before)."""
    n, scale = q.shape[-2], 1.0 / math.sqrt(q.shape[-1])
    causal = (q @ keys[0].transpose(-1, -2)) * scale  # [B, Hq, n, n]
    future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    causal = causal.masked_fill(future, float("-inf"))
    own = [(q * k).sum(-1, keepdim=True) * scale for k in keys[1:]]  # [B, Hq, n, 1] each
    probs = torch.cat((causal, *own), dim=-1).float().softmax(-1).to(q.dtype)
    out = probs[..., :n] @ values[0]
    for j, v in enumerate(values[1:]):
        out = out + probs[..., n + j, None] * v
    return out


class Eagle3Net(nn.Module):
    def __init__(self, shape: DraftShape, target_hidden_size: int, draft_vocab_size: int) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * target_hidden_size, shape.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(shape)
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, draft_vocab_size, bias=False)

    def unroll(self, embeds: torch.Tensor, taps: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The training-time test over ``n`` base rows: ``embeds: [B, n + steps - 1, H]`` the
        target's embedding of the tokens at ``1 .. n + steps - 1``, ``taps: [B, n, 3 * H_t]``
        the target's features at ``0 .. n - 1`` -> per step ``k`` the draft's outputs
        ``y_k: [B, n, H]`` (before the final norm)."""
        n = taps.shape[1]
        feat = self.fc(taps)  # [B, n, H]
        positions = torch.arange(n, device=taps.device)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outputs = []
        for k in range(steps):
            q, key, value = self.midlayer.qkv(embeds[:, k : k + n], feat, positions + k)
            keys.append(key)
            values.append(value)
            feat = self.midlayer.out(feat, unrolled_attention(q, keys, values))
            outputs.append(feat)
        return outputs

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """``y: [..., H]`` -> ``[..., draft_vocab]``."""
        return self.lm_head(self.norm(y))
