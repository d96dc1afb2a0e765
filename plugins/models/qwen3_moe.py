"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (q/k norm), experts in the layers
``decoder_sparse_step`` and ``mlp_only_layers`` leave sparse, top-k weights renormalised when
``norm_topk_prob`` says so."""

from __future__ import annotations

from outrider.plugins.models.moe.block import MoeForCausalLM


class Qwen3MoeForCausalLM(MoeForCausalLM):
    model_type = "qwen3_moe"
