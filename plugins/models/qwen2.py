"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): GQA with q/k/v bias and no o_proj bias."""

from __future__ import annotations

from outrider.plugins.models.layers import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    # The q/k/v bias is hard-coded in HF's modeling file, not in config.json; ModelConfig sets
    # it from model_type. Sliding-window configs are refused by the config parser.
    model_type = "qwen2"
