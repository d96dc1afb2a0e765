"""The ``triton`` attention backend: its spec, check and launches (no Triton needed), its kernels
against the torch backend over the same paged cache (Triton's interpreter on CPU, compiled
kernels on a GPU), and decode graphs replayed over new lengths (GPU)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from engine_harness import ENGINE_ALGORITHMS, engine_for, request, run, tokens_of
from model_fixtures import PagedRows, torch_backend
from test_attention_graphs import (
    BUCKETS,
    KINDS,
    FixedInputs,
    Kind,
    graph_replays,
    make_batch,
    paged_rows,
    qkv,
)

from outrider.daemon.family import embedded_family
from outrider.plugins.api import PHASES, CheckContext, Phase
from outrider.plugins.attention.base import AttentionBackend
from outrider.plugins.attention.triton_backend import SPEC, TritonOptions
from outrider.plugins.attention.triton_plan import MODE_CAUSAL, MODE_TREE, launch_plan
from outrider.plugins.checks import attention_problems
from outrider.plugins.device import AttentionShape, ForwardBatch
from outrider.plugins.registry import discover

CUDA = torch.cuda.is_available()  # without one, conftest.py runs Triton's interpreter
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="Triton is not installed (pip install 'outrider[triton]')",
)

# GQA groups of 2; the interpreter is slow, so heads are few and small.
SHAPE = AttentionShape(4, 2, 16, 16**-0.5, torch.float32)


# --- spec, check, options and launches (no Triton) -----------------------------------------


def _ctx(routes: dict[Phase, str], **changes: object) -> CheckContext:
    ctx = CheckContext(
        device="cuda",
        dtype="bfloat16",
        page_size=16,
        overlap=True,
        attention_routes=routes,
        speculative_algorithm="eagle3",
        cuda_capability=(9, 0),
    )
    return dataclasses.replace(ctx, **changes)  # type: ignore[arg-type]


EVERYWHERE: dict[Phase, str] = dict.fromkeys(PHASES, "triton")


def test_triton_declares_every_phase_trees_and_non_causal_blocks_on_cuda() -> None:
    spec = discover().get("attention", "triton")
    assert spec is SPEC
    caps = spec.attention
    assert caps is not None
    assert caps.devices == {"cuda"}
    assert caps.dtypes == {"float32", "bfloat16", "float16"}
    assert caps.page_sizes is None
    assert caps.phases == set(PHASES)
    assert (caps.non_causal, caps.tree_mask, caps.cuda_graphs) == (True, True, True)
    assert (caps.graph_kv_bound, caps.host_plans) == (False, False)
    for dtype in ("bfloat16", "float16", "float32"):
        for page_size in (1, 16, 128):
            ctx = _ctx(EVERYWHERE, dtype=dtype, page_size=page_size)
            assert attention_problems(spec, caps, ctx) == []
    tree = _ctx(
        EVERYWHERE, speculative_topk=4, speculative_num_steps=3, speculative_num_draft_tokens=8
    )
    assert [p for p in discover().check(tree) if p.option.endswith("attention-backend")] == []
    [cpu] = attention_problems(spec, caps, _ctx(EVERYWHERE, device="cpu"))
    assert str(cpu) == "--device: triton does not run on cpu"


def test_triton_checks_its_install(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _ctx(EVERYWHERE)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    [missing] = SPEC.check(SPEC, ctx)
    assert str(missing) == (
        "--attention-backend triton: Triton is not installed (pip install 'outrider[triton]')"
    )
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert SPEC.check(SPEC, ctx) == []


def test_triton_options_fix_the_split_count_and_launch_settings_within_bounds() -> None:
    assert SPEC.parse_options(None) == TritonOptions(kv_splits=0)
    assert SPEC.parse_options('{"kv_splits": 8}') == TritonOptions(kv_splits=8)
    tuned = '{"block_n": 32, "num_warps": 8, "num_stages": 3, "programs_per_sm": 4}'
    assert SPEC.parse_options(tuned) == TritonOptions(
        block_n=32, num_warps=8, num_stages=3, programs_per_sm=4
    )
    caps = SPEC.attention
    assert caps is not None
    for bad in ('{"kv_splits": 65}', '{"kv_splits": -1}', '{"splits": 2}', '{"block_n": 8}',
                '{"block_n": 48}', '{"num_warps": 3}', '{"num_stages": 9}'):  # fmt: skip
        [problem] = attention_problems(
            SPEC, caps, _ctx(EVERYWHERE, attention_config={"triton": bad})
        )
        assert problem.option == "--attention-config triton"


def test_launches_fill_the_device_from_the_batch_size_and_width_alone() -> None:
    """An H100's 132 SMs want 264 programs; a 32-head model with 8 KV heads (groups of 4)."""

    def plan(bs: int, max_q: int, head_dim: int = 128, kv_splits: int = 0) -> tuple[int, ...]:
        launch = launch_plan(
            num_q_heads=32, num_kv_heads=8, head_dim=head_dim, bs=bs, max_q=max_q,
            mode=MODE_CAUSAL, programs_wanted=264, kv_splits=kv_splits,
        )  # fmt: skip
        return launch.block_m, launch.block_n, launch.query_tiles, launch.splits

    assert plan(1, 1) == (16, 64, 1, 32)  # decode at batch 1: 8 programs, 32 splits each
    assert plan(4, 1) == (16, 64, 1, 8)
    assert plan(32, 1) == (16, 64, 1, 1)  # 256 programs: no split, no merge
    assert plan(1, 4) == (16, 64, 1, 32)  # a chain of 3 drafts: 16 (query, head) pairs
    assert plan(2, 16) == (64, 64, 1, 16)  # DFlash blocks of 16
    assert plan(1, 2048) == (64, 64, 128, 1)  # a prompt chunk: query tiles fill the device
    # Rows of one query tile (decode, verify, DFlash's block) pipeline two stages, a prompt
    # chunk's Triton's own (0), unless the options choose.
    pipelines = [
        launch_plan(
            num_q_heads=32, num_kv_heads=8, head_dim=128, bs=bs, max_q=max_q, mode=MODE_CAUSAL,
            programs_wanted=264,
        ).stages(chosen)
        for bs, max_q, chosen in [(1, 1, 0), (256, 1, 0), (2, 16, 0), (1, 17, 0), (1, 2048, 0),
                                  (1, 2048, 4)]
    ]  # fmt: skip
    assert pipelines == [2, 2, 2, 0, 0, 4]
    assert plan(1, 1, head_dim=256)[1] == 32
    assert plan(1, 1, kv_splits=3)[3] == 3
    assert launch_plan(
        num_q_heads=32, num_kv_heads=8, head_dim=128, bs=1, max_q=1, mode=MODE_CAUSAL,
        programs_wanted=264, block_n=128,
    ).block_n == 128  # fmt: skip
    assert not launch_plan(
        num_q_heads=4, num_kv_heads=4, head_dim=64, bs=300, max_q=1, mode=MODE_TREE,
        programs_wanted=264,
    ).merged  # fmt: skip


