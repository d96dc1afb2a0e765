"""FP8 checkpoints (plugins/models/fp8*.py) on CPU: both formats parsed from config.json and
everything else refused; tiny Llama and Qwen3 checkpoints quantized here, loaded through the
one loader, and run: greedy tokens equal to HF's with the same dequantized weights and the
same w8a8 arithmetic, logits near the unquantized model's; the rank's cut of weights and
scales; dummy FP8 weights."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CONFIGS
from fp8_fixtures import (
    block_config,
    channel_config,
    hf_reference,
    quantized_projection,
    write_fp8_checkpoint,
)
from model_fixtures import TINY, VOCAB, PagedRows, save_tiny_model, torch_backend
from safetensors.torch import load_file

from outrider.plugins.models.config import ModelConfig
from outrider.plugins.models.fp8.config import SUPPORTED, Fp8Config, parse_quantization
from outrider.plugins.models.fp8.layers import Fp8Linear
from outrider.plugins.models.fp8.reference import FP8, Fp8Weight, dequantize, w8a8_linear
from outrider.plugins.models.loader import build_model, check_checkpoint_layout, load_model
from outrider.plugins.models.parallel import SINGLE, TPGroup
from outrider.plugins.models.weights import checkpoint_tensors

PROMPTS = ((0, 9), (2, 5))  # (slot, prompt length)
DECODE_STEPS = 4
# (model, format, block): Llama with square blocks, Qwen3 (head_dim 24: 96 q rows, 48 k/v)
# with blocks of 16 rows and 32 columns, both per channel.
CASES = (
    ("llama", "block", (32, 32)),
    ("qwen3", "block", (16, 32)),
    ("llama", "channel", None),
    ("qwen3", "channel", None),
)


def _quantization(fmt: str, block: tuple[int, int] | None) -> dict[str, Any]:
    return channel_config() if block is None else block_config(block)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Per case ``{model}-{format}``: the FP8 checkpoint, and ``-dequantized`` beside it."""
    root = tmp_path_factory.mktemp("fp8")
    for kind in ("llama", "qwen3"):
        save_tiny_model(kind, root / kind)
    for kind, fmt, block in CASES:
        write_fp8_checkpoint(
            root / kind,
            root / f"{kind}-{fmt}",
            _quantization(fmt, block),
            dequantized=root / f"{kind}-{fmt}-dequantized",
        )
    return root


def _quiet(index: int, count: int, name: str) -> None:
    pass


def _engine_run(directory: Path, load_format: str = "auto") -> tuple[list[list[int]], torch.Tensor]:
    """Prefill ``PROMPTS`` then greedy decode over the paged KV cache: each prompt's
    generated ids and the prefill's logits ``[T, V]``."""
    model, _ = load_model(
        directory,
        dtype=torch.float32,
        device="cpu",
        load_format=load_format,  # type: ignore[arg-type]
        max_positions=64,
        progress=_quiet,
    )
    shape = model.attention_shape
    rows = PagedRows(num_layers=model.num_layers, shape=shape, page_size=4, max_len=32)
    backend = torch_backend(shape)
    batch = [(slot, _prompt(n)) for slot, n in PROMPTS]
    generated: list[list[int]] = [[] for _ in PROMPTS]
    prefill_logits = torch.empty(0)
    for step in range(DECODE_STEPS):
        input_ids, fb = rows.batch(backend, batch)
        with torch.no_grad():
            hidden = model(input_ids, fb)
            if step == 0:
                prefill_logits = model.compute_logits(hidden)
            greedy = model.greedy_tokens(hidden)
        last = torch.tensor([len(tokens) for _, tokens in batch]).cumsum(0) - 1
        chosen = greedy[last].tolist()
        for ids, token in zip(generated, chosen, strict=True):
            ids.append(token)
        batch = [(slot, [token]) for (slot, _), token in zip(batch, chosen, strict=True)]
    return generated, prefill_logits


def _prompt(n: int) -> list[int]:
    gen = torch.Generator().manual_seed(n)
    return torch.randint(3, VOCAB, (n,), generator=gen).tolist()


def _hf_greedy(model: torch.nn.Module) -> tuple[list[list[int]], torch.Tensor]:
    """The same prompts through HF, recomputed in full each step: generated ids and the
    prefill logits, rows in ``_engine_run``'s order."""
    generated, logits = [], []
    for _, n in PROMPTS:
        ids = _prompt(n)
        out: list[int] = []
        for step in range(DECODE_STEPS):
            with torch.no_grad():
                step_logits = model(torch.tensor([ids + out])).logits[0]
            if step == 0:
                logits.append(step_logits)
            out.append(int(step_logits[-1].argmax()))
        generated.append(out)
    return generated, torch.cat(logits)


