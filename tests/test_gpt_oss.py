"""gpt-oss (plugins/models/gpt_oss.py), float32 on CPU against transformers' GptOssForCausalLM
on a tiny random config (sliding layers of 4 positions, sinks, YaRN, clamped experts with
biases): logits through prefill, chunked prefill and decode; greedy outputs through the
engine; the checkpoint layout; what is refused."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CONFIGS, CUDA
from engine_harness import (
    DRAFT_ALGORITHMS,
    debug_checks_fixture,
    engine_for,
    record_launches,
    requests_for,
    run,
    tokens_of,
)
from model_fixtures import (
    GPT_OSS_SHAPE,
    PagedRows,
    hf_greedy,
    hf_logprobs,
    mixed_prompts,
    save_drafts,
    save_random_eagle3,
    save_tiny_model,
    torch_backend,
)
from numeric_rule import MAX_DIFF, assert_within_rule
from safetensors.torch import load_file, save_file

from outrider.plugins.models.config import ClampedSwiglu, ModelConfig, tensor_parallel_problems
from outrider.plugins.models.gpt_oss import GptOssForCausalLM, GptOssMxfp4Experts
from outrider.plugins.models.layers import DecoderForCausalLM
from outrider.plugins.models.loader import (
    build_model,
    check_checkpoint_layout,
    expected_checkpoint_shapes,
    load_model,
)
from outrider.plugins.models.moe.reference import sum_over_experts
from outrider.plugins.models.mxfp4 import BLOCK, E2M1_VALUES, SCALE_BIAS, dequantize
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


@pytest.mark.parametrize("whole", [False, True])
def test_greedy_matches_transformers(reference: tuple[Path, torch.nn.Module], whole: bool) -> None:
    """The sliding layers' K/V in window pages (the default) and whole."""
    directory, hf = reference
    with torch.no_grad():
        expected = hf_greedy(hf, PROMPTS, NEW_TOKENS)
    assert max(len(p) for p in PROMPTS) > GPT_OSS_SHAPE["sliding_window"]
    engine = engine_for(str(directory), page_size=4, whole_sliding_kv=whole)
    assert (engine.loop.runner.kv.window_map is None) == whole
    assert (engine.scheduler.pages.window is None) == whole
    outcomes = run(engine, requests_for(PROMPTS, max_new_tokens=NEW_TOKENS))
    assert tokens_of(outcomes) == dict(enumerate(expected))


@pytest.mark.parametrize(
    "algorithm",
    ["ngram", "eagle3 chain", "eagle3 tree", "eagle3 deep tree", "dflash", "standalone"],
)
def test_speculation_keeps_greedy(
    reference: tuple[Path, torch.nn.Module],
    tmp_path_factory: pytest.TempPathFactory,
    algorithm: str,
) -> None:
    """Every algorithm's verify (chains, trees whose nodes sit past the window of 4 from
    their root's ancestors: 5 steps deep) keeps transformers' greedy outputs."""
    directory, hf = reference
    with torch.no_grad():
        expected = hf_greedy(hf, PROMPTS, NEW_TOKENS)
    settings = dict(
        DRAFT_ALGORITHMS["eagle3 tree" if algorithm == "eagle3 deep tree" else algorithm]
    )
    if algorithm == "eagle3 deep tree":
        settings |= {"speculative_num_steps": 5, "speculative_num_draft_tokens": 10}
    if algorithm != "ngram":
        drafts = save_drafts(tmp_path_factory.mktemp("gpt_oss_drafts"), directory)
        settings["draft_model"] = drafts[algorithm.split()[0]]
    engine = engine_for(str(directory), page_size=4, **settings)
    outcomes = run(engine, requests_for(PROMPTS, max_new_tokens=NEW_TOKENS))
    assert tokens_of(outcomes) == dict(enumerate(expected))
    assert engine.scheduler.counters().spec_drafts > 0


