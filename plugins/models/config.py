"""The model facts Outrider needs, parsed once from a HF config.json (ARCHITECTURE.md 4.5).

``--model`` is a directory or a config.json path. transformers' ``AutoConfig`` reads it and
normalises the v4 keys (``rope_theta``, ``rope_scaling``, ``torch_dtype``) and the v5 ones
(``rope_parameters``, ``dtype``); both spellings are accepted here so that either major version
of transformers works. RoPE's own facts are rope.py's.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outrider.plugins.models.fp8.config import FP8_EXPERTS_REFUSAL, Fp8Config, parse_quantization
from outrider.plugins.models.rope_config import RopeConfig, parse_rope

log = logging.getLogger(__name__)

TENSOR_PARALLEL_FLAG = "--tensor-parallel-size"


@dataclass(frozen=True)
class _Family:
    """What HF hard-codes per model_type in its modeling file instead of config.json."""

    qkv_bias: bool | None  # None: config.json's `attention_bias`
    o_proj_bias: bool | None
    qk_norm: bool


_FAMILIES: dict[str, _Family] = {
    "llama": _Family(qkv_bias=None, o_proj_bias=None, qk_norm=False),
    "qwen2": _Family(qkv_bias=True, o_proj_bias=False, qk_norm=False),
    "qwen3": _Family(qkv_bias=None, o_proj_bias=None, qk_norm=True),
    "qwen2_moe": _Family(qkv_bias=True, o_proj_bias=False, qk_norm=False),
    "qwen3_moe": _Family(qkv_bias=None, o_proj_bias=None, qk_norm=True),
    "mixtral": _Family(qkv_bias=False, o_proj_bias=False, qk_norm=False),
    "gpt_oss": _Family(qkv_bias=None, o_proj_bias=None, qk_norm=False),
}


@dataclass(frozen=True)
class ClampedSwiglu:
    """gpt-oss's experts (``gpt_oss.py``): the gate clamped above at ``limit``, the up
    projection within ``±limit``, then ``gate * sigmoid(alpha * gate) * (up + 1)``; their
    projections and the router carry biases."""

    alpha: float
    limit: float


@dataclass(frozen=True)
class MoeConfig:
    """The mixture-of-experts facts of a model (``moe/block.py``)."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # of one expert
    intermediate_key: str  # the config.json key holding it, for messages
    renormalize: bool  # the top-k routing weights divided by their sum
    sparse_layers: frozenset[int]  # layers with experts; the others run the dense MLP
    shared_expert_size: int  # Qwen2-MoE's always-on expert; 0: none
    clamped_swiglu: ClampedSwiglu | None = None  # gpt-oss's experts; None: SiLU-gated

    @property
    def shares(self) -> dict[str, int]:
        """The expert sizes tensor parallelism divides (as ``ModelConfig.layer_shares``):
        each expert's rows, or, for gpt-oss's experts, the experts (each rank holds some
        whole: expert parallelism, gpt_oss.py)."""
        if self.clamped_swiglu is not None:
            return {"num_local_experts": self.num_experts}
        shares = {self.intermediate_key: self.intermediate_size}
        if self.shared_expert_size:
            shares["shared_expert_intermediate_size"] = self.shared_expert_size
        return shares


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # architectures[0]
    model_type: str
    hidden_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool  # bias on q/k/v
    o_proj_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    dtype: str | None  # checkpoint dtype ("bfloat16", ...); None when the config is silent
    eos_token_ids: tuple[int, ...]  # config.json's only; see load_eos_ids for the union
    moe: MoeConfig | None = None  # None: a dense model
    fp8: Fp8Config | None = None  # the checkpoint's FP8 format (fp8/config.py); None: 16-bit
    # Per layer, its sliding window (``AttentionShape.windows``); empty: none anywhere.
    windows: tuple[int, ...] = ()
    sinks: bool = False  # each attention head's learned sink logit (gpt-oss)
    mxfp4_experts: bool = False  # gpt-oss's experts stored in mxfp4 (``quant_method: mxfp4``)

    @property
    def dense_layers(self) -> int:
        """How many layers run the dense MLP (of ``intermediate_size`` rows)."""
        return self.num_layers - (0 if self.moe is None else len(self.moe.sparse_layers))

    @property
    def mlp_rows_per_token(self) -> int:
        """Intermediate rows one token runs through in the widest MLP block: the dense
        MLP's, or its experts' and the shared expert's."""
        dense = self.intermediate_size if self.dense_layers else 0
        if self.moe is None:
            return dense
        return max(dense, self.moe.top_k * self.moe.intermediate_size + self.moe.shared_expert_size)

    @property
    def layer_shares(self) -> dict[str, int]:
        """The config keys (and values) that tensor parallelism divides among the ranks
        in every decoder layer: heads, KV heads, MLP rows (each expert's too)."""
        shares = {
            "num_attention_heads": self.num_q_heads,
            "num_key_value_heads": self.num_kv_heads,
        }
        if self.dense_layers:
            shares["intermediate_size"] = self.intermediate_size
        return shares if self.moe is None else shares | self.moe.shares

    def tensor_parallel_problems(self, size: int) -> list[str]:
        """``tensor_parallel_problems`` of this model's shape."""
        shape = self.layer_shares | {"vocab_size": self.vocab_size, "model_type": self.model_type}
        return tensor_parallel_problems(shape, size)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Parse a model directory or a config.json path. Raises ValueError for a model that
        Outrider cannot run (unknown model_type, rope type, activation, sliding window).

        A config.json that gives every key whose default depends on the family
        (``config_is_complete``) is read as it is; any other goes through transformers'
        ``AutoConfig``, which supplies those defaults (and costs seconds of imports)."""
        file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
        try:
            raw = json.loads(file.read_text())
        except (OSError, ValueError):
            raw = None
        if isinstance(raw, dict) and config_is_complete(raw):
            return cls.from_dict(raw)
        from transformers import AutoConfig

        return cls.from_dict(AutoConfig.from_pretrained(str(path)).to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse the ``to_dict()`` of a transformers config (v4 or v5 keys)."""
        problem = model_type_problem(d)
        if problem is not None:
            raise ValueError(problem)
        model_type = str(d["model_type"])
        family = _FAMILIES[model_type]
        architectures = d.get("architectures") or []
        if not architectures:
            raise ValueError("config.json has no `architectures` entry")
        _check_supported(d)
        attention_bias = bool(d.get("attention_bias", False))
        num_q_heads = int(d["num_attention_heads"])
        hidden_size = int(d["hidden_size"])
        num_layers = int(d["num_hidden_layers"])
        moe = _parse_moe(d, model_type, num_layers)
        quantization = d.get("quantization_config")
        mxfp4 = _mxfp4_experts(quantization, model_type)
        fp8 = None if mxfp4 else parse_quantization(quantization)
        if moe is not None and moe.sparse_layers and fp8 is not None and fp8.block is None:
            raise ValueError(FP8_EXPERTS_REFUSAL)
        return cls(
            architecture=architectures[0],
            model_type=model_type,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_q_heads=num_q_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_q_heads),
            head_dim=int(d.get("head_dim") or hidden_size // num_q_heads),
            intermediate_size=int(d["intermediate_size"]),
            vocab_size=int(d["vocab_size"]),
            rms_norm_eps=float(d["rms_norm_eps"]),
            rope=parse_rope(d),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d["max_position_embeddings"]),
            attention_bias=attention_bias if family.qkv_bias is None else family.qkv_bias,
            o_proj_bias=attention_bias if family.o_proj_bias is None else family.o_proj_bias,
            qk_norm=family.qk_norm,
            dtype=_parse_dtype(d.get("dtype") or d.get("torch_dtype")),
            eos_token_ids=_as_ids(d.get("eos_token_id")),
            moe=moe,
            fp8=fp8,
            windows=_parse_windows(d, model_type, num_layers),
            sinks=model_type == "gpt_oss",
            mxfp4_experts=mxfp4,
        )


