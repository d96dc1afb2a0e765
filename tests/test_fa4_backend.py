"""The ``fa4`` attention backend: its spec, check and metadata (CPU), FA4's kernels against the
torch backend over the same paged cache in every phase, decode graphs replayed over new lengths,
and the engine with FA4 (GPU with FlashAttention-4)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from engine_harness import ENGINE_ALGORITHMS, engine_for, request, run, tokens_of
from model_fixtures import PagedRows, torch_backend
from test_attention_graphs import KINDS, Kind, graph_replays, make_batch, paged_rows, qkv
from test_layer_kernels import LLAMA

from outrider.daemon.engine.accept import tree_geometry
from outrider.daemon.family import embedded_family
from outrider.plugins.api import PHASES, CheckContext, NoOptions, Phase
from outrider.plugins.attention.base import AttentionBackend
from outrider.plugins.attention.fa4_backend import SPEC, head_dim_problem
from outrider.plugins.attention.fa4_impl import FA4Attention, fa4_metadata
from outrider.plugins.checks import attention_problems
from outrider.plugins.device import AttentionShape, BatchLayout, ForwardBatch
from outrider.plugins.registry import discover

EVERYWHERE: dict[Phase, str] = dict.fromkeys(PHASES, "fa4")
SHAPE_CPU = AttentionShape(4, 2, 16, 16**-0.5, torch.bfloat16)
NOT_INSTALLED = (
    "--attention-backend fa4: FlashAttention-4 is not installed (pip install 'outrider[fa4]')"
)


def _ctx(routes: dict[Phase, str] = EVERYWHERE, **changes: object) -> CheckContext:
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


def _installed(monkeypatch: pytest.MonkeyPatch, installed: bool) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if installed else None)


# --- spec, check and metadata (CPU) ----------------------------------------------------------


def test_fa4_declares_every_phase_trees_and_non_causal_blocks_on_cuda() -> None:
    spec = discover().get("attention", "fa4")
    assert spec is SPEC
    caps = spec.attention
    assert caps is not None
    assert caps.devices == {"cuda"}
    assert caps.dtypes == {"bfloat16", "float16"}
    assert caps.page_sizes == {1, 2, 4, 8, 16, 32, 64, 128}
    assert caps.phases == set(PHASES)
    assert (caps.non_causal, caps.tree_mask, caps.cuda_graphs) == (True, True, True)
    assert (caps.graph_kv_bound, caps.host_plans) == (False, False)
    for dtype in ("bfloat16", "float16"):
        for page_size in (1, 16, 128):
            ctx = _ctx(dtype=dtype, page_size=page_size)
            assert attention_problems(spec, caps, ctx) == []
    [big] = attention_problems(spec, caps, _ctx(page_size=256))
    assert str(big) == "--page-size: fa4 takes page sizes 1, 2, 4, 8, 16, 32, 64, 128, not 256"
    [fp32] = attention_problems(spec, caps, _ctx(dtype="float32"))
    assert str(fp32) == "--dtype: fa4 does not support float32"


def test_fa4_is_refused_cleanly_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``outrider plugins`` and ``serve`` say on a machine without a GPU or FA4."""
    _installed(monkeypatch, False)
    cpu = _ctx(device="cpu", dtype="float32", cuda_capability=None, speculative_algorithm="none")
    assert [str(p) for p in discover().check(cpu)] == [
        "--device: fa4 does not run on cpu",
        "--dtype: fa4 does not support float32",
        NOT_INSTALLED,
    ]