@pytest.mark.parametrize("algorithm", ["none", "eagle3 tree", "dflash"])
def test_window_pages_keep_greedy_through_prefix_hits(
    reference: tuple[Path, torch.nn.Module],
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    algorithm: str,
) -> None:
    """The sliding layers' K/V in window pages (the default), those behind the windows
    of 4 given back as requests go on, prompts in chunks of 3 (a chunk's queries read the
    window across chunks), a retraction every third plan, and prompts that extend earlier
    ones or leave them half-way, admitted later, hitting the prefix cache only where it kept
    the window before the hit's end: transformers' greedy outputs, from a window pool
    smaller than the page pool; at the end only the cache holds window pages (the KV check
    of every turn holds the pool's invariants)."""
    monkeypatch.setenv("OUTRIDER_DEBUG_RETRACT_EVERY", "3")
    directory, hf = reference
    # Later prompts extend the earlier ones (a hit where the cache kept the window before
    # the hit's end), or leave them half-way (where it gave that window back).
    system = PROMPTS[3][:16]  # a prefix three prompts share, as a system prompt
    prompts = [
        *PROMPTS,
        [*system, 3, 5, 7, 9],
        *(p + p[:6] for p in PROMPTS),
        [*system, 11, 13, 15],
        *([*p[: len(p) // 2], 3, 5, 7] for p in PROMPTS),
        [*system, 4, 6, 8],
    ]
    with torch.no_grad():
        expected = hf_greedy(hf, prompts, NEW_TOKENS)
    settings: dict[str, object] = {}
    if algorithm != "none":
        drafts = save_drafts(tmp_path_factory.mktemp("window_drafts"), directory)
        settings = dict(DRAFT_ALGORITHMS[algorithm], draft_model=drafts[algorithm.split()[0]])
    with caplog.at_level(logging.INFO, logger="outrider.engine"):
        engine = engine_for(str(directory), page_size=4, chunked_prefill_tokens=3, **settings)
    window = engine.scheduler.pages.window
    assert window is not None
    logged = f"the sliding layers' window pages: {window.pages - 1} of 4 positions"
    assert any(logged in record.getMessage() for record in caplog.records)
    outcomes = run(engine, requests_for(prompts, max_new_tokens=NEW_TOKENS), stagger=4)
    assert tokens_of(outcomes) == dict(enumerate(expected))
    finals = [o.updates[-1].finish for o in outcomes.values()]
    assert sum(f.usage.cached_tokens for f in finals if f is not None) > 0
    # The last prompt on the shared prefix hits it: the window before it was computed again
    # by the one before and given to the cache.
    last = finals[-1]
    assert last is not None and last.usage.cached_tokens >= 8
    kv = engine.loop.runner.kv
    assert kv.window_map is not None
    sizes = [tuple(cache.shape[:1]) for cache in kv.k]
    assert sizes == [(window.pages,), (kv.num_pages,)] * 2 and window.pages < kv.num_pages
    assert set(window.held) == window.cached and set(window.holders.values()) <= {1}
    assert engine.scheduler.counters().spec_drafts > 0 or algorithm == "none"


def test_decoding_rows_ride_prompt_chunks_through_window_pages(
    reference: tuple[Path, torch.nn.Module],
) -> None:
    """``--mixed-batches`` with the sliding layers in window pages: decoding rows ride
    prompt chunks of 5 (each rider's window pages move with its one token, beside a chunk's
    reads of its own window): transformers' greedy outputs."""
    directory, hf = reference
    with torch.no_grad():
        expected = hf_greedy(hf, PROMPTS, NEW_TOKENS)
    engine = engine_for(str(directory), page_size=4, mixed_batches=True, chunked_prefill_tokens=5)
    assert engine.scheduler.pages.window is not None
    plans = record_launches(engine.loop.runner)
    outcomes = run(engine, requests_for(PROMPTS, max_new_tokens=NEW_TOKENS), stagger=2)
    assert tokens_of(outcomes) == dict(enumerate(expected))
    riding = [plan for plan in plans if plan.relay_rows]
    assert len(riding) >= 10, [plan.kind for plan in plans]  # 18 of 28 plans here


def test_a_model_without_sliding_layers_takes_no_window_pages(tmp_path: Path) -> None:
    directory = tmp_path / "llama"
    save_tiny_model("llama", directory)
    engine = engine_for(str(directory))
    assert engine.loop.runner.kv.window_map is None and engine.scheduler.pages.window is None


@pytest.mark.parametrize("algorithm", ["eagle3 chain", "eagle3 tree"])
def test_an_eagle3_draft_whose_heads_are_wider_than_its_hidden_size_keeps_greedy(
    reference: tuple[Path, torch.nn.Module],
    tmp_path_factory: pytest.TempPathFactory,
    algorithm: str,
) -> None:
    """gpt-oss's attention is wider than its hidden size (64 heads of 64 over 2,880), and so
    are EAGLE-3 drafts shaped after it: here 8 heads of 16 over a hidden size of 64."""
    directory, hf = reference
    with torch.no_grad():
        expected = hf_greedy(hf, PROMPTS, NEW_TOKENS)
    wide = {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16}
    draft = save_random_eagle3(tmp_path_factory.mktemp("wide_eagle3"), directory, wide)
    hidden = json.loads((directory / "config.json").read_text())["hidden_size"]
    weights = {k: v for f in draft.glob("*.safetensors") for k, v in load_file(f).items()}
    assert weights["midlayer.self_attn.o_proj.weight"].shape == (hidden, 128) != (hidden, hidden)
    engine = engine_for(
        str(directory), page_size=4, **DRAFT_ALGORITHMS[algorithm], draft_model=str(draft)
    )
    outcomes = run(engine, requests_for(PROMPTS, max_new_tokens=NEW_TOKENS))
    assert tokens_of(outcomes) == dict(enumerate(expected))
    assert engine.scheduler.counters().spec_drafts > 0


NEEDS_FA4 = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None
    or importlib.util.find_spec("flash_attn.cute") is None,
    reason="needs FlashAttention-4 (pip install 'outrider[fa4]')",
)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("backend", "dtype"),
    [
        ("torch", "float32"),
        ("triton", "float32"),
        pytest.param("fa4", "bfloat16", marks=NEEDS_FA4),
        pytest.param("auto", "bfloat16", marks=NEEDS_FA4),
    ],
)
def test_cuda_serves_gpt_oss_within_the_numeric_rule(
    reference: tuple[Path, torch.nn.Module],
    mxfp4_reference: tuple[Path, torch.nn.Module],
    tmp_path_factory: pytest.TempPathFactory,
    backend: str,
    dtype: str,
) -> None:
    """On CUDA, 16-bit and mxfp4 experts, decode batches replayed from CUDA graphs (every
    expert on every token) and eager, under plain decoding and an EAGLE-3 tree, with the
    sliding layers whole and in window pages: transformers' float32 log-probabilities within
    the rule of ``dtype``. torch and triton in float32; FA4 in bfloat16 in every phase (its
    windows and sinks, the draft's steps, the tree's verify), and ``--attention-backend
    auto`` (the decode phases routed by batch size between triton and FA4)."""
    for directory, hf in (reference, mxfp4_reference):
        with torch.no_grad():
            expected = hf_greedy(hf, PROMPTS, NEW_TOKENS)
            logprobs = hf_logprobs(hf, PROMPTS, expected)
        drafts = save_drafts(tmp_path_factory.mktemp(f"{directory.name}-drafts"), directory)
        tree = dict(DRAFT_ALGORITHMS["eagle3 tree"], draft_model=drafts["eagle3"])
        whole = {"whole_sliding_kv": True}
        for graphs, settings in (
            (True, {}), (False, {}), (True, tree), (True, whole), (True, tree | whole),
        ):  # fmt: skip
            engine = engine_for(
                str(directory), device="cuda", dtype=dtype, attention_backend=backend,
                disable_cuda_graph=not graphs, **settings,
            )  # fmt: skip
            requests = requests_for(PROMPTS, max_new_tokens=NEW_TOKENS, logprobs=2)
            for rid, outcome in run(engine, requests).items():
                served = [lp for update in outcome.updates for lp in update.logprobs or []]
                assert_within_rule(logprobs[rid], served, MAX_DIFF[dtype])


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
    """Experts that do not divide among the ranks (they are held whole: the intermediate
    size is not cut), named; mxfp4 and sliding layers of a family that has neither."""
    directory, _ = reference
    raw = json.loads((directory / "config.json").read_text())
    assert tensor_parallel_problems(raw | {"intermediate_size": 33}, 2) == []
    assert tensor_parallel_problems(raw | {"num_local_experts": 3}, 2) == [
        "--tensor-parallel-size 2 does not divide the model's num_local_experts (3): each "
        "rank takes an equal share"
    ]
    config = ModelConfig.from_dict(raw | {"num_local_experts": 3})
    refusal = r"^--tensor-parallel-size 2 does not divide the model's num_local_experts \(3\)"
    with pytest.raises(ValueError, match=refusal):
        build_model(config, max_positions=8, dtype=torch.float32, device="meta",
                    tp=TPGroup(rank=0, size=2))  # fmt: skip
    llama = json.loads((CONFIGS / "Llama-3.1-8B-Instruct.config.json").read_text())
    with pytest.raises(ValueError, match="quant_method 'mxfp4' is supported for gpt_oss only"):
        ModelConfig.from_dict(llama | {"quantization_config": {"quant_method": "mxfp4"}})
    llama["layer_types"] = ["sliding_attention"] * llama["num_hidden_layers"]
    with pytest.raises(ValueError, match="layer_types \\['sliding_attention'\\] of 32 layers"):
        ModelConfig.from_dict(llama | {"sliding_window": 128})


# --- experts in mxfp4 -----------------------------------------------------------------------


def _quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight: [..., in]`` (float32) -> mxfp4 ``(blocks, scales)``: each block of 32 scaled
    by the power of two that brings its largest magnitude to at most 6, each value rounded to
    the nearest e2m1 value."""
    groups = weight.unflatten(-1, (-1, BLOCK))  # [..., G, 32]
    largest = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(largest / 6.0)).to(torch.int32)
    scaled = groups / torch.ldexp(torch.ones_like(largest), exponent).unsqueeze(-1)
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    index = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)
    nibbles = (index + 8 * (scaled < 0)).to(torch.uint8)  # [..., G, 32]
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return blocks, (exponent + SCALE_BIAS).to(torch.uint8)


def test_mxfp4_dequantizes_as_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(118, 132, (3, 8, 2), generator=gen, dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [3, 64, 8]
        assert torch.equal(dequantize(blocks, scales, dtype).transpose(1, 2), theirs)
    # The rounding of _quantize: values already on the grid come back exactly.
    grid = dequantize(blocks, scales, torch.float32)
    assert torch.equal(dequantize(*_quantize(grid), torch.float32), grid)


def test_mxfp4_codes_and_scales_decode_exactly() -> None:
    """The kernels assemble each e2m1 value and each E8M0 scale from bits: every one of the
    16 codes is its table value, every one of the 256 scale bytes 2^(byte - 127) (0: the
    subnormal 2^-127; 255: infinity, as 2^128 overflows)."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install 'outrider[triton]')")
    from mxfp4_decode_kernel import decode_kernel

    codes, scales = torch.arange(16, dtype=torch.int32), torch.arange(256, dtype=torch.uint8)
    values, powers = torch.empty(16), torch.empty(256)
    decode_kernel[(1,)](codes, values, scales, powers)
    assert torch.equal(values, torch.tensor(E2M1_VALUES))
    assert torch.equal(values.signbit(), codes >= 8)  # code 8 is -0.0
    expected = torch.ldexp(torch.ones(256), scales.to(torch.int32) - SCALE_BIAS)
    assert torch.equal(powers, expected) and powers[0] == 2.0**-127 and powers[255] == torch.inf