# The keys ``from_dict`` reads whose default, when config.json leaves them out, transformers'
# config class of the family supplies (Qwen3's head_dim of 128 against hidden / heads,
# Mixtral's rope theta of 1e6, Llama's eos id 2, the experts' counts, ...).
_KEYS_EVERY_FAMILY = (
    "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "vocab_size", "rms_norm_eps",
    "max_position_embeddings", "eos_token_id", "tie_word_embeddings",
)  # fmt: skip
_KEYS_OF_FAMILY: dict[str, tuple[str, ...]] = {
    "llama": (),
    "qwen2": (),
    "qwen3": ("head_dim",),
    "qwen2_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "norm_topk_prob"),
    "qwen3_moe": ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"),
    "mixtral": ("num_local_experts", "num_experts_per_tok"),
    "gpt_oss": ("num_local_experts", "num_experts_per_tok", "head_dim", "attention_bias",
                "sliding_window", "layer_types", "swiglu_limit"),
}  # fmt: skip

# gpt-oss's gate scale: the published config.json leaves it out, and transformers hard-codes it
# (older releases) or defaults to it (newer ones): no config class is needed to know it.
GPT_OSS_SWIGLU_ALPHA = 1.702


def config_is_complete(d: dict[str, Any]) -> bool:
    """Whether config.json ``d`` (raw keys) gives every key whose default depends on its
    family, so that ``from_dict`` reads it as transformers would (a model type not served
    here: False, and ``from_dict`` refuses it after AutoConfig)."""
    keys = _KEYS_OF_FAMILY.get(str(d.get("model_type")))
    if keys is None:
        return False
    rope = "rope_parameters" in d or "rope_theta" in d
    experts = d.get("model_type") != "qwen3_moe" or "num_experts" in d or "num_local_experts" in d
    return rope and experts and all(key in d for key in (*_KEYS_EVERY_FAMILY, *keys))


