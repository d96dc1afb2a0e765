"""The o200k vocabulary (gpt-oss's, the harmony encoding's) and a gpt-oss tokenizer built from
it, for the harmony tests.

The vocabulary file is tiktoken's ``o200k_base.tiktoken``. The ``litellm`` wheel on the
package index carries a copy (its tiktoken cache, named by a hash of the file's address), found
here by the file's own SHA-256, which the ``openai-harmony`` package checks too. The tokenizer
is transformers' conversion of that file (``TikTokenConverter``, which reads it through
``tiktoken``) with the special tokens the harmony encoding names at ids 199,998 to 201,087, as a
gpt-oss checkpoint's ``tokenizer.json`` holds them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
from index_wheels import cache_root, index_wheel

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
LITELLM = "1.110.2"
TIKTOKEN_CACHE = "litellm/litellm_core_utils/tokenizers/"
# tiktoken's pre-tokenizer pattern for o200k.
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
FIRST_SPECIAL, VOCAB_SIZE = 199_998, 201_088


def o200k_vocab_dir() -> Path:
    """A folder holding ``o200k_base.tiktoken`` (cached; taken from the ``litellm`` wheel on
    first use); skips the calling test where the wheel cannot be had."""
    folder = cache_root() / "o200k"
    path = folder / "o200k_base.tiktoken"
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == O200K_SHA256:
        return folder
    wheel = index_wheel(f"litellm=={LITELLM}", f"litellm-{LITELLM}-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.startswith(TIKTOKEN_CACHE) and "." not in Path(name).name:
                data = archive.read(name)
                if hashlib.sha256(data).hexdigest() == O200K_SHA256:
                    folder.mkdir(parents=True, exist_ok=True)
                    part = path.with_suffix(".part")
                    part.write_bytes(data)
                    part.replace(path)
                    return folder
    pytest.skip(f"litellm {LITELLM}'s wheel holds no o200k vocabulary file")


def save_gpt_oss_tokenizer(vocab_dir: Path, out: Path) -> Path:
    """A gpt-oss tokenizer (o200k and the harmony special tokens) saved into ``out``."""
    if importlib.util.find_spec("tiktoken") is None:
        pytest.skip("converting the o200k vocabulary needs tiktoken")
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from outrider.daemon.harmony import load_encoding_from

    encoding = load_encoding_from(vocab_dir)
    specials = [encoding.decode([i]) for i in range(FIRST_SPECIAL, VOCAB_SIZE)]
    converted = TikTokenConverter(
        vocab_file=str(vocab_dir / "o200k_base.tiktoken"),
        pattern=O200K_PATTERN,
        extra_special_tokens=specials,
    ).converted()
    PreTrainedTokenizerFast(tokenizer_object=converted).save_pretrained(out)
    return out


HARMONY_EOS = [200002, 200012]  # <|return|>, <|call|>


def save_scripted_gpt_oss(tokenizer_dir: Path, out: Path, output: list[int]) -> Path:
    """A tiny gpt-oss with the gpt-oss tokenizer saved in ``tokenizer_dir`` whose greedy
    output for any chat (a harmony prompt ends in "<|start|>assistant") is ``output`` (its
    last token an end of turn, ``HARMONY_EOS``).

    Its layers add nothing to the residual stream (attention's and the experts' output
    projections and biases zero), so the logits read the current token's embedding alone: the
    prompt's last token ("assistant") and each output token but the last embed as distinct
    unit vectors, and the LM head maps each to its successor. Its tokens must be distinct
    (no more than the hidden size)."""
    import torch
    from model_fixtures import save_tiny_model

    assert output[-1] in HARMONY_EOS
    inputs = [173_781, *output[:-1]]  # "assistant", then each output token feeds the next
    assert len(set(inputs)) == len(inputs)
    model = save_tiny_model("gpt_oss", out, vocab_size=VOCAB_SIZE)
    hidden = model.config.hidden_size
    assert len(inputs) <= hidden
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.self_attn.o_proj.bias.zero_()
            layer.mlp.experts.down_proj.zero_()
            layer.mlp.experts.down_proj_bias.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        for position, (token, successor) in enumerate(zip(inputs, output, strict=True)):
            model.model.embed_tokens.weight[token] = torch.nn.functional.one_hot(
                torch.tensor(position), hidden
            ).float()
            model.lm_head.weight[successor, position] = 4.0  # logit 32 after the norm
    return _save_gpt_oss(model, tokenizer_dir, out)


def save_random_gpt_oss(tokenizer_dir: Path, out: Path) -> Path:
    """A tiny random gpt-oss with the gpt-oss tokenizer saved in ``tokenizer_dir``."""
    import torch
    from model_fixtures import save_tiny_model

    with torch.no_grad():
        model = save_tiny_model("gpt_oss", out, vocab_size=VOCAB_SIZE)
    return _save_gpt_oss(model, tokenizer_dir, out)


def _save_gpt_oss(model: Any, tokenizer_dir: Path, out: Path) -> Path:
    """``model`` saved to ``out`` beside the gpt-oss tokenizer, its turns ending as gpt-oss's
    do (``HARMONY_EOS``, in its config and its generation config)."""
    from transformers import GenerationConfig

    model.config.eos_token_id = HARMONY_EOS
    model.save_pretrained(out)
    GenerationConfig(eos_token_id=HARMONY_EOS).save_pretrained(out)
    for part in tokenizer_dir.iterdir():
        shutil.copy(part, out / part.name)
    return out
