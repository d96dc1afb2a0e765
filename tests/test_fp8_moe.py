"""FP8 mixtures of experts (plugins/models/fp8/experts.py, ``fused_moe_fp8``) on CPU: a tiny
random Qwen3-MoE quantized here in the block format (16 x 32 blocks) runs the greedy tokens of
HF's with the same dequantized weights and the same w8a8 arithmetic, its logits near the
unquantized model's; the router stays 16-bit; the rank's cut of expert weights and scales; the
refusals of cuts that split a block (Qwen3-30B-A3B-FP8 over four ranks) and of per-channel
experts; dummy FP8 experts; the roofline's expert bytes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CONFIGS
from engine_harness import engine_for, requests_for, run, tokens_of
from fp8_fixtures import (
    block_config,
    channel_config,
    fake_w8a8,
    hf_reference,
    random_fp8_experts,
    write_fp8_checkpoint,
)
from model_fixtures import MOE_SHAPES, TINY, VOCAB, PagedRows, save_tiny_model, torch_backend
from safetensors.torch import load_file

from outrider.plugins.graph_build import building_graph
from outrider.plugins.models.config import ModelConfig
from outrider.plugins.models.fp8.config import FP8_EXPERTS_REFUSAL, quantization_problems
from outrider.plugins.models.fp8.experts import Fp8Experts
from outrider.plugins.models.fp8.layers import Fp8Linear
from outrider.plugins.models.fp8.reference import FP8
from outrider.plugins.models.kernels import TORCH_KERNELS
from outrider.plugins.models.loader import build_model, check_checkpoint_layout, load_model
from outrider.plugins.models.parallel import TPGroup
from outrider.plugins.models.weights import LoadFormat, checkpoint_tensors

BLOCK = (16, 32)  # the tiny model's experts: 32 rows (2 blocks), 64 columns (2 groups)
# Whole blocks at every cut of two: 24 k rows (head_dim 24), 16 expert rows and columns.
CUT_BLOCK = (8, 16)
PROMPTS = [[5, 17, 42, 9, 77, 3, 120, 64, 8], [250, 31, 31, 12, 99]]
NEW_TOKENS = 4
EXPERTS = "model.layers.1.mlp.experts"
LAYERS = 2  # of the reference configs' 48, all alike: the checks' cost is per layer


def _reference(name: str) -> dict[str, Any]:
    raw: dict[str, Any] = json.loads((CONFIGS / f"{name}.config.json").read_text())
    return raw | {"num_hidden_layers": LAYERS}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``moe`` (float32), ``fp8`` (its block-scaled checkpoint), ``dequantized``."""
    root = tmp_path_factory.mktemp("fp8-moe")
    with torch.no_grad():
        save_tiny_model("qwen3_moe", root / "moe")
    write_fp8_checkpoint(
        root / "moe", root / "fp8", block_config(BLOCK), dequantized=root / "dequantized"
    )
    return root


def _quiet(index: int, count: int, name: str) -> None:
    pass


def _load(path: Path, load_format: LoadFormat = "auto", tp: TPGroup | None = None) -> Any:
    model, _ = load_model(
        path,
        dtype=torch.float32,
        device="cpu",
        load_format=load_format,
        max_positions=64,
        progress=_quiet,
        tp=tp or TPGroup(),
    )
    return model


def _prefill_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    shape = model.attention_shape
    rows = PagedRows(num_layers=model.num_layers, shape=shape, page_size=4, max_len=16)
    input_ids, fb = rows.batch(torch_backend(shape), [(0, prompt)])
    with torch.no_grad():
        logits: torch.Tensor = model.compute_logits(model(input_ids, fb))
    return logits


def _hf_greedy(model: torch.nn.Module) -> list[list[int]]:
    generated = []
    for prompt in PROMPTS:
        out: list[int] = []
        for _ in range(NEW_TOKENS):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(logits.argmax()))
        generated.append(out)
    return generated


# --- the reference arithmetic ------------------------------------------------------------