# --- config.json -------------------------------------------------------------------------


def test_both_formats_parse() -> None:
    assert parse_quantization(None) is None
    block = parse_quantization(block_config((128, 128), ["lm_head", "mlp.gate"]))
    assert block == Fp8Config("block", (128, 128), ("lm_head", "mlp.gate"))
    assert block.scale_name == "weight_scale_inv"
    assert not block.quantizes("model.layers.3.mlp.gate")
    assert block.quantizes("model.layers.3.mlp.gate_proj")
    channel = parse_quantization(channel_config(("lm_head", "re:.*layers\\.1\\..*")))
    assert channel == Fp8Config("channel", None, ("lm_head", "re:.*layers\\.1\\..*"))
    assert channel.scale_name == "weight_scale"
    assert not channel.quantizes("model.layers.1.self_attn.q_proj")
    assert channel.quantizes("model.layers.11.self_attn.q_proj")
    # Read through transformers' AutoConfig, as a checkpoint's config.json is.
    config = ModelConfig.from_dict(
        TINY
        | {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
        | {"quantization_config": block_config((128, 128))}
    )
    assert config.fp8 == Fp8Config("block", (128, 128))


def _channel_with(role: str, **changes: Any) -> dict[str, Any]:
    config = channel_config()
    group = config["config_groups"]["group_0"]
    group[role] = group[role] | changes
    return config


@pytest.mark.parametrize(
    ("quantization", "what"),
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
        ({"quant_method": "awq"}, "quant_method 'awq'"),
        (block_config((128, 128)) | {"activation_scheme": "static"}, "activation_scheme 'static'"),
        (block_config((128, 128)) | {"fmt": "e5m2"}, "fmt 'e5m2'"),
        (
            block_config((128, 128)) | {"weight_block_size": None},
            "quant_method 'fp8' with weight_block_size None (per tensor)",
        ),
        (_channel_with("weights", strategy="tensor"), "weights strategy 'tensor'"),
        (_channel_with("weights", type="int"), "weights type 'int'"),
        (_channel_with("input_activations", dynamic=False), "input_activations dynamic False"),
        (_channel_with("input_activations", strategy="tensor"), "input_activations strategy"),
        (channel_config() | {"config_groups": {}}, "compressed-tensors with 0 config groups"),
        (
            channel_config() | {"kv_cache_scheme": {"num_bits": 8, "type": "float"}},
            "compressed-tensors with a kv_cache_scheme",
        ),
    ],
)
def test_other_quantizations_are_refused_in_one_line(
    quantization: dict[str, Any], what: str
) -> None:
    with pytest.raises(ValueError) as caught:
        parse_quantization(quantization)
    message = str(caught.value)
    assert "\n" not in message
    assert what in message
    assert message.endswith(f"({SUPPORTED})")


# --- the reference arithmetic ------------------------------------------------------------


@pytest.mark.parametrize("block", [(16, 32), None])
def test_reference_product_is_the_w8a8_arithmetic(block: tuple[int, int] | None) -> None:
    """``w8a8_linear`` against the same quantization and product written out in float64;
    activation groups that are all zeros keep a finite scale."""
    from fp8_fixtures import fake_w8a8

    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 96, generator=gen)
    x = torch.randn(5, 96, generator=gen) * 3
    x[1, :32] = 0.0
    bias = torch.randn(40, generator=gen)
    from outrider.plugins.models.fp8.reference import quantize_weight

    fp8 = quantize_weight(weight, block)
    assert fp8.data.dtype == FP8 and fp8.scale.dtype == torch.float32
    got = w8a8_linear(x, fp8, bias)
    group = 96 if block is None else block[1]
    expected = (fake_w8a8(x, group) @ dequantize(fp8).double().T + bias.double()).float()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()
    assert got.dtype == torch.float32
    assert w8a8_linear(x.bfloat16(), fp8, None).dtype == torch.bfloat16


# --- end to end on CPU -------------------------------------------------------------------