def test_fa4_checks_its_install_and_the_compute_capability(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _installed(monkeypatch, False)
    assert [str(p) for p in SPEC.check(SPEC, _ctx())] == [NOT_INSTALLED]
    _installed(monkeypatch, True)
    for capability in ((9, 0), (10, 0), (11, 0)):
        assert SPEC.check(SPEC, _ctx(cuda_capability=capability)) == []
    for (major, minor), shown in (((8, 9), "8.9"), ((12, 0), "12.0")):
        [old] = SPEC.check(SPEC, _ctx(cuda_capability=(major, minor)))
        assert str(old) == (
            f"--attention-backend fa4: fa4 needs compute capability 9.0 to 11.x (paged KV), "
            f"not {shown}"
        )


def test_fa4_serves_gpt_oss_windows_and_sinks_where_flashinfer_is_refused(
    tmp_path: Path,
) -> None:
    """The capability checks pass a gpt-oss config (sliding layers, sinks) on fa4 in every
    phase; FlashInfer, which has neither, is refused naming both."""
    config = {"model_type": "gpt_oss", "num_attention_heads": 8, "head_dim": 64,
              "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    ctx = _ctx(model=str(tmp_path), speculative_algorithm="none")
    caps = SPEC.attention
    assert caps is not None and (caps.sliding_window, caps.sinks) == (True, True)
    assert attention_problems(SPEC, caps, ctx) == []
    flashinfer = discover().get("attention", "flashinfer")
    assert flashinfer.attention is not None
    routes = dict.fromkeys(PHASES, "flashinfer")
    refused = attention_problems(
        flashinfer, flashinfer.attention, _ctx(routes, model=str(tmp_path))
    )
    assert [p.message for p in refused if "has no" in p.message] == [
        f"flashinfer has no sliding-window layers (layer_types), which --model {tmp_path} has",
        f"flashinfer has no attention sinks (gpt_oss), which --model {tmp_path} has",
    ]


def test_fa4_checks_the_head_dims_of_the_models_it_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _installed(monkeypatch, True)
    target, draft = tmp_path / "target", tmp_path / "draft"
    for path, config in ((target, {"head_dim": 192}), (draft, {"hidden_size": 1200,
                         "num_attention_heads": 12})):  # fmt: skip
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
    ctx = _ctx(model=str(target), draft_model=str(draft))
    [draft_dim] = SPEC.check(SPEC, ctx)  # 1200 / 12 = 100: not a multiple of 8
    assert str(draft_dim) == (
        "--attention-backend fa4: fa4 takes head dims 8 to 256 in steps of 8 on SM 9.x, "
        f"not 100 (--draft-model {draft})"
    )
    # The draft runs on another backend: only the target's head dim matters.
    hybrid = EVERYWHERE | {"draft_decode": "torch", "draft_extend": "torch"}
    assert SPEC.check(SPEC, dataclasses.replace(ctx, attention_routes=hybrid)) == []
    [blackwell, _] = SPEC.check(SPEC, dataclasses.replace(ctx, cuda_capability=(10, 0)))
    assert str(blackwell) == (
        "--attention-backend fa4: fa4 takes head dims 8 to 128 in steps of 8, or 256, on "
        f"SM 10.x, not 192 (--model {target})"
    )


def test_head_dims_fa4_takes() -> None:
    for dim in (8, 64, 72, 128, 192, 256):
        assert head_dim_problem(dim, (9, 0)) is None
    for dim in (4, 100, 264):
        assert head_dim_problem(dim, (9, 0)) is not None
    for dim in (64, 128, 256):
        assert head_dim_problem(dim, (10, 0)) is None
    assert head_dim_problem(192, (10, 0)) is not None
    with pytest.raises(ValueError, match="not 100"):
        FA4Attention(
            AttentionShape(4, 2, 100, 0.1, torch.bfloat16), NoOptions(), torch.device("cpu")
        )


def test_metadata_is_fa4s_int32_view_of_the_layout() -> None:
    """Lengths, queries and pages straight from the layout's device tensors; causal layouts
    map to FA4's causal mask, DFlash blocks to none, trees to the tree mask."""
    gen = torch.Generator().manual_seed(3)
    rows = paged_rows(gen, "cpu", SHAPE_CPU)
    for kind in KINDS:
        layout = make_batch(kind, rows, 3, gen)
        meta = fa4_metadata(layout)
        assert meta.cu_seqlens_q.dtype == meta.seqused_k.dtype == torch.int32
        assert meta.cu_seqlens_q.tolist() == layout.q_start.tolist()
        assert meta.seqused_k.tolist() == layout.seq_lens.tolist()
        assert torch.equal(meta.page_table, rows.page_table[layout.slots])
        assert meta.max_q == kind.width
        assert meta.causal == (kind.causal and not kind.tree)
        if kind.tree:
            assert layout.tree_mask is not None and meta.tree is not None
            assert meta.tree.dtype == torch.int32 and meta.tree.is_contiguous()
            assert torch.equal(meta.tree.bool(), layout.tree_mask)
        else:
            assert meta.tree is None
        assert meta.positions is None  # read by windowed trees alone
        windowed = fa4_metadata(layout, windowed=True)
        if kind.tree:  # each query's position on the row's grid, -1 past its queries
            grid = torch.full((3 * kind.width,), -1, dtype=torch.int32)
            grid[layout.q_pad_index] = layout.positions.to(torch.int32)
            assert windowed.positions is not None
            assert windowed.positions.tolist() == grid.view(3, kind.width).tolist()
        else:
            assert windowed.positions is None


# --- FA4 against the torch backend (GPU) -----------------------------------------------------

CUDA = torch.device("cuda")
SHAPE = AttentionShape(32, 8, 128, 128**-0.5, torch.bfloat16)
BF16 = {"atol": 2e-2, "rtol": 2e-2}
needs_fa4 = pytest.mark.skipif(
    not torch.cuda.is_available()
    or importlib.util.find_spec("cutlass") is None
    or importlib.util.find_spec("flash_attn.cute") is None,
    reason="needs a GPU and FlashAttention-4 (pip install 'outrider[fa4]')",
)


def fa4_backend(shape: AttentionShape) -> AttentionBackend:
    built: AttentionBackend = SPEC.load()(shape, NoOptions(), CUDA)
    return built


def _attend_both(
    fb: ForwardBatch, backend: AttentionBackend, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """FA4's output and the torch backend's (``fb``'s) over the same layout, cache and inputs
    (sink logits drawn where the shape has sinks, scaled to weigh as keys do)."""
    shape = backend.shape
    q, k, v = qkv(fb.layout.num_tokens, gen, CUDA, shape)
    sinks = None
    if shape.sinks:
        sinks = (2 * torch.randn(shape.num_q_heads, generator=gen)).to(CUDA, shape.dtype)
    want = fb.attend(0, q, k, v, sinks)
    got = ForwardBatch.bind(fb.layout, backend, fb.kv).attend(0, q, k, v, sinks)
    return got, want


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize(
    ("head_dim", "page_size"), [(128, 1), (128, 16), (128, 128), (64, 16), (256, 16)]
)
def test_prompt_chunks_and_decode_match_torch(head_dim: int, page_size: int) -> None:
    """Ragged prompt chunks over a cached prefix (several key tiles long), then decode steps
    with a row joining at length 1; page 128 takes FA4's TMA path at head dim 128."""
    _prompts_then_decode(AttentionShape(32, 8, head_dim, head_dim**-0.5, torch.bfloat16), page_size)


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize(
    ("window", "sinks"), [(37, False), (0, True), (37, True)], ids=["window", "sinks", "both"]
)
def test_sliding_windows_and_sinks_match_torch(window: int, sinks: bool) -> None:
    """The same prompt chunks and decode steps in a layer of a 37-position window (FA4's
    local mask), with sinks (its learnable sink)."""
    _prompts_then_decode(dataclasses.replace(SHAPE, windows=(window,), sinks=sinks), 16)


def _prompts_then_decode(shape: AttentionShape, page_size: int) -> None:
    """FA4 against the torch backend over ragged prompt chunks, then decode steps."""
    reference, fused = torch_backend(shape, CUDA), fa4_backend(shape)
    rows = PagedRows(
        num_layers=1, shape=shape, page_size=page_size, max_len=700, dtype=shape.dtype,
        device=CUDA,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    steps = [
        {0: 37, 3: 300, 5: 1},  # first chunks
        {0: 263, 3: 250},  # the rest, over the cached prefix
        {0: 1, 3: 1, 5: 1},
        {0: 1, 3: 1, 5: 1, 6: 1},  # slot 6 starts with one token: a row of length 1
    ]
    for step in steps:
        _, fb = rows.batch(reference, [(slot, [5] * count) for slot, count in step.items()])
        got, want = _attend_both(fb, fused, gen)
        torch.testing.assert_close(got, want, **BF16)


@dataclasses.dataclass(frozen=True)
class Block:
    """A decode batch kind over long rows: ``width`` queries a row at the end of a ``block``
    of positions (``block == width`` but for a tree drafting step, whose queries are the
    newest nodes of the tree so far)."""

    name: str
    width: int
    block: int = 0
    causal: bool = True
    tree: bool = False


BLOCKS = [
    Block("decode", 1),
    Block("chain verify", 4),
    Block("tree verify", 6, tree=True),
    Block("dflash block", 16, causal=False),
    Block("tree drafting step", 4, block=12, tree=True),
]


def _long_rows(shape: AttentionShape, gen: torch.Generator, max_len: int) -> PagedRows:
    """Four slots of ``max_len`` positions of random K/V, pages of 16."""
    rows = PagedRows(
        num_layers=1, shape=shape, page_size=16, max_len=max_len, max_slots=4,
        dtype=shape.dtype, device=CUDA,
    )  # fmt: skip
    rows.batch(torch_backend(shape, CUDA), [(slot, [0] * max_len) for slot in range(4)])
    for cache in (*rows.kv.k, *rows.kv.v):
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return rows


def _block_batch(
    kind: Block, rows: PagedRows, starts: list[int], gen: torch.Generator
) -> BatchLayout:
    """Row ``r`` (slot ``r``) holds ``starts[r]`` positions before its block and writes its
    queries' K/V at the block's last ``width`` positions."""
    bs, w = len(starts), kind.width
    block = kind.block or w
    first = torch.tensor(starts).unsqueeze(1)  # [bs, 1]
    kv_slots = first + (block - w) + torch.arange(w)  # [bs, W]
    positions, tree_mask = kv_slots, None
    if kind.tree:
        opened = torch.rand(bs, w, block, generator=gen) < 0.5
        own = torch.zeros(bs, w, block, dtype=torch.bool)
        own[:, torch.arange(w), block - w + torch.arange(w)] = True
        tree_mask = opened | own
        if kind.block == 0:  # a verify tree: ancestors by parents, positions by depth
            parents = torch.tensor([0, 0, 1, 1, 3]).expand(bs, -1)
            depth, tree_mask = tree_geometry(parents, max_depth=3)
            positions = first + depth
    slots = torch.arange(bs)
    page_size = rows.page_size
    pages = rows.page_table.cpu()[slots.unsqueeze(1), kv_slots // page_size].long()
    seq_lens = first.squeeze(1) + block
    return BatchLayout(
        page_table=rows.page_table,
        page_size=page_size,
        slots=slots.to(CUDA),
        positions=positions.reshape(-1).to(CUDA),
        out_loc=(pages * page_size + kv_slots % page_size).reshape(-1).to(CUDA),
        q_start=(torch.arange(bs + 1) * w).to(CUDA),
        seq_lens=seq_lens.to(CUDA),
        q_pad_index=torch.arange(bs * w).to(CUDA),
        bs=bs,
        max_q=w,
        max_kv=int(seq_lens.max()),
        causal=kind.causal,
        tree_mask=tree_mask.to(CUDA) if tree_mask is not None else None,
    )


# Every kind in bf16; decode and a tree verify in fp16 too (other kernels: keep compiles few).
BLOCK_CASES = [(kind, torch.bfloat16) for kind in BLOCKS] + [
    (BLOCKS[0], torch.float16),
    (BLOCKS[2], torch.float16),
]


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize(
    ("kind", "dtype"),
    BLOCK_CASES,
    ids=[f"{kind.name}-{str(dtype).removeprefix('torch.')}" for kind, dtype in BLOCK_CASES],
)
def test_speculative_blocks_over_long_rows_match_torch(kind: Block, dtype: torch.dtype) -> None:
    """Decode, chain and tree verify, DFlash's non-causal block and a tree drafting step over
    rows whose prefixes span several key tiles (and one a single page)."""
    tolerance = BF16 if dtype == torch.bfloat16 else {"atol": 5e-3, "rtol": 5e-3}
    _blocks_match_torch(kind, dataclasses.replace(SHAPE, dtype=dtype), 5, tolerance)


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("window", [2, 37])
@pytest.mark.parametrize("kind", BLOCKS[:3], ids=[kind.name for kind in BLOCKS[:3]])
def test_verify_blocks_under_a_window_and_sinks_match_torch(kind: Block, window: int) -> None:
    """Decode, chain and tree verify over long rows in a windowed layer with sinks: a tree's
    block cell sits at its node's position, so a 2-position window cuts inside the tree."""
    _blocks_match_torch(kind, dataclasses.replace(SHAPE, windows=(window,), sinks=True), 7, BF16)


def _blocks_match_torch(
    kind: Block, shape: AttentionShape, seed: int, tolerance: dict[str, float]
) -> None:
    """FA4 against the torch backend over ``kind``'s blocks on long rows."""
    gen = torch.Generator().manual_seed(seed)
    rows = _long_rows(shape, gen, max_len=720)
    fused, reference = fa4_backend(shape), torch_backend(shape, CUDA)
    for starts in ([700, 3, 129, 255], [1], [64, 511]):
        layout = _block_batch(kind, rows, starts, gen)
        got, want = _attend_both(ForwardBatch.bind(layout, reference, rows.kv), fused, gen)
        torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_cuda_graph_replays_equal_eager_fa4_attention(kind: Kind) -> None:
    """``build`` and the layer captured in one graph per batch size, then replayed over new
    batches of other lengths written into the fixed inputs: exactly what an eager forward over
    each batch gives, and the torch backend within bf16 rounding."""
    gen = torch.Generator().manual_seed(11)
    rows = paged_rows(gen, CUDA, SHAPE)
    fused, reference = fa4_backend(SHAPE), torch_backend(SHAPE, CUDA)
    for batch, out, inputs in graph_replays(kind, rows, fused, gen):
        eager = ForwardBatch.bind(batch, fused, rows.kv).attend(0, *inputs)
        torch.testing.assert_close(out, eager, atol=0, rtol=0)
        want = ForwardBatch.bind(batch, reference, rows.kv).attend(0, *inputs)
        torch.testing.assert_close(out, want, **BF16)


# --- the engine with FA4 (GPU) ---------------------------------------------------------------


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("algorithm", ENGINE_ALGORITHMS)
def test_the_engine_serves_with_fa4_graphs_as_eagerly(
    algorithm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded family in bf16 with fa4 in every phase (DFlash's non-causal draft, EAGLE-3's
    tree verify and tree drafting included), every launch under the sync check: decode graphs,
    one per batch size for every length, give exactly the tokens of eager steps with the same
    kernels, for batches of changing size."""
    monkeypatch.setenv("OUTRIDER_DEBUG_SYNC_CHECK", "1")
    if algorithm == "eagle3 tree":
        # NOTE: FlashInfer's fused RoPE refuses the stride-0 positions of a batch-1 tree
        # drafting step (its frontier's positions are one expanded column); the torch layer
        # kernels take them. Attention is what this test is about.
        monkeypatch.setenv("OUTRIDER_DEBUG_TORCH_KERNELS", "1")
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
            str(family.target), device="cuda", dtype="bfloat16", attention_backend="fa4",
            max_running=8, **settings, **overrides,
        )  # fmt: skip
        return tokens_of(run(engine, requests, stagger=2))

    graphed = serve()
    assert graphed == serve(disable_cuda_graph=True)
    assert {rid: len(tokens) for rid, tokens in graphed.items()} == {
        i: 20 + 3 * i for i in range(8)
    }


# ARCHITECTURE.md 4.4: teacher-forced logits within 0.25 in bf16; a free-running divergence only
# where the reference's top-2 gap is within twice that.
MAX_LOGIT_DIFF = 0.25


@pytest.mark.gpu
@needs_fa4
def test_greedy_tokens_follow_the_torch_backend_under_the_bf16_rule(tmp_path: Path) -> None:
    """A random Llama (head dim 128, GQA 4:1) in bf16, greedy, fa4 against torch in every
    phase: the same tokens up to each request's first divergence, their log-probabilities
    (teacher-forced: both saw the same tokens) within twice the logit rule, and the divergence
    only where the torch engine's top two are within twice the rule."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (300, 17, 90, 5)]
    requests = [request(i, p, max_new_tokens=24, logprobs=2) for i, p in enumerate(prompts)]

    def serve(backend: str) -> dict[int, list[tuple[int, float, float]]]:
        """Per request: (token, its logprob, the top-2 gap) of every output position."""
        engine = engine_for(
            str(tmp_path), load_format="dummy", device="cuda", dtype="bfloat16",
            attention_backend=backend, context_length=1024,
        )  # fmt: skip
        outcomes = run(engine, requests)
        return {
            rid: [
                (lp.token_id, lp.logprob, lp.top[0][1] - lp.top[1][1])
                for update in outcome.updates
                for lp in update.logprobs or []
            ]
            for rid, outcome in outcomes.items()
        }

    fused, reference = serve("fa4"), serve("torch")
    for rid, want in reference.items():
        got = fused[rid]
        assert len(got) == len(want) == 24
        for (token, logprob, _), (ref_token, ref_logprob, ref_gap) in zip(got, want, strict=True):
            if token != ref_token:
                assert ref_gap <= 2 * MAX_LOGIT_DIFF, f"request {rid} diverged at a clear choice"
                break
            assert abs(logprob - ref_logprob) <= 2 * MAX_LOGIT_DIFF