def test_fused_moe_fp8_is_the_w8a8_arithmetic() -> None:
    """``kernels.fused_moe_fp8`` against the sum written out token by token in float64 from
    the dequantized experts and the inputs quantized per token and group of 32 (twice: x,
    then the SiLU-and-multiply); the graph-safe path (every expert on every token) equal."""
    from outrider.plugins.models.fp8.reference import dequantize

    tokens, hidden, inter, count, k = 6, 64, 32, 5, 2
    experts = random_fp8_experts(count, hidden, inter, BLOCK, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, hidden, generator=gen) * 2
    x[1, :32] = 0.0  # a group of zeros keeps a finite scale
    weights = torch.rand(tokens, k, generator=gen)
    ids = torch.stack([torch.randperm(count, generator=gen)[:k] for _ in range(tokens)])
    ids = ids.to(torch.int32)
    out = TORCH_KERNELS.fused_moe_fp8(x, experts, weights, ids)
    for t in range(tokens):
        expected = torch.zeros(hidden, dtype=torch.float64)
        for j in range(k):
            e = int(ids[t, j])
            w13, w2 = dequantize(experts.gate_up(e)).double(), dequantize(experts.down(e)).double()
            gate, up = (fake_w8a8(x[t : t + 1], BLOCK[1]) @ w13.T).float().chunk(2, dim=-1)
            h = torch.nn.functional.silu(gate) * up
            expected += weights[t, j].double() * (fake_w8a8(h, BLOCK[1]) @ w2.T)[0]
        torch.testing.assert_close(out[t], expected.float(), atol=1e-4, rtol=1e-5)
    assert torch.isfinite(out).all()
    with building_graph():
        graphed = TORCH_KERNELS.fused_moe_fp8(x, experts, weights, ids)
    torch.testing.assert_close(graphed, out, atol=1e-6, rtol=1e-6)


# --- end to end on CPU -------------------------------------------------------------------

# As test_fp8.py's: each quantized product's input is off by up to 1/16 of itself. Measured
# on this model the logits' RMS difference from the unquantized model's is about 4 % of their
# spread; a wrong or missing expert scale moves them by their whole spread.
LOGIT_TOLERANCE = 0.15