# Activations in e4m3 carry 3 mantissa bits: each is off by up to 1/16 of itself, about 3.6 %
# RMS, and each of the 21 quantized projections of these 3-layer models adds that much noise
# to its output. Measured on the four cases: the logits' RMS difference from the unquantized
# model is 5 to 7 % of the logits' spread (standard deviation). Twice the worst holds the
# arithmetic to that while a wrong or missing scale (which moves the logits by their whole
# spread) fails; the exact tokens and the w8a8 logits above are the strict checks.
LOGIT_TOLERANCE = 0.15
# The w8a8 reference is the engine's arithmetic with its float32 sums in another order: equal
# to about 1e-6, but for an activation that lands on an e4m3 rounding boundary in one order and
# not in the other (another thread count or CPU), moved by a step (1/16 of itself) with every
# logit after it: 4 % of the logits' spread was seen on a 32-core host.
FLIP_TOLERANCE = 0.1


@pytest.mark.parametrize(("kind", "fmt", "block"), CASES)
def test_greedy_tokens_are_the_w8a8_references(
    checkpoints: Path, kind: str, fmt: str, block: tuple[int, int] | None
) -> None:
    got, logits = _engine_run(checkpoints / f"{kind}-{fmt}")
    dequantized = checkpoints / f"{kind}-{fmt}-dequantized"
    group = 0 if block is None else block[1]
    expected, w8a8_logits = _hf_greedy(hf_reference(dequantized, group))
    assert got == expected
    _, plain_logits = _hf_greedy(hf_reference(dequantized, None))
    spread = plain_logits.std()
    assert (logits - w8a8_logits).abs().max() <= FLIP_TOLERANCE * spread
    assert (logits - plain_logits).pow(2).mean().sqrt() <= LOGIT_TOLERANCE * spread


@pytest.mark.parametrize(("kind", "fmt", "block"), [CASES[0], CASES[3]])
def test_the_engine_serves_the_w8a8_references_tokens(
    checkpoints: Path, kind: str, fmt: str, block: tuple[int, int] | None
) -> None:
    """The in-process engine (scheduler, runner, paged KV) on the FP8 checkpoint: the
    greedy tokens of HF's w8a8 reference."""
    from engine_harness import engine_for, requests_for, run, tokens_of

    engine = engine_for(str(checkpoints / f"{kind}-{fmt}"), speculative_algorithm="none")
    prompts = [_prompt(n) for _, n in PROMPTS]
    got = tokens_of(run(engine, requests_for(prompts, max_new_tokens=DECODE_STEPS)))
    group = 0 if block is None else block[1]
    expected, _ = _hf_greedy(hf_reference(checkpoints / f"{kind}-{fmt}-dequantized", group))
    assert [got[rid] for rid in range(len(prompts))] == expected


def test_fp8_storage_and_skipped_modules(checkpoints: Path, tmp_path: Path) -> None:
    """Quantized projections hold FP8 and float32 scales; a module the config leaves out
    (here every down_proj) loads its 16-bit checkpoint tensor as it stands."""
    skipped = ("down_proj",)
    target = tmp_path / "skipping"
    write_fp8_checkpoint(
        checkpoints / "llama", target, block_config((32, 32), list(skipped)), skipped=skipped
    )
    model, config = load_model(
        target, dtype=torch.bfloat16, device="cpu", max_positions=16, progress=_quiet
    )
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear)
    assert layer.self_attn.qkv_proj.weight.dtype == FP8
    assert layer.self_attn.qkv_proj.weight_scale_inv.dtype == torch.float32
    assert layer.self_attn.qkv_proj.weight_scale_inv.shape == (2 + 1 + 1, 2)
    assert not isinstance(layer.mlp.down_proj, Fp8Linear)
    assert layer.mlp.down_proj.weight.dtype == torch.bfloat16
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.lm_head is not None and model.lm_head.weight.dtype == torch.bfloat16
    stored = load_file(target / "model.safetensors")
    torch.testing.assert_close(
        layer.mlp.down_proj.weight, stored["model.layers.0.mlp.down_proj.weight"].bfloat16()
    )
    check_checkpoint_layout(config)


# --- the rank's cut ----------------------------------------------------------------------


