"""The inverse frequencies a ``RopeConfig`` (rope_config.py) implies (``rope_inv_freq``); the
rotary tables built from them are layers.py's ``RotaryEmbedding``, which scales cos and sin by
``RopeConfig.attention_factor``."""

from __future__ import annotations

import math

import torch

from outrider.plugins.models.rope_config import RopeConfig, YarnScaling


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32, with llama3 or YaRN scaling when
    configured."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if rope.yarn is not None:
        return _yarn_inv_freq(head_dim, rope.theta**exponents, rope.theta, rope.yarn)
    inv_freq = 1.0 / (rope.theta**exponents)
    scaling = rope.llama3
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


def _yarn_inv_freq(
    head_dim: int, wavelength_base: torch.Tensor, theta: float, yarn: YarnScaling
) -> torch.Tensor:
    """YaRN's frequencies (``YarnScaling``) from ``theta ** (2i / head_dim)``."""

    def dim_of(rotations: float) -> float:
        # The dimension pair that turns ``rotations`` times over the original context.
        turns = yarn.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low, high = dim_of(yarn.beta_fast), dim_of(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of one step
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)
    kept = 1 - ramp.clamp(0, 1)  # 1: the original frequency, 0: divided by the factor
    interpolated = 1.0 / (yarn.factor * wavelength_base)
    return interpolated * (1 - kept) + (1.0 / wavelength_base) * kept