def model_type_problem(d: dict[str, Any]) -> str | None:
    """What keeps a model of config.json ``d`` (raw keys: no transformers needed) from being
    parsed: a ``model_type`` without a family here; one line naming the supported ones, None
    when it is known."""
    model_type = d.get("model_type")
    if isinstance(model_type, str) and model_type in _FAMILIES:
        return None
    supported = ", ".join(sorted(_FAMILIES))
    return f"model_type {model_type!r} is not supported (supported: {supported})"


def tensor_parallel_problems(
    d: dict[str, Any], size: int, whose: str = "the model's", vocab_key: str = "vocab_size"
) -> list[str]:
    """What keeps a model of config.json ``d`` (raw keys: no transformers needed) from being
    sharded over ``size`` ranks: each rank takes an equal share of the attention heads, the KV
    heads, the MLP's (and each expert's) intermediate rows (gpt-oss: of its experts, whole)
    and the vocabulary of its head
    (``vocab_key``; keys absent from ``d`` are not checked). One line per problem, naming the
    flag and ``whose`` shape it is; empty when it divides (always for ``size`` 1)."""
    if size < 1:
        return [f"{TENSOR_PARALLEL_FLAG} {size}: must be at least 1"]
    heads = d.get("num_attention_heads")
    whole_experts = d.get("model_type") == "gpt_oss"  # split by expert, not by rows
    shares = {
        "num_attention_heads": heads,
        "num_key_value_heads": d.get("num_key_value_heads") or heads,
        "num_local_experts": d.get("num_local_experts") if whole_experts else None,
        "intermediate_size": None if whole_experts else d.get("intermediate_size"),
        "moe_intermediate_size": d.get("moe_intermediate_size"),
        "shared_expert_intermediate_size": d.get("shared_expert_intermediate_size"),
        vocab_key: d.get(vocab_key),
    }
    return [
        f"{TENSOR_PARALLEL_FLAG} {size} does not divide {whose} {key} ({value}): "
        "each rank takes an equal share"
        for key, value in shares.items()
        if isinstance(value, int) and value % size
    ]


def _check_supported(d: dict[str, Any]) -> None:
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (only silu)")
    if d.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    if d.get("use_sliding_window"):
        raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")


# The layer types each family's sliding windows come as (every family: full attention).
_SLIDING_FAMILIES = frozenset({"gpt_oss"})


