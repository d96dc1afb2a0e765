"""Test-only FP8 checkpoints: a tiny random HF checkpoint rewritten in either FP8 format (the
decoder layers' projections as float8_e4m3fn with their scales, a quantization_config in
config.json), and the HF reference that runs the same weights dequantized, with or without
the w8a8 activation quantization, written here apart from the engine's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from outrider.plugins.models.fp8.reference import (
    FP8,
    Fp8ExpertWeights,
    Fp8Weight,
    dequantize,
    quantize_weight,
    w8a8_linear,
)

E4M3_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def block_config(block: tuple[int, int], skipped: list[str] | None = None) -> dict[str, Any]:
    """A Qwen3-*-FP8 style quantization_config."""
    config: dict[str, Any] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    if skipped is not None:
        config["modules_to_not_convert"] = skipped
    return config


def channel_config(ignore: tuple[str, ...] = ("lm_head",)) -> dict[str, Any]:
    """A compressed-tensors FP8-dynamic quantization_config, as RedHatAI's Llama FP8
    checkpoints carry it."""
    args = {"actorder": None, "block_structure": None, "group_size": None, "num_bits": 8}
    args |= {"observer_kwargs": {}, "symmetric": True, "type": "float"}
    return {
        "config_groups": {
            "group_0": {
                "input_activations": args
                | {"dynamic": True, "observer": None, "strategy": "token"},
                "output_activations": None,
                "targets": ["Linear"],
                "weights": args | {"dynamic": False, "observer": "minmax", "strategy": "channel"},
            }
        },
        "format": "float-quantized",
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def quantized_projection(name: str, skipped: tuple[str, ...] = ()) -> bool:
    module = name.removesuffix(".weight")
    return (
        name.startswith("model.layers.")
        and module.rsplit(".", 1)[-1] in PROJECTIONS
        and name.endswith(".weight")
        and not any(module.endswith(entry) for entry in skipped)
    )


def write_fp8_checkpoint(
    source: Path,
    target: Path,
    quantization: dict[str, Any],
    *,
    skipped: tuple[str, ...] = (),
    dequantized: Path | None = None,
) -> None:
    """``source`` (a 16/32-bit checkpoint, one safetensors file) rewritten into ``target`` in
    the format of ``quantization``; ``dequantized``: also the 16/32-bit checkpoint of the
    weights the FP8 ones stand for (the references' weights)."""
    block = None
    scale_name = "weight_scale"
    if quantization["quant_method"] == "fp8":
        block = (quantization["weight_block_size"][0], quantization["weight_block_size"][1])
        scale_name = "weight_scale_inv"
    tensors = load_file(source / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not quantized_projection(name, skipped):
            out[name] = plain[name] = tensor
            continue
        weight = quantize_weight(tensor, block)
        out[name] = weight.data
        out[name.removesuffix("weight") + scale_name] = weight.scale
        plain[name] = dequantize(weight)
    target.mkdir(parents=True)
    save_file(out, target / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))
    if dequantized is not None:
        dequantized.mkdir(parents=True)
        save_file(plain, dequantized / "model.safetensors")
        shutil.copy(source / "config.json", dequantized / "config.json")


def fake_w8a8(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x: [..., K]`` quantized per token and group of ``group`` columns to e4m3 and back, in
    float64."""
    shape = x.shape
    groups = x.double().reshape(-1, shape[-1] // group, group)
    scale = (groups.abs().amax(-1, keepdim=True).clamp(min=1e-10) / E4M3_MAX).float().double()
    values = (groups.float() / scale.float()).clamp(-E4M3_MAX, E4M3_MAX)
    return (values.to(torch.float8_e4m3fn).double() * scale).reshape(shape)


def hf_reference(directory: Path, group: int | None) -> torch.nn.Module:
    """The HF model of ``directory`` (float32, eager); with ``group`` (the activation group,
    the row width per channel, 0 for the whole row) its decoder projections, and each routed
    expert's, quantize their input as the w8a8 arithmetic does and multiply in float64."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    if group is None:
        return model
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS:
            module.forward = _w8a8_forward(module, group)  # type: ignore[method-assign]
        elif name.endswith("mlp.experts"):
            module.forward = _w8a8_experts_forward(module, group)  # type: ignore[method-assign]
    return model


def _w8a8_experts_forward(experts: torch.nn.Module, group: int) -> Any:
    """HF's stacked experts (``gate_up_proj: [E, 2I, H]``, ``down_proj: [E, H, I]``), each
    product of w8a8 inputs in float64, summed over a token's experts in expert order."""

    def forward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in ids.unique().tolist():
            token, slot = torch.where(ids == expert)
            gate_up = fake_w8a8(x[token], group) @ experts.gate_up_proj[expert].double().T
            gate, up = gate_up.float().chunk(2, dim=-1)
            h = torch.nn.functional.silu(gate) * up
            y = (fake_w8a8(h, group) @ experts.down_proj[expert].double().T).float()
            out.index_add_(0, token, y * weights[token, slot, None])
        return out

    return forward


def _w8a8_forward(linear: torch.nn.Linear, group: int) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        width = group or x.shape[-1]
        y = fake_w8a8(x, width) @ linear.weight.double().T
        if linear.bias is not None:
            y = y + linear.bias.double()
        return y.float()

    return forward


def random_fp8_experts(
    experts: int,
    hidden: int,
    inter: int,
    block: tuple[int, int],
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> Fp8ExpertWeights:
    """Random experts (N(0, 1 / K) weights, outputs of order one) quantized in ``block``s,
    each gate/up as one ``[2I, H]`` weight."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(rows: int, columns: int) -> Any:
        weight = torch.randn(rows, columns, generator=gen, device=device) / columns**0.5
        return quantize_weight(weight, block)

    w13 = [draw(2 * inter, hidden) for _ in range(experts)]
    w2 = [draw(hidden, inter) for _ in range(experts)]
    return Fp8ExpertWeights(
        torch.stack([w.data for w in w13]),
        torch.stack([w.scale for w in w13]),
        torch.stack([w.data for w in w2]),
        torch.stack([w.scale for w in w2]),
        block,
    )


def exact_operand(
    rows: int, columns: int, block: tuple[int, int], gen: torch.Generator
) -> torch.Tensor:
    """``[rows, columns]`` float32 whose w8a8 products are exact in any order and precision:
    -1, 0 or 1, a 7 at each group's first column, each ``block`` (rows, columns) times its own
    power of two from 2^-3 to 2^3. Quantized per block (activations: ``(1, group)``), every
    scale is that power times 2^-6 and every value 0, +-64 or 448, so each group's sum is a
    small integer times a power of two: no float32 or tensor-core accumulation rounds it,
    and a wrong scale or block shows as an inequality."""
    device = gen.device
    values = torch.randint(-1, 2, (rows, columns), generator=gen, device=device).float()
    bn, bk = block
    values[:, ::bk] = 7.0
    blocks = (-(-rows // bn), -(-columns // bk))
    powers = 2.0 ** torch.randint(-3, 4, blocks, generator=gen, device=device).float()
    return values * powers.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :columns]


def product_magnitudes(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """The w8a8 reference of ``|x|`` and ``|W|`` (the same scales): each output's sum of its
    products' magnitudes, what an accumulation error is measured against."""
    magnitudes = Fp8Weight(weight.data.float().abs().to(FP8), weight.scale, weight.block)
    return w8a8_linear(x.float().abs(), magnitudes, None)