# --- kernels against the torch backend -------------------------------------------------------


def triton_backend(shape: AttentionShape, kv_splits: int = 0, **tuning: int) -> AttentionBackend:
    options = TritonOptions(kv_splits=kv_splits, **tuning)
    built: AttentionBackend = SPEC.load()(shape, options, DEVICE)
    return built


def _attend_both(
    fb: ForwardBatch, backend: AttentionBackend, gen: torch.Generator, shape: AttentionShape
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch backend's output and ``backend``'s over the same layout, cache and inputs
    (sink logits drawn where the shape has sinks)."""
    q, k, v = qkv(fb.layout.num_tokens, gen, DEVICE, shape)
    sinks = _sinks(shape, gen)
    want = fb.attend(0, q, k, v, sinks)
    got = ForwardBatch.bind(fb.layout, backend, fb.kv).attend(0, q, k, v, sinks)
    return got, want


def _sinks(shape: AttentionShape, gen: torch.Generator) -> torch.Tensor | None:
    """Random sink logits for ``shape``'s heads, scaled so that they weigh as keys do."""
    if not shape.sinks:
        return None
    return (2 * torch.randn(shape.num_q_heads, generator=gen)).to(DEVICE, shape.dtype)


def _prompts_then_decode(
    shape: AttentionShape,
    page_size: int,
    kv_splits: int,
    atol: float,
    max_len: int = 64,
    **tuning: int,
) -> None:
    """Ragged prompt chunks over a cached prefix, then decode steps (a row joining with its
    first token, of length 1), page boundaries crossed on the way; ``tuning``: the backend's
    launch settings (``TritonOptions``)."""
    reference = torch_backend(shape, DEVICE)
    fused = triton_backend(shape, kv_splits, **tuning)
    rows = PagedRows(
        num_layers=1, shape=shape, page_size=page_size, max_len=max_len, dtype=shape.dtype,
        device=DEVICE,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    long = max_len - 8
    steps = [
        {0: long // 2, 3: 9, 5: 1},  # first chunks
        {0: long - long // 2, 3: 11},  # the rest, over the cached prefix
        {0: 1, 3: 1, 5: 1},
        {0: 1, 3: 1, 5: 1, 6: 1},  # slot 6 starts with one token: a row of length 1
    ]
    for step in steps:
        _, fb = rows.batch(reference, [(slot, [5] * count) for slot, count in step.items()])
        got, want = _attend_both(fb, fused, gen, shape)
        torch.testing.assert_close(got, want, atol=atol, rtol=atol)


@needs_triton
@pytest.mark.parametrize("kv_splits", [0, 3], ids=["auto splits", "3 splits"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_prompt_chunks_and_decode_match_torch(page_size: int, kv_splits: int) -> None:
    _prompts_then_decode(SHAPE, page_size, kv_splits, atol=1e-4, max_len=160)


@needs_triton
@pytest.mark.parametrize("kv_splits", [1, 3], ids=["one split", "3 splits"])
@pytest.mark.parametrize(
    ("window", "sinks"), [(5, False), (0, True), (5, True)], ids=["window", "sinks", "both"]
)
def test_sliding_windows_and_sinks_match_torch(window: int, sinks: bool, kv_splits: int) -> None:
    """Prompt chunks and decode steps in a layer of a 5-position window, with sinks (added
    at the end of the one split, or in the merge of three)."""
    shape = dataclasses.replace(SHAPE, windows=(window,), sinks=sinks)
    _prompts_then_decode(shape, page_size=4, kv_splits=kv_splits, atol=1e-4, max_len=96)


@needs_triton
@pytest.mark.parametrize("kind", KINDS[:3], ids=[k.name for k in KINDS[:3]])
def test_verify_layouts_under_a_window_and_sinks_match_torch(kind: Kind) -> None:
    """Decode, chain and tree verify in a layer of a 2-position window with sinks: a tree's
    block cell sits at its node's position."""
    shape = dataclasses.replace(SHAPE, windows=(2,), sinks=True)
    gen = torch.Generator().manual_seed(3)
    rows = paged_rows(gen, DEVICE, shape)
    fused, reference = triton_backend(shape, 3), torch_backend(shape, DEVICE)
    for bs in BUCKETS:
        batch = make_batch(kind, rows, bs, gen)
        q, k, v = qkv(bs * kind.width, gen, DEVICE, shape)
        sinks = _sinks(shape, gen)
        got = ForwardBatch.bind(batch, fused, rows.kv).attend(0, q, k, v, sinks)
        want = ForwardBatch.bind(batch, reference, rows.kv).attend(0, q, k, v, sinks)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@needs_triton
def test_launch_settings_leave_the_attention_unchanged() -> None:
    """KV steps of 16 (the default: 64), two warps and stages, one program an SM (so one split
    where the device is one SM, the interpreter's)."""
    _prompts_then_decode(
        SHAPE, page_size=16, kv_splits=0, atol=1e-4, max_len=96,
        block_n=16, num_warps=2, num_stages=2, programs_per_sm=1,
    )  # fmt: skip


@needs_triton
def test_groups_of_four_and_head_dim_64_match_torch() -> None:
    shape = AttentionShape(8, 2, 64, 64**-0.5, torch.float32)
    _prompts_then_decode(shape, page_size=8, kv_splits=2, atol=1e-4, max_len=96)


@needs_triton
def test_half_precision_matches_torch() -> None:
    """float16 (the interpreter computes bfloat16 dots wrongly: bfloat16 runs on GPUs only)."""
    shape = dataclasses.replace(SHAPE, dtype=torch.float16)
    _prompts_then_decode(shape, page_size=16, kv_splits=3, atol=5e-3)


@needs_triton
@pytest.mark.parametrize("kv_splits", [0, 3], ids=["auto splits", "3 splits"])
@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_decode_and_verify_layouts_of_a_graph_match_torch(kind: Kind, kv_splits: int) -> None:
    """Decode, chain verify, tree verify and DFlash's non-causal block, laid out as a decode
    graph lays them out (fixed buffers, the graph's KV bound): the torch backend's result over
    each batch's own layout."""
    gen = torch.Generator().manual_seed(7)
    rows = paged_rows(gen, DEVICE, SHAPE)
    fused, reference = triton_backend(SHAPE, kv_splits), torch_backend(SHAPE, DEVICE)
    fixed = FixedInputs(kind, rows)
    for bs in BUCKETS:
        batch = make_batch(kind, rows, bs, gen)
        q, k, v = qkv(bs * kind.width, gen, DEVICE, SHAPE)
        got = ForwardBatch.bind(fixed.write(batch), fused, rows.kv).attend(0, q, k, v)
        want = ForwardBatch.bind(batch, reference, rows.kv).attend(0, q, k, v)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# --- GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [1, 16])
def test_bf16_prompts_and_decode_match_torch(page_size: int, head_dim: int) -> None:
    shape = AttentionShape(32, 8, head_dim, head_dim**-0.5, torch.bfloat16)
    _prompts_then_decode(shape, page_size, kv_splits=0, atol=2e-2, max_len=600)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_cuda_graph_replays_equal_eager_triton_attention(kind: Kind) -> None:
    """``build`` and the layer captured in one graph per batch size, built once, then replayed
    over new batches of other lengths written into the fixed inputs: what an eager forward over
    each batch gives, and the torch backend within bf16 rounding."""
    shape = AttentionShape(32, 8, 128, 128**-0.5, torch.bfloat16)
    gen = torch.Generator().manual_seed(11)
    rows = paged_rows(gen, DEVICE, shape)
    fused, reference = triton_backend(shape), torch_backend(shape, DEVICE)
    for batch, out, inputs in graph_replays(kind, rows, fused, gen):
        eager = ForwardBatch.bind(batch, fused, rows.kv).attend(0, *inputs)
        torch.testing.assert_close(out, eager, atol=0, rtol=0)
        want = ForwardBatch.bind(batch, reference, rows.kv).attend(0, *inputs)
        torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("algorithm", ENGINE_ALGORITHMS)
def test_the_engine_serves_with_triton_graphs_as_eagerly(
    algorithm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded family in bf16 with triton in every phase (DFlash's non-causal draft and
    EAGLE-3's tree verify included), every launch under the sync check: decode graphs, one per
    batch size for every length, give exactly the tokens of eager steps with the same kernels,
    for batches of changing size."""
    monkeypatch.setenv("OUTRIDER_DEBUG_SYNC_CHECK", "1")
    family = embedded_family()
    assert family is not None, "the family package is installed with the test extra"
    settings = dict(ENGINE_ALGORITHMS[algorithm])
    name = str(settings["speculative_algorithm"])
    if name in family.drafts:
        settings["draft_model"] = str(family.drafts[name])
    prompts = [[3 + (7 * i + 3 * j) % 4000 for j in range(5 + 9 * i)] for i in range(8)]
    requests = [request(i, p, max_new_tokens=20 + 3 * i) for i, p in enumerate(prompts)]

    def serve(**overrides: object) -> dict[int, list[int]]:
        engine = engine_for(
            str(family.target), device="cuda", dtype="bfloat16", attention_backend="triton",
            max_running=8, **settings, **overrides,
        )  # fmt: skip
        return tokens_of(run(engine, requests, stagger=2))

    graphed = serve()
    assert graphed == serve(disable_cuda_graph=True)
    assert {rid: len(tokens) for rid, tokens in graphed.items()} == {
        i: 20 + 3 * i for i in range(8)
    }
