"""Decode batches replayed from CUDA graphs (daemon/engine/graphs.py): padded batch sizes,
bucketed KV bounds and sampling variants must not change a single token.

On CPU the runner's graph path runs with eager "replays": each capture keeps the closure a
graph would record (over the same staged buffers), each replay runs it. On CUDA, real graphs
against the eager engine."""

from __future__ import annotations

import dataclasses
import json
import logging
from functools import partial
from pathlib import Path

import msgspec
import pytest
from engine_harness import (
    DRAFT_ALGORITHMS,
    EagerGraphs,
    debug_checks_fixture,
    engine_for,
    record_launches,
    request,
    run,
)
from model_fixtures import VOCAB

from outrider.daemon.config import ConfigError, ServeConfig
from outrider.daemon.engine import graphs as graphs_module
from outrider.daemon.engine.build import Engine
from outrider.daemon.engine.drafting_setup import speculative_plugin, step_widths
from outrider.daemon.engine.graph_settings import graph_settings
from outrider.daemon.engine.graphs import DecodeGraphs, GraphKey
from outrider.daemon.engine.memory_plan import (
    CAPTURE_WORKSPACE_BYTES,
    MIB,
    SMALL_SEGMENTS_BYTES,
    MemoryPlan,
    _activation_bytes,
    _fit_check,
    _graph_kv_limit,
    _graph_pool_estimate,
)
from outrider.daemon.engine.plan import StepPlan
from outrider.daemon.engine.results import MAX_LOGPROBS
from outrider.daemon.engine.step_memory import (
    DRAFT_BYTES_PER_LOGIT,
    StepWidth,
    batch_buckets,
    graph_pool_bytes,
    kv_buckets,
)
from outrider.daemon.internal import TokenizedRequest
from outrider.daemon.scheduler.drafting import AlternateDrafting
from outrider.daemon.scheduler.request import Request
from outrider.plugins.models.config import ModelConfig
from outrider.plugins.registry import ResolvedPlugins, discover

# The relay check poisons the scratch slot too; graphs are off under it (build.py).
debug_checks = debug_checks_fixture(relay_check=False)

ALGORITHMS: dict[str, dict[str, object]] = {
    "none": {},
    **{name: flags for name, flags in DRAFT_ALGORITHMS.items() if name != "standalone"},
}


def engine(speculative_dirs: dict[str, str], algorithm: str, **overrides: object) -> Engine:
    settings: dict[str, object] = dict(ALGORITHMS[algorithm])
    name = str(settings.get("speculative_algorithm", ""))
    if name in ("eagle3", "dflash"):
        settings["draft_model"] = speculative_dirs[name]
    return engine_for(speculative_dirs["target"], max_running=MAX_RUNNING, **settings, **overrides)


MAX_RUNNING = 12  # buckets 1 .. 8 and 12: batches of 9 to 11 rows are padded


def workload() -> list[TokenizedRequest]:
    """Nine greedy requests, then three sampled ones asking for logprobs, added one per loop
    turn so that decode batches of every size up to 12 occur."""
    prompts = [[3 + (11 * i + 5 * j) % (VOCAB - 3) for j in range(4 + 2 * i)] for i in range(12)]
    return [
        request(i, p, max_new_tokens=16 + i)
        if i < 9
        else request(i, p, max_new_tokens=14, temperature=0.8, top_p=0.9, seed=i, logprobs=3)
        for i, p in enumerate(prompts)
    ]


def outputs(engine: Engine) -> tuple[dict[int, list[int]], dict[int, list[float]]]:
    """Every request's tokens, and the logprobs (chosen and top) of those that asked."""
    outcomes = run(engine, workload(), stagger=1)
    tokens = {rid: o.token_ids for rid, o in outcomes.items()}
    logprobs = {
        rid: [x for lp in o.final.logprobs for x in (lp.logprob, *(v for _, v in lp.top))]
        for rid, o in outcomes.items()
        if o.final.logprobs
    }
    return tokens, logprobs