@pytest.mark.parametrize("quantization", [block_config((16, 16)), channel_config()])
def test_rank_holds_its_cut_of_weights_and_scales(
    checkpoints: Path, tmp_path: Path, quantization: dict[str, Any]
) -> None:
    """Rank 1 of 2 of a block-scaled (16 x 16 blocks: each rank's q/k/v and gate/up rows and
    o/down columns whole blocks) and a per-channel checkpoint: column-parallel scales cut by
    rows (block rows), row-parallel block scales by column blocks, row-parallel channel
    scales whole."""
    target = tmp_path / "fp8"
    write_fp8_checkpoint(checkpoints / "llama", target, quantization)
    whole = load_file(target / "model.safetensors")
    kwargs: dict[str, Any] = {"dtype": torch.float32, "device": "cpu", "max_positions": 16}
    rank, _ = load_model(target, tp=TPGroup(1, 2), progress=_quiet, **kwargs)
    held = checkpoint_tensors(rank)
    scale = "weight_scale" if quantization["quant_method"] != "fp8" else "weight_scale_inv"
    attn, mlp = "model.layers.1.self_attn", "model.layers.1.mlp"
    for name, dim in (
        (f"{attn}.k_proj.weight", 0),
        (f"{attn}.k_proj.{scale}", 0),
        (f"{mlp}.up_proj.{scale}", 0),
        (f"{attn}.o_proj.weight", 1),
        (f"{mlp}.down_proj.{scale}", 1 if scale == "weight_scale_inv" else None),
    ):
        full = whole[name]
        if dim is None:
            expected = full
        else:
            half = full.shape[dim] // 2
            expected = full[half:] if dim == 0 else full[:, half:]
        assert held[name].dtype == full.dtype, name
        assert torch.equal(held[name].float(), expected.float()), name
    check_checkpoint_layout(ModelConfig.from_pretrained(target), tensor_parallel_size=2)


