"""Dense building blocks of the drafts' training twins: plain batched tensors, no paged KV,
parameter names in the public checkpoint layouts (so a twin's ``state_dict`` is the
checkpoint the daemon's loader fills its fused model from)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DraftShape:
    """A draft decoder layer's shape (plain RoPE)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads do not group over {self.num_kv_heads}")

    @classmethod
    def for_target(
        cls, target_config: Any, intermediate_size: int, num_heads: int, num_kv_heads: int
    ) -> DraftShape:
        """The target's width, RoPE and norm epsilon (the draft reads the target's
        embedding, so its width is the target's)."""
        hidden = target_config.hidden_size
        rope = target_config.rope_parameters or {}
        return cls(
            hidden_size=hidden,
            intermediate_size=intermediate_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=hidden // num_heads,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rms_norm_eps=target_config.rms_norm_eps,
        )

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def config_json(self) -> dict[str, object]:
        """The shape keys of a draft's config.json."""
        return {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "attention_bias": False,
        }


class RMSNorm(nn.Module):
    """As the daemon's: statistics in float32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class SwiGLU(nn.Module):
    """The MLP block: HF's ``mlp.{gate,up,down}_proj``."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE. ``x: [B, heads, T, D]``, ``positions: [T]`` or ``[B, T]``."""
    d = x.shape[-1]
    exponents = torch.arange(0, d, 2, device=x.device, dtype=torch.int64).float() / d
    inv_freq = 1.0 / theta**exponents  # [D/2]
    angles = positions.float()[..., None] * inv_freq  # [(B,) T, D/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    if positions.dim() == 2:
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, D/2]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def split_heads(x: torch.Tensor, heads: int, repeat: int = 1) -> torch.Tensor:
    """``[B, T, heads * D]`` -> ``[B, heads * repeat, T, D]`` (K/V heads repeated per query
    group)."""
    out = x.unflatten(-1, (heads, -1)).transpose(1, 2)
    return out.repeat_interleave(repeat, dim=1) if repeat > 1 else out


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``[B, heads, T, D]`` -> ``[B, T, heads * D]``."""
    return x.transpose(1, 2).flatten(-2)


def init_weights(module: nn.Module, std: float, generator: torch.Generator) -> None:
    """Linear weights N(0, std), norms 1 (drawn in parameter order: reproducible)."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                sample = torch.randn(param.shape, generator=generator) * std
                param.copy_(sample.to(param.device))