def assert_same_outputs(graphed: Engine, eager: Engine) -> None:
    """Tokens exactly; logprobs to float32 rounding (a padded batch or a wider KV bound sums
    in another order)."""
    graphed_tokens, graphed_logprobs = outputs(graphed)
    eager_tokens, eager_logprobs = outputs(eager)
    assert graphed_tokens == eager_tokens
    assert graphed_logprobs.keys() == eager_logprobs.keys() == {9, 10, 11}
    for rid, values in eager_logprobs.items():
        assert graphed_logprobs[rid] == pytest.approx(values, rel=1e-5, abs=1e-5)
    assert graphed.scheduler.counters() == eager.scheduler.counters()


def test_buckets_and_keys() -> None:
    assert batch_buckets(40) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40]
    assert batch_buckets(5) == [1, 2, 3, 4, 5]
    graphs = DecodeGraphs(12, 300, 20, 12)
    plan = StepPlan("decode", [0, 1, 2, 3, 4, 5, 6, 7, 8], [5] * 9, [4] * 9, [], [], [], [], [],
                    [], max_logprobs=2, all_greedy=False)  # fmt: skip
    assert graphs.key(plan, 70) == GraphKey(
        12, max_kv=128, all_greedy=False, max_logprobs=20, width=4, cuts=True
    )
    assert graphs.key(plan, 20) == GraphKey(
        12, max_kv=64, all_greedy=False, max_logprobs=20, width=4, cuts=True
    )
    assert graphs.key(plan, 290).max_kv == 300  # type: ignore[union-attr]  # the cap
    # Sampled rows that cut nothing take their own variant; greedy ones never sort.
    uncut = msgspec.structs.replace(plan, cuts=False)
    assert graphs.key(uncut, 70) == dataclasses.replace(graphs.key(plan, 70), cuts=False)  # type: ignore[arg-type]
    greedy = msgspec.structs.replace(plan, all_greedy=True)
    assert graphs.key(greedy, 70).cuts is False  # type: ignore[union-attr]
    padded = graphs.pad(uncut, GraphKey(12, 128, False, 20, width=4, cuts=True))
    assert padded.cuts  # the key's variant
    padded = graphs.pad(plan, GraphKey(12, 128, False, 20, width=4))
    assert padded.slots == [0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 12, 12] and not padded.cuts
    assert (padded.starts[9:], padded.q_lens[9:], padded.sample_rows) == (
        [0, 0, 0], [4, 4, 4], list(range(12)),
    )  # fmt: skip
    wide = StepPlan("decode", list(range(13)), [5] * 13, [4] * 13, [], [], [], [], [], [], 0, True)
    assert graphs.key(wide, 70) is None  # larger than the largest bucket: eager


def test_kv_buckets_follow_the_backends_declaration() -> None:
    assert kv_buckets(300, bounded=True) == [64, 128, 256, 300]
    assert kv_buckets(256, bounded=True) == [64, 128, 256]
    assert kv_buckets(40, bounded=True) == [40]
    assert kv_buckets(300, bounded=False) == [300]
    plan = StepPlan("decode", [0, 1, 2], [5] * 3, [1] * 3, [], [], [], [], [], [], 0, True)
    bounded = DecodeGraphs(12, 300, 20, 12, kv_bounded=True)
    unbounded = DecodeGraphs(12, 300, 20, 12, kv_bounded=False)
    assert [bounded.key(plan, kv).max_kv for kv in (1, 64, 65, 257, 300)] == [  # type: ignore[union-attr]
        64, 64, 128, 300, 300,
    ]  # fmt: skip
    assert {unbounded.key(plan, kv) for kv in (1, 65, 300)} == {GraphKey(3, 300, True, 0)}
    assert bounded.key(plan, 301) is None  # past every bucket: eager, never a short bound


def _with_kv_bound(plugins: ResolvedPlugins, declared: bool) -> ResolvedPlugins:
    """``plugins`` with every attention backend declaring ``graph_kv_bound=declared``."""
    attention = {}
    for phase, resolved in plugins.attention.items():
        assert resolved.spec.attention is not None
        caps = dataclasses.replace(resolved.spec.attention, graph_kv_bound=declared)
        spec = dataclasses.replace(resolved.spec, attention=caps)
        attention[phase] = dataclasses.replace(resolved, spec=spec)
    return dataclasses.replace(plugins, attention=attention)


