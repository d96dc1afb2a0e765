"""The FP8 checkpoint formats Outrider serves, read from config.json's ``quantization_config``
once (no torch: the start checks read it too).

Two formats, both weight-and-activation FP8 (e4m3) with activations quantized as they come::

    format     config.json                                  weight scales (float32)
    ---------  -------------------------------------------  ----------------------------------
    "block"    quant_method "fp8", fmt "e4m3",              weight_scale_inv [ceil(N/bn),
               activation_scheme "dynamic",                 ceil(K/bk)]: one per block of
               weight_block_size [bn, bk]                   the weight; activations per
                                                            token and group of bk along K
    "channel"  quant_method "compressed-tensors", one       weight_scale [N, 1]: one per
               config group on Linear: weights float 8-bit  output row; activations per token
               strategy channel, input_activations float
               8-bit dynamic strategy token

Every other ``quantization_config`` is refused with one line naming these two. A mixture of
experts' routed experts are served FP8 in the block format only (``fp8/experts.py``). Modules
the config leaves out (``modules_to_not_convert`` / ``ignored_layers``, ``ignore``) stay in the
model dtype; the LM head, embeddings and norms are never quantized.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

SUPPORTED = (
    "supported FP8 checkpoints: quant_method 'fp8' (fmt e4m3, dynamic activations, "
    "weight_block_size [n, k]) or 'compressed-tensors' (float 8-bit weights per channel, "
    "dynamic float 8-bit activations per token)"
)


@dataclass(frozen=True)
class Fp8Config:
    """One checkpoint's FP8 format. ``block`` is ``(rows, columns)`` of a weight scale's
    block for the block format, None per channel; ``skipped`` names the modules left in the
    model dtype (checkpoint names, dotted prefixes or suffixes, or ``re:`` patterns)."""

    format: Literal["block", "channel"]
    block: tuple[int, int] | None
    skipped: tuple[str, ...] = ()

    @property
    def scale_name(self) -> str:
        """The checkpoint name of a quantized weight's scale (beside ``weight``)."""
        return "weight_scale_inv" if self.format == "block" else "weight_scale"

    def quantizes(self, module: str) -> bool:
        """Whether checkpoint module ``module`` (``model.layers.0.mlp.down_proj``) is FP8."""
        return not any(_matches(module, entry) for entry in self.skipped)


def block_problem(what: str, local: int, size: int, ranks: int, flag: str) -> str | None:
    """The problem of a rank holding ``local`` rows or columns (``what``) of a projection
    whose FP8 blocks are ``size`` long that way under ``flag`` ``ranks``; None when whole."""
    if local % size == 0:
        return None
    return (
        f"FP8 blocks of {size} do not tile {what} of {local} a rank holds under {flag} "
        f"{ranks}; the checkpoint's weight_block_size needs each rank's share to be whole blocks"
    )


# Dense decoder projections -> (the config key of their rows, of their columns), the key
# "q" / "kv" standing for heads times head_dim.
_PROJECTIONS = {
    "self_attn.q_proj": ("q", "hidden_size"),
    "self_attn.k_proj": ("kv", "hidden_size"),
    "self_attn.v_proj": ("kv", "hidden_size"),
    "self_attn.o_proj": ("hidden_size", "q"),
    "mlp.gate_proj": ("intermediate_size", "hidden_size"),
    "mlp.up_proj": ("intermediate_size", "hidden_size"),
    "mlp.down_proj": ("hidden_size", "intermediate_size"),
}
_ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


def expert_block_problems(
    intermediate: int, block: tuple[int, int], ranks: int, flag: str
) -> list[str]:
    """The problems of FP8 experts of ``intermediate`` rows in ``block``s over ``ranks``
    (``flag``): a rank's gate/up rows must be whole blocks (they stack, and so do their
    scales), and when cut its down columns too (its activation groups are the model's)."""
    local = intermediate // ranks
    problems = [block_problem("the experts' gate/up rows", local, block[0], ranks, flag)]
    if ranks > 1:
        problems.append(block_problem("the experts' down columns", local, block[1], ranks, flag))
    return [problem for problem in problems if problem is not None]


# Per-channel experts would need their own kernels: refused until they exist.
FP8_EXPERTS_REFUSAL = (
    "FP8 experts are served from block-scaled checkpoints (quant_method 'fp8') only, not "
    "per-channel (compressed-tensors) ones"
)