def _parse_windows(d: dict[str, Any], model_type: str, num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window from ``layer_types`` and ``sliding_window`` (gpt-oss);
    empty where every layer attends to the whole context."""
    layer_types = list(d.get("layer_types") or ["full_attention"] * num_layers)
    allowed = {"full_attention"}
    if model_type in _SLIDING_FAMILIES:
        allowed.add("sliding_attention")
    if not set(layer_types) <= allowed or len(layer_types) != num_layers:
        raise ValueError(
            f"layer_types {sorted(set(layer_types))} of {len(layer_types)} layers are not "
            f"supported for {model_type} ({', '.join(sorted(allowed))}, one per layer)"
        )
    if "sliding_attention" not in layer_types:
        return ()
    window = int(d["sliding_window"])
    if window < 1:
        raise ValueError(f"sliding_window {window} is not supported (at least 1)")
    return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)


def _mxfp4_experts(quantization: dict[str, Any] | None, model_type: str) -> bool:
    """Whether ``quantization_config`` stores gpt-oss's experts in mxfp4 (every other
    tensor unquantized, as the published checkpoints are); ValueError for mxfp4 elsewhere."""
    if quantization is None or quantization.get("quant_method") != "mxfp4":
        return False
    if model_type != "gpt_oss":
        raise ValueError(f"quant_method 'mxfp4' is supported for gpt_oss only, not {model_type}")
    return True


def _parse_moe(d: dict[str, Any], model_type: str, num_layers: int) -> MoeConfig | None:
    """The experts of a Qwen2-MoE, Qwen3-MoE or Mixtral config; None for a dense model type."""
    dense_only: set[int] = set()
    if model_type == "mixtral":
        # Mixtral applies `sliding_window` whenever it is set (no use_sliding_window switch).
        if d.get("sliding_window") is not None:
            raise ValueError("sliding-window attention (sliding_window set) is not supported")
        num_experts = int(d["num_local_experts"])
        key, step, renormalize = "intermediate_size", 1, True
    elif model_type == "gpt_oss":
        # A softmax over the top-k router logits: the renormalised top-k of the softmax.
        num_experts = int(d["num_local_experts"])
        key, step, renormalize = "intermediate_size", 1, True
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        # transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`.
        num_experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
        key, step = "moe_intermediate_size", int(d.get("decoder_sparse_step", 1))
        dense_only = {int(i) for i in d.get("mlp_only_layers") or ()}
        renormalize = bool(d.get("norm_topk_prob", False))
        if step < 1:
            raise ValueError(f"decoder_sparse_step {step} is not supported (at least 1)")
    else:
        return None
    shared = int(d.get("shared_expert_intermediate_size") or 0)
    if model_type == "qwen2_moe" and (shared < 1 or d.get("qkv_bias") is False):
        raise ValueError("qwen2_moe without a shared expert or without qkv_bias is not supported")
    sparse = frozenset(
        i for i in range(num_layers) if num_experts and i not in dense_only and (i + 1) % step == 0
    )
    top_k = int(d["num_experts_per_tok"])
    if sparse and not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} is not between 1 and {num_experts}")
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=int(d[key]),
        intermediate_key=key,
        renormalize=renormalize,
        sparse_layers=sparse,
        shared_expert_size=shared if model_type == "qwen2_moe" else 0,
        clamped_swiglu=(
            ClampedSwiglu(
                float(d.get("swiglu_alpha", GPT_OSS_SWIGLU_ALPHA)), float(d["swiglu_limit"])
            )
            if model_type == "gpt_oss"
            else None
        ),
    )


def _parse_dtype(value: object) -> str | None:
    if value is None:
        return None
    return str(value).removeprefix("torch.")


def _as_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    raise ValueError(f"eos_token_id must be an int or a list of ints, not {value!r}")


def model_dir(path: str | Path) -> Path:
    """The directory holding weights and tokenizer files (``path`` or a config.json's parent)."""
    path = Path(path)
    return path.parent if path.is_file() else path


def load_eos_ids(path: str | Path, config: ModelConfig) -> frozenset[int]:
    """The EOS set: config.json's ``eos_token_id``, generation_config.json's, and the
    tokenizer's ``eos_token`` (tokenizer_config.json mapped through tokenizer.json). Files
    that are absent contribute nothing: a directory without tokenizer files serves ids only."""
    directory = model_dir(path)
    ids = set(config.eos_token_ids)
    generation = directory / "generation_config.json"
    if generation.is_file():
        ids.update(_as_ids(json.loads(generation.read_text()).get("eos_token_id")))
    token_id = _tokenizer_eos_id(directory)
    if token_id is not None:
        ids.add(token_id)
    return frozenset(ids)


def _tokenizer_eos_id(directory: Path) -> int | None:
    tokenizer_config = directory / "tokenizer_config.json"
    if not tokenizer_config.is_file():
        return None
    eos = json.loads(tokenizer_config.read_text()).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not eos:
        return None
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        log.warning("%s names eos_token %r but there is no tokenizer.json", tokenizer_config, eos)
        return None
    from tokenizers import Tokenizer

    token_id = Tokenizer.from_file(str(tokenizer_file)).token_to_id(eos)
    if token_id is None:
        raise ValueError(f"eos_token {eos!r} of {tokenizer_config} is not in {tokenizer_file}")
    return token_id


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def kv_bytes_per_token(config: ModelConfig, dtype: str, tensor_parallel_size: int = 1) -> int:
    """KV bytes one token takes on one rank (its share of the KV heads)."""
    heads = config.num_kv_heads // tensor_parallel_size
    return 2 * config.num_layers * heads * config.head_dim * DTYPE_BYTES[dtype]