def test_graph_settings_take_the_kv_bound_from_the_capabilities(llama_dir: str) -> None:
    config = ServeConfig(model=llama_dir, device="cuda", max_running=48, cuda_graph_max_bs=32)
    context = config.check_context("bfloat16", (9, 0))
    plugins = discover().resolve(context)
    torch_settings = graph_settings(config, plugins)
    assert torch_settings is not None  # the torch backend declares graph_kv_bound
    assert (torch_settings.max_bs, torch_settings.kv_bounded) == (32, True)
    lengths_on_device = graph_settings(config, _with_kv_bound(plugins, False))
    assert lengths_on_device is not None and not lengths_on_device.kv_bounded
    no_graphs = dataclasses.replace(config, disable_cuda_graph=True)
    on_cpu = dataclasses.replace(config, device="cpu")
    assert graph_settings(no_graphs, plugins) is None
    assert graph_settings(on_cpu, plugins) is None


@pytest.mark.parametrize(
    ("algorithm", "widths"),
    [
        ("eagle3 chain", [(4, 3), (3, 2), (2, 1)]),
        ("eagle3 tree", [(6, 3 * 2), (4, 3 * 2), (3, 3 * 2), (2, 3 * 2)]),
        ("dflash", [(4, 3), (3, 2), (2, 1)]),
        ("ngram", [(8, 0), (5, 0), (3, 0), (2, 0)]),
        ("none", []),
    ],
)
def test_step_widths_count_the_drafts_vocabulary_rows(
    speculative_dirs: dict[str, str], algorithm: str, widths: list[tuple[int, int]]
) -> None:
    """Every width a drafting step may take (the shape's own, then cut), with its drafting's
    vocabulary rows: a chain's or block's one per draft token, a tree's K at each of S steps
    whatever its nodes, n-gram's none (this module's algorithms: chains and blocks of 3 drafts,
    the tree 5 nodes of S 3, K 2, n-gram 7 drafts)."""
    settings: dict[str, object] = dict(ALGORITHMS[algorithm])
    name = str(settings.get("speculative_algorithm", ""))
    if name in ("eagle3", "dflash"):
        settings["draft_model"] = speculative_dirs[name]
    config = ServeConfig(model=speculative_dirs["target"], device="cuda", **settings)  # type: ignore[arg-type]
    plugins = discover().resolve(config.check_context("bfloat16", (9, 0)))
    draft_vocab = VOCAB
    if name == "eagle3":
        draft_config = json.loads((Path(speculative_dirs[name]) / "config.json").read_text())
        draft_vocab = draft_config["draft_vocab_size"]
    found = step_widths(plugins.shape, speculative_plugin(plugins), config, VOCAB)
    assert found == tuple(StepWidth(width, rows * draft_vocab) for width, rows in widths)