def test_dummy_fp8_weights_and_their_cut(checkpoints: Path, tmp_path: Path) -> None:
    """``--load-format dummy`` from a config.json with a quantization_config: FP8 weights with
    positive scales that run, each rank holding the cut of a single rank's draws."""
    directory = tmp_path / "dummy"
    directory.mkdir()
    config = (checkpoints / "llama-block" / "config.json").read_text()
    (directory / "config.json").write_text(config.replace("[32, 32]", "[16, 16]"))
    kwargs: dict[str, Any] = {"dtype": torch.float32, "device": "cpu", "max_positions": 16}
    one, _ = load_model(directory, load_format="dummy", **kwargs)
    two, _ = load_model(directory, load_format="dummy", tp=TPGroup(1, 2), **kwargs)
    qkv = one.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8
    assert isinstance(qkv, Fp8Linear) and (qkv.fp8_weight.scale > 0).all()
    # N(0, 0.02) quantized per 16 x 16 block: each block's largest value is +-448.
    assert qkv.weight[:16, :16].float().abs().max() == 448.0
    whole, cut = checkpoint_tensors(one), checkpoint_tensors(two)
    for name in (
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.mlp.up_proj.weight_scale_inv",
    ):
        assert torch.equal(cut[name].float(), whole[name][whole[name].shape[0] // 2 :].float())
    generated, logits = _engine_run(directory, load_format="dummy")
    assert torch.isfinite(logits).all() and len(generated[0]) == DECODE_STEPS


# --- refusals at start -------------------------------------------------------------------


def _fp8_config(kind: str, quantization: dict[str, Any]) -> ModelConfig:
    extra: dict[str, Any] = {"head_dim": 24} if kind == "qwen3" else {}
    arch = "Qwen3ForCausalLM" if kind == "qwen3" else "LlamaForCausalLM"
    return ModelConfig.from_dict(
        TINY
        | extra
        | {"architectures": [arch], "model_type": kind}
        | {"quantization_config": quantization}
    )


def test_blocks_a_rank_would_split_are_refused() -> None:
    # Llama's 2 KV heads of 16: a rank's k rows are 16, half a block of 32.
    llama = _fp8_config("llama", block_config((32, 32)))
    build_model(llama, max_positions=4, dtype=torch.bfloat16, device="meta", tp=SINGLE)
    message = (
        "model.layers.0.self_attn.qkv_proj: FP8 blocks of 32 do not tile the k rows of 16 a "
        "rank holds under --tensor-parallel-size 2; the checkpoint's weight_block_size needs "
        "each rank's share to be whole blocks"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build_model(llama, max_positions=4, dtype=torch.bfloat16, device="meta", tp=TPGroup(0, 2))
    # Row-parallel: down_proj's 96 columns are 48 a rank, not whole blocks of 32 columns.
    wide = _fp8_config("llama", block_config((16, 32)))
    down = r"^model\.layers\.0\.mlp\.down_proj: .* the columns of 48 "
    with pytest.raises(ValueError, match=down):
        build_model(wide, max_positions=4, dtype=torch.bfloat16, device="meta", tp=TPGroup(0, 2))
    # The per-channel format cuts anywhere.
    build_model(
        _fp8_config("llama", channel_config()),
        max_positions=4,
        dtype=torch.bfloat16,
        device="meta",
        tp=TPGroup(0, 2),
    )


def test_partly_quantized_fused_projection_is_refused() -> None:
    config = _fp8_config("llama", block_config((32, 32), ["k_proj"]))
    message = (
        "model.layers.0.self_attn.qkv_proj: the checkpoint quantizes some of "
        "model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj, "
        "model.layers.0.self_attn.v_proj only (they run as one fused projection)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build_model(config, max_positions=4, dtype=torch.bfloat16, device="meta")


def test_a_16_bit_checkpoint_under_an_fp8_config_is_refused(
    checkpoints: Path, tmp_path: Path
) -> None:
    """The config says FP8 but the checkpoint holds the 16-bit weights: named, not cast."""
    target = tmp_path / "mislabelled"
    write_fp8_checkpoint(checkpoints / "llama", target, channel_config())
    tensors = load_file(checkpoints / "llama" / "model.safetensors")
    fp8 = load_file(target / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    assert quantized_projection(name)
    from safetensors.torch import save_file

    save_file(fp8 | {name: tensors[name]}, target / "model.safetensors")
    message = (
        f"target: checkpoint tensor {name} is not FP8, expected torch.float8_e4m3fn (is its "
        "quantization_config that of the checkpoint?)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        load_model(target, dtype=torch.float32, device="cpu", max_positions=16, progress=_quiet)


def test_fp8_weight_record_shapes() -> None:
    """The per-channel record's activation group is the whole row."""
    data = torch.zeros(4, 48, dtype=FP8)
    assert Fp8Weight(data, torch.ones(4, 1), None).group == 48
    assert Fp8Weight(data, torch.ones(1, 2), (16, 32)).group == 32


def test_roofline_counts_fp8_bytes() -> None:
    """``bench latency``'s roofline reads each FP8 weight as one byte plus its float32
    scales; the rest (norms, LM head) in the model dtype."""
    from outrider.daemon.bench.roofline import weight_bytes

    plain = ModelConfig.from_dict(
        TINY | {"architectures": ["LlamaForCausalLM"]} | {"model_type": "llama"}
    )
    block = _fp8_config("llama", block_config((32, 32)))
    channel = _fp8_config("llama", channel_config())
    hidden, inter, layers = (
        TINY["hidden_size"],
        TINY["intermediate_size"],
        TINY["num_hidden_layers"],
    )
    kv_rows = TINY["num_key_value_heads"] * hidden // TINY["num_attention_heads"]
    # Per layer: q, o (64 x 64); k, v (32 x 64); gate, up (96 x 64); down (64 x 96).
    projections = layers * (2 * hidden * hidden + 2 * kv_rows * hidden + 3 * inter * hidden)
    # 32 x 32 blocks: q 2 x 2, k 1 x 2, v 1 x 2, o 2 x 2, gate 3 x 2, up 3 x 2, down 2 x 3.
    block_scales = layers * (4 + 2 + 2 + 4 + 6 + 6 + 6)
    # One per output row: q 64, k 32, v 32, o 64, gate 96, up 96, down 64.
    channel_scales = layers * (64 + 32 + 32 + 64 + 96 + 96 + 64)
    rest = weight_bytes(plain, "bfloat16") - 2 * projections
    assert weight_bytes(block, "bfloat16") == rest + projections + 4 * block_scales
    assert weight_bytes(channel, "bfloat16") == rest + projections + 4 * channel_scales


@pytest.mark.parametrize(
    ("name", "quantization"),
    [("Qwen3-8B", block_config((128, 128))), ("Llama-3.1-8B-Instruct", channel_config())],
)
def test_reference_fp8_configs_shard_over_eight(name: str, quantization: dict[str, Any]) -> None:
    """The published FP8 layouts of these models (Qwen3-8B-FP8: 128 x 128 blocks; the
    per-channel Llama-3.1-8B-Instruct-FP8) load at every rank's cut of eight: the fill path
    on the meta device. Qwen3-4B's MLP (9,728 rows: 76 blocks) splits a block over eight."""
    d = json.loads((CONFIGS / f"{name}.config.json").read_text())
    config = ModelConfig.from_dict(d | {"quantization_config": quantization})
    check_checkpoint_layout(config, tensor_parallel_size=8)
    four_b = ModelConfig.from_dict(
        d | {"quantization_config": quantization} | {"intermediate_size": 9728}
    )
    if quantization["quant_method"] == "fp8":
        with pytest.raises(ValueError, match="the gate rows of 1216 a rank holds under"):
            check_checkpoint_layout(four_b, tensor_parallel_size=8)
        check_checkpoint_layout(four_b, tensor_parallel_size=4)
    else:
        check_checkpoint_layout(four_b, tensor_parallel_size=8)


def test_preflight_refuses_before_anything_is_spawned(tmp_path: Path) -> None:
    """The start checks (no torch) name an unsupported quantization_config, and each
    block-quantized projection whose share a rank would hold is not whole blocks."""
    from outrider.daemon.config import ServeConfig
    from outrider.daemon.processes.preflight import preflight

    config = TINY | {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (tmp_path / "config.json").write_text(
        json.dumps(config | {"quantization_config": block_config((32, 32))})
    )
    serve = ServeConfig(model=str(tmp_path), load_format="dummy")
    assert preflight(serve) == []
    tail = "a rank holds under --tensor-parallel-size 2; the checkpoint's weight_block_size "
    tail += "needs each rank's share to be whole blocks"
    blocks = [
        ("self_attn.k_proj rows of 16", 32),
        ("self_attn.v_proj rows of 16", 32),
        ("mlp.gate_proj rows of 48", 32),
        ("mlp.up_proj rows of 48", 32),
        ("mlp.down_proj columns of 48", 32),
    ]
    assert preflight(
        ServeConfig(model=str(tmp_path), load_format="dummy", tensor_parallel_size=2)
    ) == [
        f"--model {tmp_path}: FP8 blocks of {size} do not tile the {what} {tail}"
        for what, size in blocks
    ]
    (tmp_path / "config.json").write_text(
        json.dumps(config | {"quantization_config": {"quant_method": "awq", "bits": 4}})
    )
    assert preflight(serve) == [
        f"--model {tmp_path}: quantization_config quant_method 'awq' is not supported ({SUPPORTED})"
    ]


def _rank_logits(rank: int, port: int, directory: Path) -> None:
    import os

    import torch.distributed as dist

    from outrider.plugins.models.parallel import init_tensor_parallel

    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, 2, f"tcp://127.0.0.1:{port}", "gloo")
    try:
        model, _ = load_model(
            directory, dtype=torch.float32, device="cpu", max_positions=32, progress=_quiet, tp=tp
        )
        shape = model.attention_shape
        rows = PagedRows(num_layers=model.num_layers, shape=shape, page_size=4, max_len=16)
        input_ids, fb = rows.batch(torch_backend(shape), [(0, _prompt(9))])
        with torch.no_grad():
            torch.save(model.compute_logits(model(input_ids, fb)), directory / f"rank{rank}.pt")
        os._exit(0)  # as test_tensor_parallel.py's ranks leave (gloo's teardown)
    finally:
        dist.destroy_process_group()


def test_two_ranks_run_the_block_checkpoint(checkpoints: Path, tmp_path: Path) -> None:
    """Two gloo ranks on a block-scaled checkpoint whose every cut is whole blocks: each
    rank's activation groups are the model's, so only float32 sums run in another order
    (the row-parallel all-reduce). A sum that lands across an e4m3 rounding boundary moves
    one activation by up to 1/16 of itself, hence a tolerance above float32 rounding."""
    import torch.multiprocessing as mp
    from daemon_harness import free_port

    directory = tmp_path / "fp8"
    write_fp8_checkpoint(checkpoints / "llama", directory, block_config((16, 16)))
    mp.spawn(_rank_logits, args=(free_port(), directory), nprocs=2, join=True)
    torch.set_num_threads(1)
    model, _ = load_model(
        directory, dtype=torch.float32, device="cpu", max_positions=32, progress=_quiet
    )
    shape = model.attention_shape
    rows = PagedRows(num_layers=model.num_layers, shape=shape, page_size=4, max_len=16)
    input_ids, fb = rows.batch(torch_backend(shape), [(0, _prompt(9))])
    with torch.no_grad():
        ref = model.compute_logits(model(input_ids, fb))
    for rank in range(2):
        got = torch.load(directory / f"rank{rank}.pt")
        torch.testing.assert_close(got, ref, atol=1e-2, rtol=0)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
