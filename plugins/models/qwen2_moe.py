"""Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2's attention (q/k/v bias), routed experts plus
a shared expert scaled by its sigmoid gate, in the layers the config leaves sparse."""

from __future__ import annotations

from outrider.plugins.models.moe.block import MoeForCausalLM


class Qwen2MoeForCausalLM(MoeForCausalLM):
    model_type = "qwen2_moe"
