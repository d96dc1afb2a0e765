"""Qwen3 dense (``Qwen3ForCausalLM``): per-head RMSNorm on q and k before RoPE, explicit
``head_dim`` (not hidden_size / heads), optional attention bias."""

from __future__ import annotations

from outrider.plugins.models.layers import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    model_type = "qwen3"
