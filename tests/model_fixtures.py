"""Test-only helpers: tiny random HF checkpoints and a hand-rolled paged KV bookkeeper that
builds ``ForwardBatch``es the way the engine will (pages from a counter starting at 1)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from outrider.plugins.api import NoOptions
from outrider.plugins.attention.base import AttentionBackend
from outrider.plugins.attention.torch_impl import TorchAttention
from outrider.plugins.device import (
    AttentionShape,
    BatchLayout,
    ForwardBatch,
    HostLengths,
    KVCache,
)
from outrider.protocol.messages import TokenLogprob

VOCAB = 300
TINY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "eos_token_id": [1, 2],
}


def mixed_prompts(seed: int, count: int) -> list[list[int]]:
    """Half random, half a short random phrase repeated (n-gram drafts get accepted there)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        if i % 2:
            phrase = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 5))]
            prompts.append(phrase * rng.randint(3, 5))
        else:
            prompts.append([rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 30))])
    return prompts


def hf_greedy(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone, ``new_tokens`` long (no eos)."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def hf_logprobs(
    model: Any, prompts: list[list[int]], continuations: list[list[int]]
) -> list[list[TokenLogprob]]:
    """transformers' log-probabilities along each continuation, teacher-forced: each token's,
    with its position's two best (the reference of the numeric rule, ``numeric_rule.py``)."""
    outputs = []
    for prompt, tokens in zip(prompts, continuations, strict=True):
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top = logprobs.topk(2, dim=-1)
        outputs.append(
            [
                TokenLogprob(token, float(logprobs[i, token]), list(zip(ids, values, strict=True)))
                for i, (token, ids, values) in enumerate(
                    zip(tokens, top.indices.tolist(), top.values.tolist(), strict=True)
                )
            ]
        )
    return outputs


def llama3_rope(theta: float = 10000.0) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }


def save_tiny_model(
    kind: str,
    directory: Path,
    max_shard_size: str = "1GB",
    *,
    vocab_size: int = VOCAB,
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """Build a random float32 HF model of ``kind`` (llama / qwen2 / qwen3, or with experts:
    qwen3_moe / mixtral / qwen2_moe / gpt_oss), save it to ``directory`` and return it (eval
    mode, eager attention and experts: the reference).
    ``config_overrides`` are extra config keys (``attention_bias``, ``rope_parameters`` of
    llama or qwen2, ...)."""
    import transformers

    shape = TINY | {"vocab_size": vocab_size} | (config_overrides or {})
    rope = shape.pop("rope_parameters", None)

    if kind == "llama":
        config: Any = transformers.LlamaConfig(**shape, rope_parameters=rope or llama3_rope())
    elif kind == "qwen2":
        rope = rope or {"rope_theta": 5000.0}
        config = transformers.Qwen2Config(**shape, rope_parameters=rope)
    elif kind == "qwen3":
        # head_dim 24 != hidden_size / heads = 16, tied embeddings.
        config = transformers.Qwen3Config(
            **shape, head_dim=24, tie_word_embeddings=True, rope_parameters={"rope_theta": 1e6}
        )
    elif kind in MOE_SHAPES:
        config = _moe_config(kind, shape | MOE_SHAPES[kind] | (config_overrides or {}))
    elif kind == "gpt_oss":
        shape = shape | GPT_OSS_SHAPE | (config_overrides or {})
        config = transformers.GptOssConfig(**shape, rope_parameters=rope or GPT_OSS_ROPE)
    else:
        raise ValueError(kind)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    # HF initialises biases to 0 and norms to 1; randomise everything so each is exercised.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
    if kind == "gpt_oss":
        # NOTE: older transformers releases hard-code the experts' SwiGLU limit (7.0) whatever
        # the config says; the reference takes the config's, as newer releases do.
        for layer in model.model.layers:
            layer.mlp.experts.limit = config.swiglu_limit
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return model


# Experts of the tiny mixture-of-experts models (on top of TINY, two layers).
MOE_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "norm_topk_prob": True, "head_dim": 24},
    "mixtral": {"num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
                "intermediate_size": 48},
    "qwen2_moe": {"num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48},
}  # fmt: skip


# A tiny gpt-oss (on top of TINY): sliding layers of 4 positions alternating with full ones,
# a SwiGLU limit low enough that random weights clamp, YaRN past 16 positions.
GPT_OSS_SHAPE: dict[str, Any] = {
    "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
    "intermediate_size": 32, "head_dim": 16, "sliding_window": 4, "swiglu_limit": 0.5,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
}  # fmt: skip
GPT_OSS_ROPE: dict[str, Any] = {
    "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16,
}  # fmt: skip