# The interpreter's numpy warns where a large negative gate's sigmoid overflows exp to
# infinity (the sigmoid is 0 then, as on a GPU).
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("path", ["gemv", "grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("held", [range(4), range(2, 4)], ids=["all experts", "experts 2, 3"])
def test_mxfp4_kernels_are_the_reference_sum(held: range, dtype: torch.dtype, path: str) -> None:
    """The decode GEMVs and the grouped GEMMs (Triton's interpreter on the CPU): the
    reference sum over a token's experts, those a rank holds only (expert parallelism), clamps
    active; the grouped path over more tokens than a row block, some experts routed by many.
    The GEMVs take 16 rows a program (the interpreter's time goes by programs; the default
    tile: the test below)."""
    if dtype == torch.bfloat16 and path == "grouped":
        pytest.skip(
            "Triton's interpreter multiplies bfloat16 tiles wrongly (tl.dot): the tensor-core "
            "path is checked on a GPU (test_cuda_runs_the_mxfp4_kernels_in_bfloat16)"
        )
    _check_mxfp4_kernels(held, dtype, path, "cpu", (16, 1024, 4, 3) if path == "gemv" else ())


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_cuda_runs_the_mxfp4_kernels_in_bfloat16(path: str) -> None:
    """On a GPU, bfloat16 activations: the grouped GEMMs on the tensor cores."""
    _check_mxfp4_kernels(range(2, 4), torch.bfloat16, path, "cuda")


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("tiles", [(), (16, 64, 4, 3)], ids=["default", "16x64"])
def test_mxfp4_gemvs_of_other_tiles_are_the_reference_sum(tiles: tuple[int, ...]) -> None:
    """The default tile (a step past the 64 and 96 features, masked) and another, as a tuned
    table may set it: 16 rows, 64 features a step (the 96 features in two steps, the
    second's last block masked)."""
    _check_mxfp4_kernels(range(4), torch.float32, "gemv", "cpu", tiles)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_mxfp4_grouped_gemms_of_other_tiles_are_the_reference_sum() -> None:
    """Other grouped tiles: 32 pairs a program (each expert's block mostly padding), 64
    columns (the 96 intermediate rows' second block masked), 128 features a step (past the
    64 and 96 features, masked), 2 warps, 2 stages."""
    _check_mxfp4_kernels(range(4), torch.float32, "grouped", "cpu", (32, 64, 128, 2, 2))


def _check_mxfp4_kernels(
    held: range, dtype: torch.dtype, path: str, device: str, tiles: tuple[int, ...] = ()
) -> None:
    """``tiles``: the path's (``GemvTiles``' or ``GroupTiles``' fields); none: the default."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install 'outrider[triton]')")
    from outrider.plugins.models.moe import mxfp4_kernels
    from outrider.plugins.models.moe.mxfp4_kernels import GroupTiles
    from outrider.plugins.models.moe.tiles import GemvTiles

    case = _mxfp4_case(held, dtype, 3 if path == "gemv" else 21, device)
    inputs = (case.x.to(device), case.weights, case.routing.to(device), case.ids.to(device))
    if path == "gemv":
        gemv_tiles = GemvTiles(*tiles) if tiles else mxfp4_kernels.DECODE_TILES
        got = mxfp4_kernels.mxfp4_decode_moe(*inputs, gemv_tiles).cpu()
    else:
        group_tiles = GroupTiles(*tiles) if tiles else mxfp4_kernels.GROUP_TILES
        got = mxfp4_kernels.mxfp4_grouped_moe(*inputs, group_tiles).cpu()
    want = case.want()
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    assert want.abs().max() > 1  # the products are not small enough to pass for zeros


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.skipif(CUDA, reason="reads the launches of Triton's interpreter")
def test_every_batch_size_runs_the_mxfp4_kernels_the_first_compiled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The grouped mxfp4 path at token counts whose pairs fall in each of Triton's classes (1,
    a multiple of 16, neither): each kernel launches with the same classes, so a batch of a new
    size never compiles while serving."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install 'outrider[triton]')")
    from specialization import CLASS_TOKENS, classes_by_tokens

    from outrider.plugins.models.moe import mxfp4_kernels

    def run_at(tokens: int) -> Callable[[], object]:
        case = _mxfp4_case(range(4), torch.float32, tokens, "cpu")
        return lambda: mxfp4_kernels.mxfp4_grouped_moe(case.x, case.weights, case.routing, case.ids)

    found = classes_by_tokens(monkeypatch, run_at, CLASS_TOKENS)
    assert {"_gate_up_grouped_kernel", "_down_grouped_kernel"} <= set(found[1])
    assert found == dict.fromkeys(CLASS_TOKENS, found[1])


@dataclass
class Mxfp4Case:
    """Random mxfp4 experts (those of ``held``, on a device), a batch routed to them and its
    reference sum (on the CPU)."""

    weights: Any  # Mxfp4ExpertWeights
    x: torch.Tensor
    ids: torch.Tensor
    routing: torch.Tensor
    want: Callable[[], torch.Tensor]  # the reference sum over each token's held experts


def _mxfp4_case(held: range, dtype: torch.dtype, tokens: int, device: str) -> Mxfp4Case:
    from outrider.plugins.models.moe.mxfp4_kernels import Mxfp4ExpertWeights

    gen = torch.Generator().manual_seed(0)
    experts, hidden, rows = 4, 64, 96
    swiglu = ClampedSwiglu(alpha=1.702, limit=0.5)

    def stored(out: int, into: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.randint(0, 256, (experts, out, into // BLOCK, 16), generator=gen)
        scales = torch.randint(118, 128, (experts, out, into // BLOCK), generator=gen)
        mine = slice(held.start, held.stop)
        held_scales = scales.to(torch.uint8)[mine].contiguous()
        # Bytes of 255 (infinity) past the scales: a kernel reading a row's scales past its
        # features turns the masked zeros there into NaN.
        padded = torch.full((held_scales.numel() + 64,), 255, dtype=torch.uint8)
        padded[: held_scales.numel()] = held_scales.flatten()
        return blocks.to(torch.uint8)[mine], padded[: held_scales.numel()].view_as(held_scales)

    gate_up, down = stored(2 * rows, hidden), stored(hidden, rows)
    biases = [0.1 * torch.randn(len(held), n, generator=gen).to(dtype) for n in (2 * rows, hidden)]
    weights = Mxfp4ExpertWeights(
        *(t.to(device) for t in (*gate_up, biases[0], *down, biases[1])),
        held.start, len(held), swiglu.alpha, swiglu.limit,
    )  # fmt: skip
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(tokens)])
    ids = ids.to(torch.int32)
    routing = torch.rand(tokens, 2, generator=gen).softmax(-1)

    def product(rows_in: torch.Tensor, expert: int) -> torch.Tensor:
        e = expert - held.start
        w_gate_up = dequantize(gate_up[0][e], gate_up[1][e], torch.float32).t()
        w_down = dequantize(down[0][e], down[1][e], torch.float32).t()
        h = rows_in.float() @ w_gate_up + biases[0][e].float()
        gate, up = h[..., ::2].clamp(max=0.5), h[..., 1::2].clamp(-0.5, 0.5)
        glu = ((up + 1) * gate * torch.sigmoid(gate * swiglu.alpha)).to(dtype).float()
        return glu @ w_down + biases[1][e].float()

    def want() -> torch.Tensor:
        return sum_over_experts(x.float(), routing, ids, experts, product, False, held).to(dtype)

    return Mxfp4Case(weights, x, ids, routing, want)


@pytest.fixture(scope="module")
def mxfp4_reference(
    reference: tuple[Path, torch.nn.Module], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, torch.nn.Module]:
    """The tiny model with its experts quantized to mxfp4, saved as the published checkpoints
    hold them, and transformers' model with the dequantized experts in place."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    source, hf = reference
    directory = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, directory / file.name)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head",
        ],
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    tensors = {}
    for file in source.glob("*.safetensors"):
        tensors |= load_file(file)
    hf = copy.deepcopy(hf)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _quantize(tensors.pop(name).transpose(1, 2))  # [E, out, in]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        with torch.no_grad():
            hf.get_parameter(name).copy_(
                convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            )
    save_file(tensors, directory / "model.safetensors")
    return directory, hf


