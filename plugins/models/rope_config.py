"""RoPE as config.json gives it (``RopeConfig``: plain, llama3-scaled or YaRN, parsed from
transformers' v4 ``rope_theta`` / ``rope_scaling`` or v5 ``rope_parameters``), without torch:
the front door and the HTTP front read model configs too. The frequencies it implies are
rope.py's."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

_DEFAULT_ROPE_THETA = 10000.0  # HF's default when a config names none


@dataclass(frozen=True)
class Llama3Scaling:
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (``rope_type`` yarn): frequencies whose wavelength passes the pretraining
    context are divided by ``factor``, those that rotate fast enough kept, a linear ramp
    between (its ends from ``beta_fast`` and ``beta_slow`` rotations over the original context,
    rounded outwards where ``truncate``); cos and sin are scaled by ``attention_factor``."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    truncate: bool
    attention_factor: float


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    llama3: Llama3Scaling | None = None  # None: plain RoPE
    yarn: YarnScaling | None = None

    @property
    def attention_factor(self) -> float:
        """The scale of the cos and sin tables (YaRN's; 1 otherwise)."""
        return 1.0 if self.yarn is None else self.yarn.attention_factor


def parse_rope(d: dict[str, Any]) -> RopeConfig:
    # v5 writes `rope_parameters` (theta inside); v4 has `rope_theta` + `rope_scaling`. A v5
    # config read by transformers 4 keeps `rope_parameters` as an extra key, so it wins.
    params = d.get("rope_parameters")
    if params is None:
        params = dict(d.get("rope_scaling") or {})
        params.setdefault("rope_theta", d.get("rope_theta") or _DEFAULT_ROPE_THETA)
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta") or _DEFAULT_ROPE_THETA)
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "llama3":
        scaling = Llama3Scaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
        return RopeConfig(theta=theta, llama3=scaling)
    if rope_type == "yarn":
        return RopeConfig(theta=theta, yarn=_parse_yarn(params, d))
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, llama3, yarn)")


def _parse_yarn(params: dict[str, Any], d: dict[str, Any]) -> YarnScaling:
    """YaRN's parameters with transformers' defaults: ``factor`` the context's growth over
    the original, ``beta_fast`` 32, ``beta_slow`` 1, ``truncate`` on, ``attention_factor``
    ``0.1 ln(factor) + 1`` (from ``mscale`` over ``mscale_all_dim`` where both are given)."""
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(d["max_position_embeddings"]) / original if factor is None else float(factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor, 1.0)
    return YarnScaling(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention_factor),
    )


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0
