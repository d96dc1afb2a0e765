"""The target's shape (a Qwen3 decoder: q/k norm, GQA, RoPE, tied embeddings) and its export
as a Hugging Face directory that both transformers and Outrider's loader read."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from recipe import chat
from recipe.tokenizer import TOKENIZER_CONFIG, TOKENIZER_JSON

if TYPE_CHECKING:
    from transformers import Qwen3Config, Qwen3ForCausalLM

EXPORT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    TOKENIZER_JSON,
    TOKENIZER_CONFIG,
)
EOS_ID = chat.SPECIAL_TOKENS.index(chat.IM_END)
PAD_ID = chat.SPECIAL_TOKENS.index(chat.ENDOFTEXT)
# The sampling defaults generation_config.json gives requests that leave them out, chosen on the
# shipped family by benchmarks/family_generation.py (BENCHMARKS.md, "Sampling defaults of the
# embedded family"): below temperature 1, or with top_k, most outputs fall into loops.
GENERATION_DEFAULTS: dict[str, bool | float | int] = {
    "do_sample": True,
    "temperature": 1.0,
    "top_p": 0.95,
    "top_k": 0,
}


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0


SHAPES: dict[str, ModelShape] = {
    # 9,181,056 parameters with an 8192-token vocabulary (the embedding counted once).
    "small": ModelShape(
        hidden_size=256,
        num_layers=9,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=768,
    ),
    # For the CPU smoke tests; four layers leave three distinct draft taps in 0..N-2.
    "tiny": ModelShape(
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
    ),
}


def qwen3_config(shape: ModelShape, vocab_size: int, max_positions: int) -> Qwen3Config:
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    return config


def build(config: Qwen3Config, seed: int, device: str) -> Qwen3ForCausalLM:
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        return Qwen3ForCausalLM(config)


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters: the tied embedding / LM head counts once."""
    return sum(p.numel() for p in model.parameters())


def export(
    model: Qwen3ForCausalLM, tokenizer_dir: Path, export_dir: Path, dtype: torch.dtype
) -> None:
    """config.json, generation_config.json (eos ``<|im_end|>``, ``GENERATION_DEFAULTS``),
    model.safetensors in ``dtype`` without ``lm_head.weight`` (tied), and the tokenizer stage's
    files, byte for byte."""
    import copy

    from safetensors.torch import save_file
    from transformers import GenerationConfig

    if export_dir.exists():
        shutil.rmtree(export_dir)
    export_dir.mkdir(parents=True)
    weights = {
        name: tensor.detach().to(device="cpu", dtype=dtype).contiguous()
        for name, tensor in model.state_dict().items()
        if name != "lm_head.weight"
    }
    save_file(weights, str(export_dir / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    config.dtype = dtype
    config.save_pretrained(export_dir)
    generation = GenerationConfig(
        bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=PAD_ID, **GENERATION_DEFAULTS
    )
    generation.save_pretrained(export_dir)
    for name in (TOKENIZER_JSON, TOKENIZER_CONFIG):
        shutil.copyfile(tokenizer_dir / name, export_dir / name)
    written = sorted(p.name for p in export_dir.iterdir())
    if written != sorted(EXPORT_FILES):
        raise ValueError(f"unexpected export layout {written}, expected {sorted(EXPORT_FILES)}")
