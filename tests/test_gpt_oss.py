"""gpt-oss (plugins/models/gpt_oss.py), float32 on CPU against transformers' GptOssForCausalLM
on a tiny random config (sliding layers of 4 positions, sinks, YaRN, clamped experts with
biases): logits through prefill, chunked prefill and decode; greedy outputs through the
engine; the checkpoint layout; what is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_harness import debug_checks_fixture, engine_for, requests_for, run, tokens_of
from model_fixtures import (
    GPT_OSS_SHAPE,
    PagedRows,
    hf_greedy,
    mixed_prompts,
    save_tiny_model,
    torch_backend,
)
from safetensors.torch import load_file

from outrider.plugins.models.config import ModelConfig
from outrider.plugins.models.gpt_oss import GptOssForCausalLM
from outrider.plugins.models.layers import DecoderForCausalLM
from outrider.plugins.models.loader import (
    build_model,
    check_checkpoint_layout,
    expected_checkpoint_shapes,
    load_model,
)
from outrider.plugins.models.parallel import TPGroup

debug_checks = debug_checks_fixture()

NEW_TOKENS = 8
PROMPTS = mixed_prompts(3, 4)
ATOL = 1e-4


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    directory = tmp_path_factory.mktemp("gpt_oss")
    with torch.no_grad():
        model = save_tiny_model("gpt_oss", directory)
    return directory, model


def _quiet(index: int, count: int, name: str) -> None:
    pass


def _load(path: Path) -> DecoderForCausalLM:
    model, _ = load_model(
        path, dtype=torch.float32, device="cpu", load_format="auto", max_positions=64,
        progress=_quiet,
    )  # fmt: skip
    return model


def test_the_config_reads_windows_sinks_yarn_and_experts(
    reference: tuple[Path, torch.nn.Module],
) -> None:
    config = ModelConfig.from_pretrained(reference[0])
    assert config.windows == (4, 0, 4, 0) and config.sinks
    assert config.rope.yarn is not None and config.rope.attention_factor > 1
    assert config.moe is not None and config.moe.clamped_swiglu is not None
    assert config.moe.clamped_swiglu.limit == GPT_OSS_SHAPE["swiglu_limit"]
    assert (config.moe.num_experts, config.moe.top_k, config.moe.sparse_layers) == (
        4, 2, frozenset(range(4)),
    )  # fmt: skip
    assert config.attention_bias and config.o_proj_bias


@pytest.mark.parametrize("chunked", [False, True], ids=["prefill", "chunked"])
def test_logits_match_hf(reference: tuple[Path, torch.nn.Module], chunked: bool) -> None:
    """Prompts of 7, 13 and 21 tokens (past the window of 4), whole or in two chunks, then 3
    decode steps: every position's logits are transformers'."""
    directory, hf = reference
    model = _load(directory)
    assert isinstance(model, GptOssForCausalLM)
    gen = torch.Generator().manual_seed(5)
    lens, steps_after = (7, 13, 21), 3
    seqs = [torch.randint(3, 250, (n + steps_after,), generator=gen).tolist() for n in lens]
    with torch.no_grad():
        expected = [hf(torch.tensor([s])).logits[0] for s in seqs]
    rows = PagedRows(
        num_layers=model.num_layers, shape=model.attention_shape, page_size=4,
        max_len=max(map(len, seqs)),
    )  # fmt: skip
    backend = torch_backend(model.attention_shape)
    prefill = [[(0, n // 2), (n // 2, n)] if chunked else [(0, n)] for n in lens]
    steps = list(zip(*prefill, strict=True))
    steps += [tuple((n + i, n + i + 1) for n in lens) for i in range(steps_after)]
    for spans in steps:
        batch = [(slot, seq[a:b]) for slot, seq, (a, b) in zip((2, 0, 5), seqs, spans, strict=True)]
        input_ids, fb = rows.batch(backend, batch, kv_slack=3)
        with torch.no_grad():
            logits = model.compute_logits(model(input_ids, fb))
        got = logits.split([b - a for a, b in spans])
        for (a, b), row_logits, ref in zip(spans, got, expected, strict=True):
            torch.testing.assert_close(row_logits, ref[a:b], atol=ATOL, rtol=0)


def test_greedy_matches_transformers(reference: tuple[Path, torch.nn.Module]) -> None:
    directory, hf = reference
    with torch.no_grad():
        expected = hf_greedy(hf, PROMPTS, NEW_TOKENS)
    assert max(len(p) for p in PROMPTS) > GPT_OSS_SHAPE["sliding_window"]
    engine = engine_for(str(directory), page_size=4)
    outcomes = run(engine, requests_for(PROMPTS, max_new_tokens=NEW_TOKENS))
    assert tokens_of(outcomes) == dict(enumerate(expected))


def test_the_checkpoint_layout_is_derived_from_the_config(
    reference: tuple[Path, torch.nn.Module],
) -> None:
    directory, _ = reference
    config = ModelConfig.from_pretrained(directory)
    saved = {
        name: tuple(tensor.shape)
        for file in directory.glob("*.safetensors")
        for name, tensor in load_file(file).items()
    }
    assert expected_checkpoint_shapes(config) == saved
    check_checkpoint_layout(config)


def test_what_is_not_served_yet_is_refused(
    reference: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    """Experts in mxfp4 and tensor parallelism, each named; sliding layers of a family that
    has none."""
    directory, _ = reference
    raw = json.loads((directory / "config.json").read_text())
    mxfp4 = raw | {"quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(ValueError, match="quant_method 'mxfp4' is not supported"):
        ModelConfig.from_dict(mxfp4)
    config = ModelConfig.from_pretrained(directory)
    with pytest.raises(ValueError, match="gpt-oss under tensor parallelism is not supported"):
        build_model(config, max_positions=8, dtype=torch.float32, device="meta",
                    tp=TPGroup(rank=0, size=2))  # fmt: skip
    llama = json.loads(
        (Path(__file__).parent / "fixtures" / "configs" / "Llama-3.1-8B-Instruct.config.json")
        .read_text()
    )  # fmt: skip
    llama["layer_types"] = ["sliding_attention"] * llama["num_hidden_layers"]
    with pytest.raises(ValueError, match="layer_types \\['sliding_attention'\\] of 32 layers"):
        ModelConfig.from_dict(llama | {"sliding_window": 128})
