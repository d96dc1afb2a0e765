"""Mixture-of-experts targets (Qwen3-MoE, Mixtral, Qwen2-MoE), float32 on CPU: greedy outputs
through the engine equal transformers' token for token; the per-expert checkpoint layout,
its refusals, its tensor-parallel cut and dummy weights; the routed-experts kernel contract;
n-gram speculation on a MoE target; real configs (Qwen3-30B-A3B, Mixtral-8x7B) sharded."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CONFIGS, CUDA
from engine_harness import debug_checks_fixture, engine_for, requests_for, run, tokens_of
from model_fixtures import (
    MOE_SHAPES,
    TINY,
    VOCAB,
    PagedRows,
    hf_greedy,
    hf_logprobs,
    mixed_prompts,
    save_tiny_model,
    torch_backend,
)
from numeric_rule import MAX_DIFF, assert_within_rule
from safetensors.torch import load_file, save_file

from outrider.plugins.graph_build import building_graph
from outrider.plugins.models.config import ModelConfig
from outrider.plugins.models.fp8.config import FP8_EXPERTS_REFUSAL, quantization_problems
from outrider.plugins.models.kernels import TORCH_KERNELS
from outrider.plugins.models.layers import MLP, DecoderForCausalLM
from outrider.plugins.models.loader import (
    build_model,
    check_checkpoint_layout,
    expected_checkpoint_shapes,
    load_model,
)
from outrider.plugins.models.moe.block import SparseMoeBlock
from outrider.plugins.models.parallel import SINGLE, TPGroup
from outrider.plugins.models.weights import LoadFormat
from outrider.protocol.messages import TokenLogprob

NEW_TOKENS = 8

# The relay check syncs; it stays off where a GPU runs the CUDA graph test.
debug_checks = debug_checks_fixture(relay_check=not CUDA)

# name -> (kind, config overrides): Qwen3-MoE renormalised; Qwen3-MoE not renormalised with
# layer 0 dense (mlp_only_layers); Mixtral; Qwen2-MoE with its shared expert.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe dense layer": ("qwen3_moe", {"norm_topk_prob": False, "mlp_only_layers": [0]}),
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
}


PROMPTS = mixed_prompts(1, 4)


@dataclass
class Reference:
    directory: Path
    expected: list[list[int]]
    logprobs: list[list[TokenLogprob]]  # along ``expected``, with each position's two best


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Reference]:
    out = {}
    for name, (kind, overrides) in CASES.items():
        directory = tmp_path_factory.mktemp(kind)
        with torch.no_grad():
            model = save_tiny_model(kind, directory, config_overrides=overrides)
            expected = hf_greedy(model, PROMPTS, NEW_TOKENS)
            out[name] = Reference(directory, expected, hf_logprobs(model, PROMPTS, expected))
    return out


def _quiet(index: int, count: int, name: str) -> None:
    pass


def _load(path: Path, load_format: LoadFormat = "auto", tp: TPGroup = SINGLE) -> DecoderForCausalLM:
    model, _ = load_model(
        path,
        dtype=torch.float32,
        device="cpu",
        load_format=load_format,
        max_positions=64,
        progress=_quiet,
        tp=tp,
    )
    return model


@pytest.mark.parametrize("name", CASES)
def test_greedy_matches_transformers(references: dict[str, Reference], name: str) -> None:
    reference = references[name]
    engine = engine_for(str(reference.directory), page_size=16)
    outcomes = run(engine, requests_for(PROMPTS, max_new_tokens=NEW_TOKENS))
    assert tokens_of(outcomes) == dict(enumerate(reference.expected))


def test_ngram_speculation_keeps_greedy(references: dict[str, Reference]) -> None:
    reference = references["qwen3_moe"]
    engine = engine_for(
        str(reference.directory), speculative_algorithm="ngram", speculative_num_draft_tokens=4
    )
    outcomes = run(engine, requests_for(PROMPTS, max_new_tokens=NEW_TOKENS))
    assert tokens_of(outcomes) == dict(enumerate(reference.expected))
    assert engine.scheduler.counters().spec_drafts > 0


@pytest.mark.gpu
def test_a_bfloat16_moe_target_serves_without_waiting_on_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3-30B-A3B's layers (two, dummy weights) in bfloat16 on the fused kernels, under the
    sync check (any host synchronisation inside a step raises, and the step's requests end in
    an error): prompt batches of up to 2,500 tokens and decode steps, replayed and eager, all
    finish with every token asked for."""
    config = json.loads((CONFIGS / "Qwen3-30B-A3B.config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    monkeypatch.setenv("OUTRIDER_DEBUG_SYNC_CHECK", "1")
    prompts = [[3 + (5 * i + j) % 1000 for j in range(n)] for i, n in enumerate((7, 300, 2500))]
    for graphs in (True, False):
        engine = engine_for(
            str(tmp_path), device="cuda", dtype="bfloat16", load_format="dummy",
            disable_cuda_graph=not graphs, kv_cache_tokens=8192, chunked_prefill_tokens=4096,
            context_length=4096,
        )  # fmt: skip
        outcomes = run(engine, requests_for(prompts, max_new_tokens=NEW_TOKENS))
        assert {rid: len(o.token_ids) for rid, o in outcomes.items()} == dict.fromkeys(
            range(len(prompts)), NEW_TOKENS
        ), graphs


@pytest.mark.gpu
def test_cuda_graphs_serve_moe(references: dict[str, Reference]) -> None:
    """float32 on CUDA: decode batches replayed from graphs (every expert on every token) and
    eager steps (tokens grouped by expert) are transformers' within the numeric rule."""
    for name in ("qwen3_moe dense layer", "qwen2_moe"):
        reference = references[name]
        for graphs in (True, False):
            engine = engine_for(
                str(reference.directory),
                device="cuda",
                dtype="float32",
                disable_cuda_graph=not graphs,
            )
            assert (engine.loop.runner.graphs is not None) == graphs
            requests = requests_for(PROMPTS, max_new_tokens=NEW_TOKENS, logprobs=2)
            for rid, outcome in run(engine, requests).items():
                served = [lp for update in outcome.updates for lp in update.logprobs or []]
                assert_within_rule(reference.logprobs[rid], served, MAX_DIFF["float32"])


def test_sparse_and_dense_layers_as_configured(references: dict[str, Reference]) -> None:
    model = _load(references["qwen3_moe dense layer"].directory)
    moe = model.config.moe
    assert moe is not None and moe.sparse_layers == {1} and not moe.renormalize
    layers = model.model.layers
    assert isinstance(layers[0].mlp, MLP) and isinstance(layers[1].mlp, SparseMoeBlock)
    experts = layers[1].mlp.experts
    hidden, inter = TINY["hidden_size"], MOE_SHAPES["qwen3_moe"]["moe_intermediate_size"]
    assert experts.w13.shape == (8, 2 * inter, hidden) and experts.w2.shape == (8, hidden, inter)
    mixtral = ModelConfig.from_pretrained(references["mixtral"].directory).moe
    assert mixtral is not None and mixtral.renormalize and mixtral.sparse_layers == {0, 1}


def test_checkpoint_is_per_expert_and_loads_into_stacked_slices(
    references: dict[str, Reference],
) -> None:
    for name in ("qwen3_moe", "mixtral", "qwen2_moe"):
        directory = references[name].directory
        config = ModelConfig.from_pretrained(directory)
        saved = load_file(directory / "model.safetensors")
        assert {k: tuple(v.shape) for k, v in saved.items()} == expected_checkpoint_shapes(config)
    saved = load_file(references["mixtral"].directory / "model.safetensors")
    experts = "model.layers.1.block_sparse_moe.experts.2"
    model = _load(references["mixtral"].directory)
    stacked = model.model.layers[1].mlp.experts
    w1, w3, w2 = (saved[f"{experts}.{w}.weight"] for w in ("w1", "w3", "w2"))
    assert torch.equal(stacked.w13[2], torch.cat([w1, w3]))
    assert torch.equal(stacked.w2[2], w2)
    # Rank 1 of 2: the second half of each expert's gate and up rows, of its down columns.
    half = _load(references["mixtral"].directory, tp=TPGroup(1, 2))
    cut = half.model.layers[1].mlp.experts
    rows = w1.shape[0] // 2
    assert torch.equal(cut.w13[2], torch.cat([w1[rows:], w3[rows:]]))
    assert torch.equal(cut.w2[2], w2[:, rows:])


def test_loader_names_missing_and_extra_expert_tensors(
    references: dict[str, Reference], tmp_path: Path
) -> None:
    shutil.copytree(references["qwen3_moe"].directory, tmp_path, dirs_exist_ok=True)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    tensors.pop("model.layers.1.mlp.experts.3.up_proj.weight")
    tensors["model.layers.0.mlp.experts.8.gate_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, weights, metadata={"format": "pt"})
    problems = (
        r"^target: unexpected checkpoint tensors: model\.layers\.0\.mlp\.experts\.8\.gate_proj"
        r"\.weight; missing checkpoint tensors: model\.layers\.1\.mlp\.experts\.3\.up_proj"
        r"\.weight$"
    )
    with pytest.raises(ValueError, match=problems):
        _load(tmp_path)
    tensors.pop("model.layers.0.mlp.experts.8.gate_proj.weight")
    tensors["model.layers.1.mlp.experts.3.up_proj.weight"] = torch.zeros(32, 63)
    save_file(tensors, weights, metadata={"format": "pt"})
    wrong = (
        r"^target: checkpoint tensor model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight has "
        r"shape \(32, 63\), expected \(32, 64\)$"
    )
    with pytest.raises(ValueError, match=wrong):
        _load(tmp_path)


def test_dummy_weights_are_one_model_at_any_world_size(
    references: dict[str, Reference], tmp_path: Path
) -> None:
    shutil.copy(references["qwen2_moe"].directory / "config.json", tmp_path / "config.json")
    dummy = _load(tmp_path / "config.json", load_format="dummy")
    real = _load(references["qwen2_moe"].directory)
    shapes = {name: p.shape for name, p in real.named_parameters()}
    assert {name: p.shape for name, p in dummy.named_parameters()} == shapes
    again = _load(tmp_path / "config.json", load_format="dummy")
    for a, b in zip(dummy.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)
    # Rank 1 of 2 draws the same experts and keeps its cut of them.
    half = _load(tmp_path / "config.json", load_format="dummy", tp=TPGroup(1, 2))
    whole, cut = dummy.model.layers[0].mlp, half.model.layers[0].mlp
    rows = cut.experts.rows
    gate, up = whole.experts.w13.split(2 * rows, dim=1)
    assert torch.equal(cut.experts.w13, torch.cat([gate[:, rows:], up[:, rows:]], dim=1))
    assert torch.equal(cut.experts.w2, whole.experts.w2[:, :, rows:])
    assert torch.equal(cut.gate.weight, whole.gate.weight)
    shape = dummy.attention_shape
    rows_kv = PagedRows(num_layers=dummy.num_layers, shape=shape, page_size=16, max_len=16)
    input_ids, fb = rows_kv.batch(torch_backend(shape), [(0, list(range(3, 11)))])
    with torch.no_grad():
        assert torch.isfinite(dummy.compute_logits(dummy(input_ids, fb))).all()
    # The engine serves it (--load-format dummy).
    engine = engine_for(str(tmp_path), load_format="dummy")
    outcome = run(engine, requests_for(PROMPTS[:2], max_new_tokens=NEW_TOKENS))
    assert [len(o.token_ids) for o in outcome.values()] == [NEW_TOKENS, NEW_TOKENS]


def test_fused_moe_contract() -> None:
    """``kernels.fused_moe`` against the sum written out token by token."""
    gen = torch.Generator().manual_seed(5)
    tokens, hidden, inter, experts, k = 7, 16, 8, 5, 2
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen)
    w2 = torch.randn(experts, hidden, inter, generator=gen)
    weights = torch.rand(tokens, k, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    ids[0] = torch.tensor([4, 0])  # expert 3 is nobody's in row 0; expert 4 first
    out = TORCH_KERNELS.fused_moe(x, w13, w2, weights, ids.to(torch.int32))
    for t in range(tokens):
        expected = torch.zeros(hidden)
        for j in range(k):
            e = int(ids[t, j])
            gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
            expected += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(out[t], expected, atol=1e-4, rtol=1e-5)
    # The graph-safe path (every expert on every token) adds the same products in the same
    # order: only the projections of more rows at once may round differently.
    with building_graph():
        graphed = TORCH_KERNELS.fused_moe(x, w13, w2, weights, ids.to(torch.int32))
    torch.testing.assert_close(graphed, out, atol=1e-6, rtol=1e-6)


# Per-channel FP8 experts (compressed-tensors) are refused; block-scaled ones are served
# (test_fp8_moe.py).
CHANNEL_FP8 = {
    "quant_method": "compressed-tensors",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
            "input_activations": {
                "type": "float", "num_bits": 8, "strategy": "token", "dynamic": True
            },
        }
    },
}  # fmt: skip


def _moe_dict(model_type: str, **changes: object) -> dict[str, object]:
    architecture = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
    base: dict[str, object] = TINY | {"model_type": model_type, "num_experts_per_tok": 2}
    base |= {"architectures": [architecture.get(model_type, "Qwen2MoeForCausalLM")]}
    base |= {"num_local_experts": 4} if model_type == "mixtral" else {"num_experts": 4}
    base |= {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
    return base | changes


def test_config_refusals_and_shares() -> None:
    refusals = {
        "sliding-window attention (sliding_window set) is not supported": _moe_dict(
            "mixtral", sliding_window=4096
        ),
        "num_experts_per_tok 5 is not between 1 and 4": _moe_dict(
            "qwen3_moe", num_experts_per_tok=5
        ),
        "qwen2_moe without a shared expert or without qkv_bias is not supported": _moe_dict(
            "qwen2_moe", shared_expert_intermediate_size=0
        ),
        "decoder_sparse_step 0 is not supported (at least 1)": _moe_dict(
            "qwen3_moe", decoder_sparse_step=0
        ),
        FP8_EXPERTS_REFUSAL: _moe_dict("qwen3_moe", quantization_config=CHANNEL_FP8),
    }
    for message, raw in refusals.items():
        with pytest.raises(ValueError) as refused:
            ModelConfig.from_dict(raw)
        assert str(refused.value) == message
    # The start checks refuse per-channel FP8 experts before anything loads.
    fp8_moe = _moe_dict("mixtral", quantization_config=CHANNEL_FP8)
    assert quantization_problems(fp8_moe, 1, "--tensor-parallel-size") == [FP8_EXPERTS_REFUSAL]
    # Every other layer sparse; both sizes divided under tensor parallelism.
    config = ModelConfig.from_dict(_moe_dict("qwen3_moe", decoder_sparse_step=2))
    assert config.moe is not None and config.moe.sparse_layers == {1}
    assert config.layer_shares == {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
    }
    assert config.tensor_parallel_problems(64) == [
        f"--tensor-parallel-size 64 does not divide the model's {key} ({value}): "
        "each rank takes an equal share"
        for key, value in (("num_attention_heads", 4), ("num_key_value_heads", 2),
                           ("intermediate_size", 96), ("moe_intermediate_size", 32),
                           ("vocab_size", VOCAB))
    ]  # fmt: skip
    # Mixtral's experts are its `intermediate_size`, and no layer is dense.
    mixtral = ModelConfig.from_dict(_moe_dict("mixtral"))
    # The widest MLP block per token: layer 0's dense 96 rows; Mixtral's two experts of 96.
    assert (config.mlp_rows_per_token, mixtral.mlp_rows_per_token) == (96, 192)
    assert mixtral.layer_shares == {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
    }
    # The loader's meta-device check, as the last of two ranks would load.
    for raw in (_moe_dict("mixtral"), _moe_dict("qwen2_moe", mlp_only_layers=[1])):
        check_checkpoint_layout(ModelConfig.from_dict(raw), tensor_parallel_size=2)


# name -> the largest tensor-parallel size it divides into (Qwen3-30B-A3B: 4 KV heads).
REFERENCE_SIZES = {"Qwen3-30B-A3B": 4, "Mixtral-8x7B-Instruct-v0.1": 8}


@pytest.mark.parametrize("name", REFERENCE_SIZES)
def test_reference_configs_shard(name: str) -> None:
    config = ModelConfig.from_pretrained(CONFIGS / f"{name}.config.json")
    moe, size = config.moe, REFERENCE_SIZES[name]
    assert moe is not None and moe.renormalize
    assert moe.sparse_layers == set(range(config.num_layers))
    check_checkpoint_layout(config, tensor_parallel_size=size)
    last = TPGroup(size - 1, size)
    model = build_model(config, max_positions=1, dtype=torch.bfloat16, device="meta", tp=last)
    experts = model.model.layers[0].mlp.experts
    rows = moe.intermediate_size // size
    assert experts.w13.shape == (moe.num_experts, 2 * rows, config.hidden_size)
    assert experts.w2.shape == (moe.num_experts, config.hidden_size, rows)