def quantization_problems(d: dict[str, Any], ranks: int, flag: str) -> list[str]:
    """What keeps the checkpoint of config.json ``d`` (raw keys) from being served over
    ``ranks`` (``flag``): an unsupported ``quantization_config`` (one line), or a projection it
    quantizes in blocks of which a rank's share is not whole blocks (the q/k/v and gate/up
    parts by rows, fused or not; o and down by columns when cut; the experts'
    ``expert_block_problems``), or FP8 experts per channel. Empty for a 16-bit one and
    for shapes that do not divide (``config.tensor_parallel_problems`` names those)."""
    try:
        fp8 = parse_quantization(d.get("quantization_config"))
    except ValueError as exc:
        return [str(exc)]
    experts = d.get("num_experts") or d.get("num_local_experts")
    if fp8 is not None and experts and fp8.block is None:
        return [FP8_EXPERTS_REFUSAL]
    if fp8 is None or fp8.block is None:
        return []
    problems: list[str] = []
    heads, hidden = d.get("num_attention_heads"), d.get("hidden_size")
    if not (isinstance(heads, int) and isinstance(hidden, int)):
        return []
    # A mixture of experts runs the dense MLP only in the layers its config leaves dense.
    sparse_step = d.get("decoder_sparse_step", 1)
    dense_mlp = not experts or bool(d.get("mlp_only_layers")) or sparse_step != 1
    head_dim = d.get("head_dim") or hidden // heads
    sizes = {
        "q": heads * head_dim,
        "kv": (d.get("num_key_value_heads") or heads) * head_dim,
        "hidden_size": hidden,
        "intermediate_size": d.get("intermediate_size") or 0,
    }
    layers = range(int(d.get("num_hidden_layers") or 0))
    for projection, (rows, columns) in _PROJECTIONS.items():
        if not any(fp8.quantizes(f"model.layers.{i}.{projection}") for i in layers):
            continue
        if projection.startswith("mlp.") and not dense_mlp:
            continue
        row_parallel = projection in _ROW_PARALLEL
        total = sizes[columns] if row_parallel else sizes[rows]
        if total % ranks or (row_parallel and ranks == 1):
            continue
        size = fp8.block[1] if row_parallel else fp8.block[0]
        what = f"the {projection} {'columns' if row_parallel else 'rows'}"
        problem = block_problem(what, total // ranks, size, ranks, flag)
        if problem is not None:
            problems.append(problem)
    # Mixtral's experts are its `intermediate_size`; Qwen's, `moe_intermediate_size`.
    expert_rows = d.get("moe_intermediate_size") or d.get("intermediate_size")
    if experts and isinstance(expert_rows, int) and expert_rows % ranks == 0:
        problems += expert_block_problems(expert_rows, fp8.block, ranks, flag)
    return problems


def _matches(module: str, entry: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    prefix = entry.rstrip(".") + "."
    return module == entry or module.endswith("." + entry) or module.startswith(prefix)


def parse_quantization(quantization: dict[str, Any] | None) -> Fp8Config | None:
    """The FP8 format of config.json's ``quantization_config`` (None: not quantized).
    ValueError in one line naming what is supported for anything else."""
    if quantization is None:
        return None
    method = quantization.get("quant_method")
    if method == "fp8":
        return _parse_block(quantization)
    if method == "compressed-tensors":
        return _parse_channel(quantization)
    raise ValueError(f"quantization_config quant_method {method!r} is not supported ({SUPPORTED})")


def _refuse(what: str) -> ValueError:
    return ValueError(f"quantization_config: {what} is not supported ({SUPPORTED})")


def _parse_block(q: dict[str, Any]) -> Fp8Config:
    if q.get("fmt", "e4m3") != "e4m3":
        raise _refuse(f"fmt {q['fmt']!r}")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse(f"activation_scheme {q['activation_scheme']!r}")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(n, int) for n in block)):
        raise _refuse(f"quant_method 'fp8' with weight_block_size {block!r} (per tensor)")
    if min(block) < 1:
        raise _refuse(f"weight_block_size {block!r}")
    skipped = [*(q.get("modules_to_not_convert") or ()), *(q.get("ignored_layers") or ())]
    return Fp8Config("block", (block[0], block[1]), tuple(skipped))


def _parse_channel(q: dict[str, Any]) -> Fp8Config:
    for key in ("kv_cache_scheme", "sparsity_config"):
        if q.get(key):
            raise _refuse(f"compressed-tensors with a {key}")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse(f"compressed-tensors with {len(groups)} config groups (one)")
    (group,) = groups.values()
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise _refuse(f"config group targets {targets!r} (['Linear'])")
    weights = group.get("weights") or {}
    _check_args("weights", weights, strategy="channel", dynamic=False)
    activations = group.get("input_activations")
    if activations is None:
        raise _refuse("compressed-tensors without input_activations (weight-only)")
    _check_args("input_activations", activations, strategy="token", dynamic=True)
    if group.get("output_activations") is not None:
        raise _refuse("output_activations")
    return Fp8Config("channel", None, tuple(q.get("ignore") or ()))


def _check_args(role: str, args: dict[str, Any], *, strategy: str, dynamic: bool) -> None:
    """``args`` must be float 8-bit, symmetric, of ``strategy`` and ``dynamic``."""
    seen = {
        "type": args.get("type"),
        "num_bits": args.get("num_bits"),
        "strategy": args.get("strategy"),
        "dynamic": bool(args.get("dynamic", False)),
        "symmetric": args.get("symmetric", True),
    }
    wanted = {"type": "float", "num_bits": 8, "strategy": strategy, "dynamic": dynamic}
    wanted |= {"symmetric": True}
    for key, value in wanted.items():
        if seen[key] != value:
            raise _refuse(f"{role} {key} {seen[key]!r}")