def test_mxfp4_experts_match_hf(mxfp4_reference: tuple[Path, torch.nn.Module]) -> None:
    """Experts held in mxfp4 and dequantized as they run: transformers' logits over the
    dequantized checkpoint, and its greedy outputs through the engine."""
    directory, hf = mxfp4_reference
    model = _load(directory)
    assert model.config.mxfp4_experts
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, GptOssMxfp4Experts)
    assert experts.gate_up_proj_blocks.dtype == torch.uint8
    seq = mixed_prompts(7, 1)[0] + [5, 6, 7]
    rows = PagedRows(num_layers=model.num_layers, shape=model.attention_shape, page_size=4,
                     max_len=len(seq))  # fmt: skip
    input_ids, fb = rows.batch(torch_backend(model.attention_shape), [(0, seq)])
    with torch.no_grad():
        logits = model.compute_logits(model(input_ids, fb))
        torch.testing.assert_close(logits, hf(torch.tensor([seq])).logits[0], atol=ATOL, rtol=0)
        expected = hf_greedy(hf, PROMPTS, NEW_TOKENS)
    engine = engine_for(str(directory), page_size=4)
    outcomes = run(engine, requests_for(PROMPTS, max_new_tokens=NEW_TOKENS))
    assert tokens_of(outcomes) == dict(enumerate(expected))


def test_mxfp4_layout_and_dummy_weights(mxfp4_reference: tuple[Path, torch.nn.Module]) -> None:
    """The blocks and scales a checkpoint holds follow from the config; dummy weights (no
    checkpoint read) draw every block and decode."""
    directory, _ = mxfp4_reference
    config = ModelConfig.from_pretrained(directory)
    saved = {name: tuple(t.shape) for name, t in load_file(directory / "model.safetensors").items()}
    assert expected_checkpoint_shapes(config) == saved
    check_checkpoint_layout(config)
    engine = engine_for(str(directory), load_format="dummy")
    outcomes = run(engine, requests_for(PROMPTS[:2], max_new_tokens=4))
    assert all(len(tokens) == 4 for tokens in tokens_of(outcomes).values())
    weights = engine.loop.runner.model.model.layers[1].mlp.experts.down_proj_blocks
    assert weights.unique().numel() > 200  # random bytes, not one value