def test_an_eagle3_drafts_own_vocabulary_sizes_its_rows(
    speculative_dirs: dict[str, str], tmp_path: Path
) -> None:
    """An EAGLE-3 draft scoring a vocabulary of its own: the memory plan budgets its rows at
    that width, not the target's (a quarter of the target's here)."""
    config_json = json.loads((Path(speculative_dirs["eagle3"]) / "config.json").read_text())
    config_json["draft_vocab_size"] = VOCAB // 4
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    settings: dict[str, object] = dict(ALGORITHMS["eagle3 chain"], draft_model=str(tmp_path))
    config = ServeConfig(model=speculative_dirs["target"], device="cuda", **settings)  # type: ignore[arg-type]
    plugins = discover().resolve(config.check_context("bfloat16", (9, 0)))
    found = step_widths(plugins.shape, speculative_plugin(plugins), config, VOCAB)
    assert found[0] == StepWidth(4, 3 * (VOCAB // 4))


def test_start_keys_are_every_bucket_largest_first() -> None:
    graphs = DecodeGraphs(3, 200, 20, 3)
    keys = [(k.bs, k.max_kv, k.all_greedy, k.max_logprobs) for k in graphs.start_keys()]
    assert keys == [
        (bs, kv, greedy, 0) for kv in (200, 128, 64) for bs in (3, 2, 1) for greedy in (False, True)
    ]
    assert [k.max_kv for k in DecodeGraphs(2, 200, 20, 2, kv_bounded=False).start_keys()] == [
        200, 200, 200, 200,
    ]  # fmt: skip


def graph_plan(estimate: int, headroom: int = 0) -> MemoryPlan:
    """A plan whose graph pool estimate and headroom are given; nothing else is read."""
    return MemoryPlan(
        page_size=16, pool_tokens=0, num_pages=1, requested_context_length=0, context_length=0,
        reservation=0, max_pages=0, max_step_tokens=0, graph_max_bs=0, graph_max_kv=0,
        graph_estimate=estimate, drafting_rows=(), activation_bytes=0, headroom_bytes=headroom,
    )  # fmt: skip


@pytest.mark.parametrize(("headroom", "level"), [(0, logging.WARNING), (MIB, logging.DEBUG)])
def test_capture_all_logs_one_line_per_set_and_warns_only_past_the_headroom(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, headroom: int, level: int
) -> None:
    """A pool past the estimate is a warning only where the plan's headroom does not cover
    the excess either; otherwise the estimate's error, at debug level."""
    graphs = DecodeGraphs(2, 100, 20, 2)
    graphs.graphs[GraphKey(1, 64, True, 0)] = (None, None)  # type: ignore[assignment]  # captured
    reserved = iter([10 * MIB, 13 * MIB])
    monkeypatch.setattr(graphs_module, "reserved_after_release", lambda: next(reserved))
    captured: list[GraphKey] = []
    progress: list[tuple[int, int]] = []
    caplog.set_level(logging.DEBUG, logger="outrider.graphs")
    result = graphs.capture_all(
        captured.append, graph_plan(2 * MIB, headroom), lambda d, t: progress.append((d, t))
    )
    expected = [k for k in graphs.start_keys() if k != GraphKey(1, 64, True, 0)]
    assert captured == result.keys == expected and len(expected) == 7
    assert progress == [(i, 7) for i in range(1, 8)]
    assert result.pool_bytes == 3 * MIB and graphs.started
    [info, excess] = caplog.records
    assert info.getMessage().startswith(
        "captured 7 decode graphs (batch 1..2, width 1, KV bound 64..100, greedy + sampled) in "
    )
    assert "pool 3 MiB (estimate 2 MiB)" in info.getMessage()
    assert excess.levelno == level
    if level == logging.WARNING:
        assert excess.getMessage() == (
            "the CUDA graph pool (3 MiB) passes its estimate (2 MiB) by 1 MiB more than the "
            "device memory left beside the KV pool: lower --gpu-memory-fraction or "
            "--cuda-graph-max-bs if serving runs out of device memory"
        )
    else:
        assert excess.getMessage() == (
            "graph pool estimate off by +50.0% (3 MiB captured, 2 MiB estimated), within the "
            "1 MiB left beside the KV pool"
        )


TINY_SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
}


def test_graph_pool_estimate_of_a_tiny_model() -> None:
    model = ModelConfig.from_dict(TINY_SHAPE)
    # 4 tokens x (2 B x (3 x 64 hidden + 2 x 64 q + 2 x 32 kv) + 4 B x 64 + 2 B x 3 x 128)
    layer = 4 * (2 * (192 + 128 + 64) + 256 + 768)
    # The head's output, its float32 copy, the sampling scratch and the adjusted copy.
    logits = 4 * 256 * (2 + 4 + 44)
    # 4 rows x 128 KV x (K and V at 2 + 4 heads of 16, 2 B, + the int64 index) + the mask
    attention = 4 * 128 * (2 * (32 + 64) * 2 + 8) + 4 * 1 * 128
    assert (layer, logits, attention) == (7168, 51200, 201216)
    assert graph_pool_bytes(model, 2, bs=4, width=1, kv_bound=128) == layer + logits + attention
    assert graph_pool_bytes(model, 2, bs=4, width=1, kv_bound=None) == layer + logits
    # A speculative row verifies `width` tokens: everything but the gathered K/V scales.
    assert graph_pool_bytes(model, 2, bs=1, width=4, kv_bound=None) == layer + logits
    # A drafting step's vocabulary rows: 3 a row, 256 logits each.
    draft = 1 * 3 * 256 * DRAFT_BYTES_PER_LOGIT
    assert graph_pool_bytes(model, 2, 1, 4, None, draft_logits=3 * 256) == layer + logits + draft
    # The fit check budgets the largest graphed step and the captures' workspace.
    budgeted = _graph_pool_estimate([(4, StepWidth(1)), (1, StepWidth(4))], model, 2, 128, 1)
    assert budgeted == layer + logits + attention + CAPTURE_WORKSPACE_BYTES + SMALL_SEGMENTS_BYTES
    assert _graph_pool_estimate([], model, 2, 128, 1) == 0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_padded_replays_give_the_eager_tokens(
    speculative_dirs: dict[str, str], algorithm: str
) -> None:
    eager = engine(speculative_dirs, algorithm)
    graphed = engine(speculative_dirs, algorithm)
    runner = graphed.loop.runner
    graphs = EagerGraphs(MAX_RUNNING, 256, 20, runner.slots.scratch_slot)
    runner.graphs = graphs
    assert_same_outputs(graphed, eager)
    assert graphs.padded_rows > 0 and len(graphs.runs) >= 3
    assert {key.all_greedy for key in graphs.runs} == {True, False}


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_cuda_graphs_give_the_eager_tokens(
    speculative_dirs: dict[str, str], algorithm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32 on CUDA, every launch under the sync check: graphs on (the default) against
    --disable-cuda-graph."""
    monkeypatch.setenv("OUTRIDER_DEBUG_SYNC_CHECK", "1")
    graphed = engine(speculative_dirs, algorithm, device="cuda")
    assert graphed.loop.runner.graphs is not None
    eager = engine(speculative_dirs, algorithm, device="cuda", disable_cuda_graph=True)
    assert eager.loop.runner.graphs is None
    assert_same_outputs(graphed, eager)
    assert len(graphed.loop.runner.graphs.graphs) >= 3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("algorithm", ["dflash", "eagle3 chain"])
def test_graphs_of_requests_not_feeding_the_draft_give_the_eager_tokens(
    speculative_dirs: dict[str, str], algorithm: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the first four requests feed the draft, and batches with a fed row draft every
    other time: once they end, batches of unfed rows alone replay the target's own plain
    graph; mixed ones replay the plain and drafting graphs; the tokens are the eager
    engine's (on the CPU through the runner's capture path, replayed eagerly)."""
    monkeypatch.setenv("OUTRIDER_DEBUG_SYNC_CHECK", "1")
    graphed = engine(speculative_dirs, algorithm, device=device)
    eager = engine(speculative_dirs, algorithm, device=device, disable_cuda_graph=True)
    runner = graphed.loop.runner
    if device == "cpu":
        widths = (runner.shape.width, 1)
        runner.graphs = EagerGraphs(MAX_RUNNING, 256, 20, runner.slots.scratch_slot, widths=widths)
    for built in (graphed, eager):
        built.scheduler.use_policy(FeedingBelow(4, runner.shape.width))
    assert_same_outputs(graphed, eager)
    graphs = runner.graphs
    assert graphs is not None
    assert {key.fed for key in graphs.graphs if key.width == 1} == {True, False}
    assert all(key.fed for key in graphs.graphs if key.width > 1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("algorithm", ["eagle3 chain", "ngram", "dflash", "eagle3 tree"])
def test_graphs_of_a_step_cut_short_give_the_eager_tokens(
    speculative_dirs: dict[str, str], algorithm: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafting batches take the shape at each size in turn (a chain's depths, a tree's best
    nodes; plain steps between): each width replays its own graph; the tokens and counters
    are the eager engine's (on the CPU through the runner's capture path, replayed
    eagerly)."""
    monkeypatch.setenv("OUTRIDER_DEBUG_SYNC_CHECK", "1")
    graphed = engine(speculative_dirs, algorithm, device=device)
    eager = engine(speculative_dirs, algorithm, device=device, disable_cuda_graph=True)
    runner = graphed.loop.runner
    widths = tuple(chain.width for chain in runner.shape.cuts())
    assert len(widths) > 2
    if device == "cpu":
        runner.graphs = EagerGraphs(
            MAX_RUNNING, 256, 20, runner.slots.scratch_slot, widths=(*widths, 1)
        )
    for built in (graphed, eager):
        built.scheduler.use_policy(AlternateDrafting(widths))
    assert_same_outputs(graphed, eager)
    assert runner.graphs is not None
    assert {key.width for key in runner.graphs.graphs} == {*widths, 1}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("algorithm", ["eagle3 chain", "dflash"])
def test_graphs_beside_rows_riding_prompt_batches_give_the_eager_tokens(
    speculative_dirs: dict[str, str], algorithm: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --mixed-batches and prompts in chunks of 16, decoding rows ride prompt batches
    between graphed plain and drafting steps (their buffered positions caught up first, from
    catch-up graphs where they fit): the tokens and counters are the eager engine's."""
    monkeypatch.setenv("OUTRIDER_DEBUG_SYNC_CHECK", "1")
    settings: dict[str, object] = {
        "device": device, "mixed_batches": True, "chunked_prefill_tokens": 16, "page_size": 4,
    }  # fmt: skip
    graphed = engine(speculative_dirs, algorithm, **settings)
    eager = engine(speculative_dirs, algorithm, disable_cuda_graph=True, **settings)
    runner = graphed.loop.runner
    if device == "cpu":
        widths = (runner.shape.width, 1)
        runner.graphs = EagerGraphs(MAX_RUNNING, 256, 20, runner.slots.scratch_slot, widths=widths)
    for built in (graphed, eager):
        built.scheduler.use_policy(AlternateDrafting((runner.shape.width,)))
    plans = record_launches(runner)
    assert_same_outputs(graphed, eager)
    assert sum(len(plan.relay_rows) for plan in plans) >= 10
    assert runner.graphs is not None
    assert {key.width for key in runner.graphs.graphs} == {runner.shape.width, 1}


class FeedingBelow:
    """Requests below rid ``end`` feed the draft; a batch with a fed row drafts every other
    time, one without never."""

    def __init__(self, end: int, width: int) -> None:
        self.end, self.full, self.batches = end, width, 0

    def width(self, rows: list[Request]) -> int:
        if all(req.fed is False for req in rows):
            return 1
        self.batches += 1
        return self.full if self.batches % 2 == 0 else 1

    def feeds(self, req: Request, others: int) -> bool:
        return req.rid < self.end

    def observe(
        self, req: Request, commit_len: int, drafts: int, ranks: list[int], rows: int
    ) -> None:
        pass


def test_graphs_growing_with_the_kv_bound_stop_where_their_pool_passes_its_share(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = ModelConfig.from_dict(TINY_SHAPE)
    # Plain steps and drafting steps of 2 drafts (3 tokens, 2 x 256 draft logits), 2 rows
    # each: the drafting step the larger at every bound.
    steps = [(2, StepWidth(1)), (2, StepWidth(3, 2 * 256))]

    def pool(kv: int) -> int:
        return graph_pool_bytes(model, 2, bs=2, width=3, kv_bound=kv, draft_logits=2 * 256)

    assert all(pool(kv) > graph_pool_bytes(model, 2, 2, 1, kv) for kv in (64, 256, 600))
    # Exactly the pool of the 256 bucket: 256 is the last that fits, 512 and 600 do not.
    caplog.set_level(logging.INFO, logger="outrider.engine")
    assert _graph_kv_limit(steps, model, 2, 600, pool(256)) == 256
    assert "decode graphs cover KV bounds up to 256 of 600" in caplog.text
    assert _graph_kv_limit(steps, model, 2, 600, pool(256) - 1) == 128
    assert _graph_kv_limit(steps, model, 2, 600, pool(600)) == 600
    assert _graph_kv_limit(steps, model, 2, 600, 0) == 64  # the smallest bucket at least


def test_the_fit_check_budgets_the_graph_pool_and_names_its_flags() -> None:
    model = ModelConfig.from_dict(TINY_SHAPE)
    config = ServeConfig(model="tiny", device="cuda", max_running=2, page_size=16)
    eager = 512 * MIB + 2 * 256 * 16  # the rough allowance: logits and sampling per row
    plain = [(2, StepWidth(1))]
    assert _activation_bytes(config, model, 2, plain, 1, 0) == eager
    # The eager share covers the run before each capture: at least the largest graphed step.
    assert _activation_bytes(config, model, 2, plain, 1, MIB) == eager + MIB
    assert _activation_bytes(config, model, 2, plain, 1, 1024 * MIB) == 2 * 1024 * MIB
    # A drafting step past the graphs, at its most rows, where it passes the allowance.
    wide = StepWidth(16, 15 * 10**6)
    drafting = graph_pool_bytes(model, 2, 2, 16, None, draft_logits=wide.draft_logits)
    assert drafting > eager
    assert _activation_bytes(config, model, 2, [*plain, (2, wide)], 1, MIB) == drafting + MIB
    with pytest.raises(ConfigError, match=r"--cuda-graph-max-bs .*--disable-cuda-graph"):
        _fit_check(config, 16, 128, 16, graph_estimate=700 * MIB)
    with pytest.raises(ConfigError) as eager_only:
        _fit_check(config, 16, 128, 16, graph_estimate=0)
    assert "graph" not in str(eager_only.value)


def serve_batches_of_3_and_5(engine: Engine, top_p: float = 0.9) -> None:
    """A greedy batch of 3, then a sampled batch of 5 (no logprobs; top-p 1 cuts nothing)."""
    prompts = [[3 + (7 * i + 2 * j) % (VOCAB - 3) for j in range(5 + i)] for i in range(8)]
    run(engine, [request(i, prompts[i], max_new_tokens=6) for i in range(3)])
    sampled = [
        request(i, prompts[i], max_new_tokens=6, temperature=0.8, top_p=top_p, seed=i)
        for i in range(3, 8)
    ]
    run(engine, sampled)


@pytest.mark.parametrize("algorithm", ["none", "eagle3 chain"])
def test_start_captures_cover_the_served_batches(
    speculative_dirs: dict[str, str], algorithm: str
) -> None:
    """With every start key captured, batches of 3 and 5 capture nothing new (on CPU, eager
    "graphs" through the runner's own capture path); where the sampled graphs captured at
    start cut nothing, the sampled batch (top-p 0.9) captures its cutting variant on first
    use, and nothing else."""
    for sampled_cuts in (True, False):
        graphed = engine(speculative_dirs, algorithm)
        runner = graphed.loop.runner
        widths = (runner.shape.width,)  # the engine drafts every decode batch (engine_for)
        graphs = EagerGraphs(
            MAX_RUNNING, 272, 20, runner.slots.scratch_slot, widths=widths,
            sampled_cuts=sampled_cuts,
        )  # fmt: skip
        runner.graphs = graphs
        graphs.capture_all(partial(runner.graph_steps.capture, graphs=graphs), graph_plan(0))
        start = graphs.start_keys()
        assert list(graphs.runs) == start
        assert len(graphs.runs) == 9 * 4 * 2  # buckets 1 .. 8, 12 x KV 64, 128, 256, 272 x 2
        assert {k.cuts for k in start if not k.all_greedy} == {sampled_cuts}
        serve_batches_of_3_and_5(graphed)
        new = [key for key in graphs.runs if key not in start]
        assert graphs.replays >= 5  # every decode batch replayed
        if sampled_cuts:
            assert new == []
        else:
            assert new and all(k.cuts and not k.all_greedy for k in new)


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["none", "eagle3 chain"])
def test_cuda_graphs_are_captured_before_ready(
    speculative_dirs: dict[str, str], algorithm: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A CUDA engine holds every start key when built (the warm-up adds the logprob variants
    of its batches of 1 and 2, which cut by top-p and top-k) within the pool the fit check
    budgeted; serving batches of 3 and 5 as the test models' defaults sample (no cut) captures
    nothing new, and a sampled batch that cuts captures its own variant on first use."""
    with caplog.at_level(logging.INFO, logger="outrider.graphs"):
        graphed = engine(speculative_dirs, algorithm, device="cuda")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    graphs = graphed.loop.runner.graphs
    assert graphs is not None and graphs.started
    reservation = 16  # one page: the widest step's span plus one commit
    assert graphs.kv_buckets == [64, 128, 256, graphed.context_length + reservation]
    at_ready = set(graphs.graphs)
    assert set(graphs.start_keys()) <= at_ready
    assert not graphs.sampled_cuts  # the test models have no generation config
    lazy = {k for k in at_ready if k.max_logprobs}
    assert lazy and lazy <= {
        GraphKey(bs, 64, False, MAX_LOGPROBS, width, cuts=True)
        for bs in (1, 2)
        for width in graphs.widths
    }
    serve_batches_of_3_and_5(graphed, top_p=1.0)
    assert set(graphs.graphs) == at_ready
    serve_batches_of_3_and_5(graphed)
    new = set(graphs.graphs) - at_ready
    assert new and all(k.cuts and not k.all_greedy for k in new)