def test_greedy_tokens_are_the_w8a8_reference(checkpoints: Path) -> None:
    """The in-process engine on the FP8 checkpoint: HF's tokens with the dequantized weights
    and the w8a8 arithmetic (attention projections and experts); the prefill logits those of
    that reference to float32 sums, and near the unquantized model's."""
    engine = engine_for(str(checkpoints / "fp8"), speculative_algorithm="none")
    got = tokens_of(run(engine, requests_for(PROMPTS, max_new_tokens=NEW_TOKENS)))
    w8a8 = hf_reference(checkpoints / "dequantized", BLOCK[1])
    assert [got[rid] for rid in range(len(PROMPTS))] == _hf_greedy(w8a8)
    logits = _prefill_logits(_load(checkpoints / "fp8"), PROMPTS[0])
    with torch.no_grad():
        expected = w8a8(torch.tensor([PROMPTS[0]])).logits[0]
        plain = hf_reference(checkpoints / "moe", None)(torch.tensor([PROMPTS[0]])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert (logits - plain).pow(2).mean().sqrt() <= LOGIT_TOLERANCE * plain.std()


def test_fp8_experts_storage_and_a_16_bit_router(checkpoints: Path) -> None:
    """Experts and attention FP8 with float32 block scales, each expert's slices the
    checkpoint's tensors; the router (``mlp.gate``, which ``modules_to_not_convert`` names in
    the published checkpoints without touching ``mlp.gate_proj``) in the model dtype."""
    model, config = load_model(
        checkpoints / "fp8", dtype=torch.bfloat16, device="cpu", max_positions=16, progress=_quiet
    )
    assert config.fp8 is not None
    assert config.fp8.quantizes(f"{EXPERTS}.0.gate_proj")
    skipping = block_config(BLOCK, ["model.layers.1.mlp.gate"])
    skips = ModelConfig.from_dict(json.loads((checkpoints / "moe" / "config.json").read_text())
                                  | {"quantization_config": skipping}).fp8  # fmt: skip
    assert skips is not None and not skips.quantizes("model.layers.1.mlp.gate")
    assert skips.quantizes(f"{EXPERTS}.0.gate_proj")
    layer = model.model.layers[1]
    experts = layer.mlp.experts
    assert isinstance(experts, Fp8Experts) and isinstance(layer.self_attn.qkv_proj, Fp8Linear)
    inter, count = MOE_SHAPES["qwen3_moe"]["moe_intermediate_size"], 8
    hidden = TINY["hidden_size"]
    assert experts.w13.dtype == experts.w2.dtype == FP8
    assert experts.w13_scale.shape == (count, 2 * inter // BLOCK[0], hidden // BLOCK[1])
    assert experts.w2_scale.shape == (count, hidden // BLOCK[0], inter // BLOCK[1])
    assert experts.w13_scale.dtype == experts.w2_scale.dtype == torch.float32
    assert layer.mlp.gate.weight.dtype == torch.bfloat16
    stored = load_file(checkpoints / "fp8" / "model.safetensors")
    e = f"{EXPERTS}.3"
    gate, up = stored[f"{e}.gate_proj.weight"], stored[f"{e}.up_proj.weight"]
    assert torch.equal(experts.w13[3].view(torch.uint8), torch.cat([gate, up]).view(torch.uint8))
    scales = [stored[f"{e}.{p}.weight_scale_inv"] for p in ("gate_proj", "up_proj")]
    assert torch.equal(experts.w13_scale[3], torch.cat(scales))
    assert torch.equal(experts.w2_scale[3], stored[f"{e}.down_proj.weight_scale_inv"])
    check_checkpoint_layout(config)


def test_rank_holds_its_cut_of_expert_weights_and_scales(checkpoints: Path, tmp_path: Path) -> None:
    """Rank 1 of 2 of a checkpoint in 8 x 16 blocks (each rank's 16 gate/up rows two blocks,
    its 16 down columns one group): the second half of each expert's gate and up rows and of
    their block rows of scales, of its down columns and their column blocks."""
    target = tmp_path / "fp8"
    write_fp8_checkpoint(checkpoints / "moe", target, block_config(CUT_BLOCK))
    stored = load_file(target / "model.safetensors")
    rank = _load(target, tp=TPGroup(1, 2))
    experts = rank.model.layers[1].mlp.experts
    assert isinstance(experts, Fp8Experts)
    e = f"{EXPERTS}.5"
    gate, up, down = (stored[f"{e}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))
    scale = {p: stored[f"{e}.{p}.weight_scale_inv"] for p in ("gate_proj", "up_proj", "down_proj")}
    assert torch.equal(experts.w13[5].float(), torch.cat([gate[16:], up[16:]]).float())
    halves = [scale["gate_proj"][2:], scale["up_proj"][2:]]
    assert torch.equal(experts.w13_scale[5], torch.cat(halves))
    assert torch.equal(experts.w2[5].float(), down[:, 16:].float())
    assert torch.equal(experts.w2_scale[5], scale["down_proj"][:, 1:])
    held = checkpoint_tensors(rank)
    assert torch.equal(held[f"{e}.down_proj.weight_scale_inv"], scale["down_proj"][:, 1:])
    check_checkpoint_layout(ModelConfig.from_pretrained(target), tensor_parallel_size=2)


def test_ranks_partial_sums_are_the_experts_output(checkpoints: Path, tmp_path: Path) -> None:
    """Both ranks' FP8 experts of the 8 x 16 checkpoint on the same tokens and routing: their
    partial sums (what the all-reduce adds) are the whole experts' output. Each rank's down
    columns are whole activation groups, so every product is the model's; only the weighting
    of two partial sums instead of one rounds apart."""
    directory = tmp_path / "fp8"
    write_fp8_checkpoint(checkpoints / "moe", directory, block_config(CUT_BLOCK))
    whole = _load(directory).model.layers[1].mlp
    x = torch.randn(7, TINY["hidden_size"], generator=torch.Generator().manual_seed(8))
    routing = whole.gate(x)
    with torch.no_grad():
        expected = whole.experts(x, routing)
        parts = [_load(directory, tp=TPGroup(rank, 2)).model.layers[1].mlp.experts(x, routing)
                 for rank in range(2)]  # fmt: skip
    torch.testing.assert_close(parts[0] + parts[1], expected, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(parts[0], expected, atol=1e-3)


# --- refusals ----------------------------------------------------------------------------

TAIL = "the checkpoint's weight_block_size needs each rank's share to be whole blocks"


def test_a_cut_that_splits_an_expert_block_is_refused(checkpoints: Path) -> None:
    """16 x 32 blocks over two ranks (attention left 16-bit): each rank's 16 down columns
    are half a group of 32."""
    quantization = block_config(BLOCK, ["re:.*self_attn\\..*"])
    raw = json.loads((checkpoints / "moe" / "config.json").read_text())
    raw |= {"quantization_config": quantization}
    config = ModelConfig.from_dict(raw)
    message = (
        "model.layers.0.mlp.experts: FP8 blocks of 32 do not tile the experts' down columns "
        f"of 16 a rank holds under --tensor-parallel-size 2; {TAIL}"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build_model(config, max_positions=4, dtype=torch.float32, device="meta", tp=TPGroup(0, 2))
    assert quantization_problems(raw, 2, "--tensor-parallel-size") == [message.split(": ", 1)[1]]


def test_qwen3_30b_a3b_fp8_shards_over_two_not_four() -> None:
    """The published layout (768 expert rows: 6 blocks of 128) at every rank's cut of two,
    the fill path on the meta device (two of its 48 layers: they are alike); over four a
    rank's 192 rows are 1.5 blocks: refused by the start checks and at build, naming both
    cuts."""
    raw = _reference("Qwen3-30B-A3B-FP8")
    config = ModelConfig.from_dict(raw)
    assert config.fp8 is not None and config.fp8.block == (128, 128)
    assert not config.fp8.quantizes("model.layers.47.mlp.gate")
    assert config.fp8.quantizes("model.layers.47.mlp.experts.127.down_proj")
    check_checkpoint_layout(config, tensor_parallel_size=2)
    assert quantization_problems(raw, 2, "--tensor-parallel-size") == []
    problems = [
        f"FP8 blocks of 128 do not tile the experts' {what} of 192 a rank holds under "
        f"--tensor-parallel-size 4; {TAIL}"
        for what in ("gate/up rows", "down columns")
    ]
    assert quantization_problems(raw, 4, "--tensor-parallel-size") == problems
    message = f"model.layers.0.mlp.experts: {'; '.join(problems)}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build_model(config, max_positions=1, dtype=torch.bfloat16, device="meta", tp=TPGroup(3, 4))


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_other_families_fp8_layouts_load(kind: str) -> None:
    """Mixtral's experts (w1 / w3 / w2, each with its weight_scale_inv) and Qwen2-MoE's
    (its shared expert a fused FP8 MLP, its gate 16-bit): the fill path on the meta device,
    whole and at rank 2 of 2, in 8 x 8 blocks (24 expert rows a rank)."""
    overrides = MOE_SHAPES[kind] | {"model_type": kind, "quantization_config": block_config((8, 8))}
    architecture = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[kind]
    config = ModelConfig.from_dict(TINY | overrides | {"architectures": [architecture]})
    for size in (1, 2):
        check_checkpoint_layout(config, tensor_parallel_size=size)


def test_per_channel_experts_are_refused(checkpoints: Path) -> None:
    raw = json.loads((checkpoints / "moe" / "config.json").read_text())
    channel = raw | {"quantization_config": channel_config()}
    with pytest.raises(ValueError) as refused:
        ModelConfig.from_dict(channel)
    assert str(refused.value) == FP8_EXPERTS_REFUSAL
    assert quantization_problems(channel, 1, "--tensor-parallel-size") == [FP8_EXPERTS_REFUSAL]


# --- dummy weights and the roofline -------------------------------------------------------


def test_dummy_fp8_experts_are_one_model_at_any_world_size(
    checkpoints: Path, tmp_path: Path
) -> None:
    """``--load-format dummy`` from a config.json with a quantization_config: FP8 experts with
    positive scales, rank 1 of 2 holding the cut of a single rank's draws; the model runs."""
    raw = json.loads((checkpoints / "moe" / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps(raw | {"quantization_config": block_config(CUT_BLOCK)})
    )
    one, two = _load(tmp_path, "dummy"), _load(tmp_path, "dummy", TPGroup(1, 2))
    whole, cut = one.model.layers[0].mlp.experts, two.model.layers[0].mlp.experts
    assert isinstance(whole, Fp8Experts) and whole.w13.dtype == FP8
    assert (whole.w13_scale > 0).all() and (whole.w2_scale > 0).all()
    # N(0, 0.02) quantized per 8 x 16 block: each block's largest value is +-448.
    assert whole.w13[0, :8, :16].float().abs().max() == 448.0
    gate, up = whole.w13.float().split(32, dim=1)
    assert torch.equal(cut.w13.float(), torch.cat([gate[:, 16:], up[:, 16:]], dim=1))
    assert torch.equal(cut.w2_scale, whole.w2_scale[:, :, 1:])
    assert torch.equal(two.model.layers[0].mlp.gate.weight, one.model.layers[0].mlp.gate.weight)
    logits = _prefill_logits(one, PROMPTS[0])
    assert torch.isfinite(logits).all() and logits.shape == (len(PROMPTS[0]), VOCAB)


def test_roofline_counts_fp8_expert_bytes() -> None:
    """Qwen3-30B-A3B-FP8's experts and attention at one byte per weight plus float32 scales
    (128 x 128 blocks); router, norms, embeddings and head as in the 16-bit model (two of
    its layers)."""
    from outrider.daemon.bench.roofline import weight_bytes

    plain = ModelConfig.from_dict(_reference("Qwen3-30B-A3B"))
    fp8 = ModelConfig.from_dict(_reference("Qwen3-30B-A3B-FP8"))
    layers, experts, hidden, inter = LAYERS, 128, 2048, 768
    q, kv = 32 * 128, 4 * 128
    # Per layer: each expert's gate, up (768 x 2048) and down (2048 x 768); q, o (4096 x
    # 2048); k, v (512 x 2048).
    quantized = layers * (experts * 3 * inter * hidden + 2 * q * hidden + 2 * kv * hidden)
    # Block scales: gate, up 6 x 16, down 16 x 6; q 32 x 16, o 16 x 32, k, v 4 x 16.
    scales = layers * (experts * 3 * 6 * 16 + 2 * 32 * 16 + 2 * 4 * 16)
    assert weight_bytes(fp8, "bfloat16") == weight_bytes(plain, "bfloat16") - quantized + 4 * scales
