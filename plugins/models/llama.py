"""Llama 2/3.x (``LlamaForCausalLM``): GQA, llama3 RoPE scaling, optional attention bias."""

from __future__ import annotations

from outrider.plugins.models.layers import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    # `attention_bias` puts a bias on q/k/v and o_proj alike; no q/k norm.
    model_type = "llama"
