"""Model registry: ``architectures[0]`` of config.json -> model class (imported on lookup)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from outrider.plugins.models.layers import DecoderForCausalLM

_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "outrider.plugins.models.llama",
    "Qwen2ForCausalLM": "outrider.plugins.models.qwen2",
    "Qwen3ForCausalLM": "outrider.plugins.models.qwen3",
    "Qwen2MoeForCausalLM": "outrider.plugins.models.qwen2_moe",
    "Qwen3MoeForCausalLM": "outrider.plugins.models.qwen3_moe",
    "MixtralForCausalLM": "outrider.plugins.models.mixtral",
    "GptOssForCausalLM": "outrider.plugins.models.gpt_oss",
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_ARCHITECTURES)


def architecture_problem(architecture: str) -> str | None:
    """One line naming the supported architectures when ``architecture`` is not one; None
    when it is (nothing is imported)."""
    if architecture in _ARCHITECTURES:
        return None
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    return f"architecture {architecture!r} is not supported (supported: {supported})"


def model_class(architecture: str) -> type[DecoderForCausalLM]:
    """The class serving ``architecture``; ValueError naming the supported ones otherwise."""
    problem = architecture_problem(architecture)
    if problem is not None:
        raise ValueError(problem)
    module = _ARCHITECTURES[architecture]
    cls: type[DecoderForCausalLM] = getattr(importlib.import_module(module), architecture)
    return cls
