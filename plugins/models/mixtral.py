"""Mixtral (``MixtralForCausalLM``): Llama-style attention without bias, experts in every
layer (``block_sparse_moe``), top-k weights always renormalised."""

from __future__ import annotations

from outrider.plugins.models.moe.block import MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    model_type = "mixtral"