def _moe_config(kind: str, shape: dict[str, Any]) -> Any:
    import transformers

    classes = {
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "mixtral": transformers.MixtralConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
    }
    return classes[kind](**shape, rope_parameters={"rope_theta": 1e6})


def torch_backend(shape: AttentionShape, device: torch.device | str = "cpu") -> TorchAttention:
    return TorchAttention(shape, NoOptions(), torch.device(device))


class PagedRows:
    """Per-slot KV bookkeeping for tests: pages are handed out from a counter starting at 1
    (page 0 is scratch), as a row's length grows."""

    def __init__(
        self,
        *,
        num_layers: int,
        shape: AttentionShape,
        page_size: int,
        max_len: int,
        max_slots: int = 8,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.page_size = page_size
        max_pages = math.ceil(max_len / page_size)
        self.page_table = torch.zeros(max_slots, max_pages, dtype=torch.int32, device=device)
        self.kv = KVCache.allocate(
            num_layers,
            num_pages=1 + max_slots * max_pages,
            page_size=page_size,
            shape=shape,
            dtype=dtype,
            device=self.device,
        )
        self.lengths: dict[int, int] = {}
        self.pages: dict[int, list[int]] = {}  # host mirror of page_table rows
        self.next_page = 1

    def grow(self, slot: int, length: int) -> None:
        """Pages for ``slot`` up to ``length`` positions."""
        pages = self.pages.setdefault(slot, [])
        while len(pages) * self.page_size < length:
            self.page_table[slot, len(pages)] = self.next_page
            pages.append(self.next_page)
            self.next_page += 1

    def batch(
        self,
        backend: AttentionBackend,
        rows: Sequence[tuple[int, Sequence[int]]],
        *,
        kv_slack: int = 0,
        causal: bool = True,
        capture_layers: tuple[int, ...] = (),
        exact: bool = False,
    ) -> tuple[torch.Tensor, ForwardBatch]:
        """Append ``tokens`` to each ``(slot, tokens)`` row: ``(input_ids [T], batch)``.
        ``kv_slack`` widens ``max_kv`` past the longest row (a loose host bound); ``exact``:
        the layout carries the host lengths."""
        max_q = max(len(tokens) for _, tokens in rows)
        ids: list[int] = []
        positions: list[int] = []
        out_loc: list[int] = []
        pad_index: list[int] = []
        q_start = [0]
        seq_lens: list[int] = []
        for row, (slot, tokens) in enumerate(rows):
            start = self.lengths.get(slot, 0)
            end = start + len(tokens)
            self.grow(slot, end)
            self.lengths[slot] = end
            for offset, pos in enumerate(range(start, end)):
                page = self.pages[slot][pos // self.page_size]
                out_loc.append(page * self.page_size + pos % self.page_size)
                pad_index.append(row * max_q + offset)
            ids.extend(tokens)
            positions.extend(range(start, end))
            q_start.append(q_start[-1] + len(tokens))
            seq_lens.append(end)

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        layout = BatchLayout(
            page_table=self.page_table,
            page_size=self.page_size,
            slots=tensor([slot for slot, _ in rows]),
            positions=tensor(positions),
            out_loc=tensor(out_loc),
            q_start=tensor(q_start),
            seq_lens=tensor(seq_lens),
            q_pad_index=tensor(pad_index),
            bs=len(rows),
            max_q=max_q,
            max_kv=max(seq_lens) + kv_slack,
            causal=causal,
            host=HostLengths(tuple(len(t) for _, t in rows), tuple(seq_lens)) if exact else None,
        )
        return tensor(ids), ForwardBatch.bind(layout, backend, self.kv, capture_layers)


def target_shape(target: Path | None = None) -> dict[str, Any]:
    """What a random draft reads of its target: ``target``'s config.json, or (None) the tiny
    targets' shape with the current ``VOCAB``."""
    if target is not None:
        config: dict[str, Any] = json.loads((target / "config.json").read_text())
        return config
    return TINY | {"vocab_size": VOCAB}


def save_random_eagle3(
    directory: Path, target: Path | None = None, heads: dict[str, int] | None = None
) -> Path:
    """A random EAGLE-3 draft for the checkpoint at ``target`` (default: the tiny targets),
    in the public layout: the target's width and vocabulary, its first, middle and last layers
    tapped, and a draft vocabulary half the target's: draft id i stands for target id 2i.
    ``heads``: other attention keys (heads, ``head_dim``) than 4 heads over 2 KV heads."""
    from outrider.plugins.speculative.eagle3_model import load_eagle3
    from recipe.export import save_eagle3

    shape = target_shape(target)
    vocab, layers = shape["vocab_size"], shape["num_hidden_layers"]
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": shape["hidden_size"],
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        **(heads or {}),
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "draft_vocab_size": vocab // 2,
        "rope_theta": 5000.0,
        "max_position_embeddings": shape["max_position_embeddings"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, layers // 2, layers - 1]},
    }
    source = directory / "source"
    source.mkdir(parents=True)
    (source / "config.json").write_text(json.dumps(config))
    torch.manual_seed(3)
    draft = load_eagle3(
        source, dtype=torch.float32, device="cpu", max_positions=256, load_format="dummy"
    )
    draft.d2t.copy_(torch.arange(vocab // 2))
    draft.t2d.zero_()
    draft.t2d[::2] = True
    save_eagle3(draft, directory, config)
    return directory


def save_repeating_eagle3(directory: Path, target: Path) -> Path:
    """An EAGLE-3 draft for the checkpoint at ``target`` that drafts the token it is given
    again: the target's greedy text falls into runs of one token, where these drafts are
    accepted. Its features are zero (``fc``); each row attends to the rows of its own token
    (q and k read the normed embedding, scaled), whose values carry that embedding through the
    identity ``o_proj``; the MLP adds nothing; ``lm_head`` is the target's embedding. Its
    vocabulary is the target's."""
    from safetensors.torch import load_file

    from outrider.plugins.speculative.eagle3_model import load_eagle3
    from recipe.export import save_eagle3

    shape = target_shape(target)
    hidden, vocab, layers = shape["hidden_size"], shape["vocab_size"], shape["num_hidden_layers"]
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,  # values as wide as the embedding
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "rope_theta": 1e6,
        "max_position_embeddings": shape["max_position_embeddings"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, layers // 2, layers - 1]},
    }
    source = directory / "source"
    source.mkdir(parents=True)
    (source / "config.json").write_text(json.dumps(config))
    draft = load_eagle3(
        source, dtype=torch.float32, device="cpu", max_positions=256, load_format="dummy"
    )
    embedding = load_file(target / "model.safetensors")["model.embed_tokens.weight"].float()
    eye = torch.eye(hidden)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        qkv = draft.midlayer.self_attn.qkv_proj
        qkv.weight[qkv.shards["q"], :hidden] = 4 * eye
        qkv.weight[qkv.shards["k"], :hidden] = eye
        qkv.weight[qkv.shards["v"], :hidden] = eye
        draft.midlayer.self_attn.o_proj.weight.copy_(eye)
        draft.lm_head.weight.copy_(embedding)
    save_eagle3(draft, directory, config)
    return directory


def save_random_dflash(directory: Path, block_size: int = 4, target: Path | None = None) -> Path:
    """A random DFlash draft (two Qwen3 layers) for the checkpoint at ``target`` (default: the
    tiny targets), tapping its first two layers (it needs three or more), with the last id as
    its mask token."""
    from outrider.plugins.speculative.dflash_model import load_dflash
    from recipe.export import save_dflash

    shape = target_shape(target)
    vocab = shape["vocab_size"]
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": shape["hidden_size"],
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "max_position_embeddings": shape["max_position_embeddings"],
        "block_size": block_size,
        "num_target_layers": shape["num_hidden_layers"],
        "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": [0, 1]},
    }
    source = directory / "source"
    source.mkdir(parents=True)
    (source / "config.json").write_text(json.dumps(config))
    torch.manual_seed(4)
    draft = load_dflash(
        source, dtype=torch.float32, device="cpu", max_positions=256, load_format="dummy"
    )
    save_dflash(draft, directory, config)
    return directory


def save_drafts(root: Path, target: Path) -> dict[str, str]:
    """A random draft for the checkpoint at ``target`` under each draft algorithm's name, in
    folders under ``root`` (the standalone draft: a tiny qwen2 of the same vocabulary)."""
    vocab = target_shape(target)["vocab_size"]
    with torch.no_grad():
        save_tiny_model("qwen2", root / "standalone", vocab_size=vocab)
    return {
        "eagle3": str(save_random_eagle3(root / "eagle3", target)),
        "dflash": str(save_random_dflash(root / "dflash", target=target)),
        "standalone": str(root / "standalone"),
    }
