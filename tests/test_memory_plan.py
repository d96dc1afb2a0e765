"""The start-up memory plan (daemon/engine/memory_plan.py) on representative inputs: the sizes
are worked out here from the flags and the model's shape, not read back from the plan."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
from conftest import CONFIGS

from outrider.daemon.config import ConfigError, ServeConfig
from outrider.daemon.engine.memory_plan import (
    CAPTURE_WORKSPACE_BYTES,
    MIB,
    SMALL_SEGMENTS_BYTES,
    GraphSettings,
    MemoryRefusal,
    PlanInputs,
    graph_pool_shortfall,
    plan_memory,
)
from outrider.daemon.engine.step_memory import DRAFT_BYTES_PER_LOGIT, StepWidth, graph_pool_bytes
from outrider.plugins.models.config import ModelConfig

GIB = 2**30


def _model(**shape: int) -> ModelConfig:
    return ModelConfig.from_dict(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5}
        | {
            "hidden_size": shape["hidden"],
            "intermediate_size": shape["intermediate"],
            "num_attention_heads": shape["q_heads"],
            "num_key_value_heads": shape["kv_heads"],
            "head_dim": shape["head_dim"],
            "num_hidden_layers": shape["layers"],
            "vocab_size": shape["vocab"],
            "max_position_embeddings": shape["context"],
        }
    )


TINY = _model(
    hidden=64, intermediate=128, q_heads=4, kv_heads=2, head_dim=16, layers=2, vocab=256,
    context=128,
)  # fmt: skip
# Llama-3.1-8B's shape.
LLAMA = _model(
    hidden=4096, intermediate=14336, q_heads=32, kv_heads=8, head_dim=128, layers=32,
    vocab=128256, context=131072,
)  # fmt: skip
TINY_KV_FLOAT32 = 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 heads x 16 x 4 B
LLAMA_KV_BF16 = 2 * 32 * 8 * 128 * 2  # 128 KiB


def _inputs(
    config: ServeConfig,
    model: ModelConfig = LLAMA,
    *,
    free: int,
    graphs: GraphSettings | None = None,
    reservation: int = 16,
    widths: tuple[StepWidth, ...] = (),
) -> PlanInputs:
    cpu = config.device == "cpu"
    return PlanInputs(
        config=config,
        model=model,
        itemsize=4 if cpu else 2,
        kv_bytes_per_token=TINY_KV_FLOAT32 if model is TINY else LLAMA_KV_BF16,
        tensor_parallel_size=1,
        context_length=config.context_length or model.max_position_embeddings,
        reservation=reservation,
        widths=widths,
        graphs=graphs,
        free_bytes=free,
    )


def test_a_cpu_pool_holds_a_few_contexts() -> None:
    """CPU: four requests at the full context (the model's 128 plus a page of reservation),
    fewer where ``max_running`` is lower, whole pages of a quarter of the host's memory at
    most."""
    config = ServeConfig(model="tiny", device="cpu", max_running=2, page_size=16)
    plan = plan_memory(_inputs(config, TINY, free=64 * GIB))
    assert (plan.pool_tokens, plan.num_pages) == (2 * 144, 2 * 144 // 16 + 1)
    assert (plan.context_length, plan.max_pages, plan.max_positions) == (128, 9, 144)
    assert (plan.graph_estimate, plan.activation_bytes, plan.graph_max_bs) == (0, 0, 0)
    many = dataclasses.replace(config, max_running=64)
    assert plan_memory(_inputs(many, TINY, free=64 * GIB)).pool_tokens == 4 * 144
    # A host of 400 KiB: a quarter is 200 tokens of 512 B, 192 in whole pages.
    small = plan_memory(_inputs(many, TINY, free=400 * 1024))
    assert (small.pool_tokens, small.context_length) == (192, 128)


def test_a_gpu_pool_takes_its_fraction_of_the_free_memory() -> None:
    """CUDA without graphs: the fraction of the free memory, less the eager steps' allowance
    (512 MiB, and 16 B per logit of every running row), in whole pages."""
    config = ServeConfig(model="llama", device="cuda", gpu_memory_fraction=0.5, context_length=8192)
    plan = plan_memory(_inputs(config, free=10 * GIB))
    eager = 512 * MIB + 64 * 128256 * 16
    assert plan.activation_bytes == eager
    assert plan.pool_tokens == (5 * GIB - eager) // LLAMA_KV_BF16 // 16 * 16 == 35856
    assert (plan.num_pages, plan.context_length, plan.context_lowered) == (2242, 8192, False)
    assert (plan.max_pages, plan.max_step_tokens) == (8208 // 16, config.chunked_prefill_tokens)


def test_window_pages_take_their_pool_first_and_the_page_pool_the_other_layers() -> None:
    """Window pages on the 8B shape with half its layers sliding (a window of 128): the
    window pool (64 requests' windows plus two steps' tokens and a reservation each, in pages
    of 16) comes off the budget first; the page pool then holds the full layers' K/V alone:
    here 1.57x the tokens of the pool without window pages (toward 2x as the budget grows
    past the window pool's 1 GiB)."""
    config = ServeConfig(model="llama", device="cuda", gpu_memory_fraction=0.5, context_length=8192)
    half = LLAMA_KV_BF16 // 2
    plain = plan_memory(_inputs(config, free=10 * GIB))
    inputs = dataclasses.replace(
        _inputs(config, free=10 * GIB), kv_bytes_per_token=half, window_bytes_per_token=half,
        window=128,
    )  # fmt: skip
    plan = plan_memory(inputs)
    # Per request ceil(127 / 16) + 2 = 10 pages; 2 x 2,048 tokens + 64 x 16 over 16: 320.
    assert plan.window_pages == 1 + 64 * 10 + 320 == 961
    assert (plan.window, plain.window) == (128, 0)
    eager = 512 * MIB + 64 * 128256 * 16
    window_bytes = 961 * 16 * half
    assert plan.pool_tokens == (5 * GIB - eager - window_bytes) // half // 16 * 16 == 56336
    assert plain.pool_tokens == 35856
    assert plan.headroom_bytes == 10 * GIB - 56336 * half - window_bytes - eager


def test_a_mixture_of_experts_keeps_its_grouped_path_out_of_the_pool() -> None:
    """Qwen3-30B-A3B (H 2048, 8 of 128 experts of 768 rows): an EXTEND chunk of 2,048 tokens
    routes 16,384 pairs, the grouped path's whole chunk; each holds its down product in
    float32, its intermediate row in bf16 and in e4m3, and 16 bytes of bookkeeping. Two
    ranks halve the rows."""
    moe = ModelConfig.from_dict(json.loads((CONFIGS / "Qwen3-30B-A3B.config.json").read_text()))
    config = ServeConfig(model="qwen3-moe", device="cuda", context_length=4096)
    assert config.chunked_prefill_tokens == 2048 and config.max_running == 64
    eager = 512 * MIB + 64 * 151936 * 16
    plan = plan_memory(_inputs(config, moe, free=40 * GIB))
    assert plan.activation_bytes == eager + 16384 * (4 * 2048 + 3 * 768 + 16)
    two_ranks = dataclasses.replace(_inputs(config, moe, free=40 * GIB), tensor_parallel_size=2)
    assert plan_memory(two_ranks).activation_bytes == eager + 16384 * (4 * 2048 + 3 * 384 + 16)


def test_the_gpu_pool_stops_at_max_running_full_contexts() -> None:
    config = ServeConfig(model="llama", device="cuda", max_running=2, context_length=1000)
    plan = plan_memory(_inputs(config, free=80 * GIB))
    assert plan.pool_tokens == 2 * 1024  # 1000 + 16 in whole pages, twice


def test_kv_cache_tokens_sets_the_pool_in_whole_pages() -> None:
    config = ServeConfig(model="llama", device="cuda", kv_cache_tokens=10_010, context_length=4096)
    plan = plan_memory(_inputs(config, free=0))  # the free memory plays no part
    assert (plan.pool_tokens, plan.num_pages, plan.context_length) == (10_000, 626, 4096)


def test_a_context_the_pool_cannot_hold_is_lowered_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The model's 131072 positions do not fit in 35856 tokens: the context served is the
    pool less one step's reservation, and the start-up log says so."""
    config = ServeConfig(model="llama", device="cuda", gpu_memory_fraction=0.5)
    with caplog.at_level(logging.WARNING, logger="outrider.engine"):
        plan = plan_memory(_inputs(config, free=10 * GIB))
    assert plan.pool_tokens == 35856
    assert (plan.requested_context_length, plan.context_length) == (131072, 35840)
    assert plan.context_lowered and plan.max_pages == 35856 // 16
    assert caplog.messages == [
        "KV pool of 35856 tokens: context length lowered from 131072 to 35840"
    ]


def test_an_explicit_context_the_pool_cannot_hold_is_refused() -> None:
    config = ServeConfig(
        model="llama", device="cuda", gpu_memory_fraction=0.5, context_length=131072
    )
    with pytest.raises(MemoryRefusal) as refused:
        plan_memory(_inputs(config, free=10 * GIB))
    assert isinstance(refused.value, ConfigError)  # the CLI's configuration exit
    assert str(refused.value) == (
        "the KV pool holds 35856 tokens, fewer than --context-length 131072 plus 16: raise "
        "--kv-cache-tokens or --gpu-memory-fraction, or lower --context-length"
    )
    # With graphs, the refusal names their flags and the pool they take.
    graphs = GraphSettings(max_bs=64, kv_bounded=False)
    with pytest.raises(MemoryRefusal, match=r"about \d+ MiB, .*--disable-cuda-graph$"):
        plan_memory(_inputs(config, free=10 * GIB, graphs=graphs))


def test_a_pool_under_two_pages_past_the_reservation_is_refused() -> None:
    config = ServeConfig(model="llama", device="cuda", kv_cache_tokens=40)
    with pytest.raises(MemoryRefusal, match="holds 32 tokens, fewer than --context-length"):
        plan_memory(_inputs(config, free=80 * GIB))


def test_the_graph_pool_is_budgeted_before_the_kv_pool() -> None:
    """Graphs whose work does not grow with the KV bound: the estimate is the widest step
    plus both streams' cuBLAS workspaces and the small-block segments; the KV pool leaves out
    the estimate and the eager steps' share, at least the estimate (the run before each
    capture)."""
    config = ServeConfig(model="llama", device="cuda", context_length=8192)
    eager = 512 * MIB + 64 * 128256 * 16
    for width in (1, 4):  # the widest step under, then over, the eager allowance
        graphs = GraphSettings(max_bs=64, kv_bounded=False)
        widths = (StepWidth(width),) if width > 1 else ()
        plan = plan_memory(_inputs(config, free=60 * GIB, graphs=graphs, widths=widths))
        step = graph_pool_bytes(LLAMA, 2, bs=64, width=width, kv_bound=None)
        estimate = step + 64 * MIB + 16 * MIB
        assert plan.graph_estimate == estimate
        assert plan.activation_bytes == max(eager, estimate) + estimate
        assert (estimate > eager) == (width == 4)
        budget = int(60 * GIB * 0.85) - plan.activation_bytes
        assert plan.pool_tokens == budget // LLAMA_KV_BF16 // 16 * 16
        assert (plan.graph_max_bs, plan.graph_max_kv) == (64, 8208)
        assert plan.drafting_rows == ((width, 64),) * (width > 1)
    assert CAPTURE_WORKSPACE_BYTES + SMALL_SEGMENTS_BYTES == 80 * MIB


def test_a_graph_pool_past_its_estimate_falls_short_only_past_the_headroom() -> None:
    """The headroom is the free memory neither the KV pool nor the activation share takes
    (the 15% --gpu-memory-fraction leaves, here); a captured pool past the estimate is a
    shortfall the user must act on only once it passes that too."""
    config = ServeConfig(model="llama", device="cuda", context_length=8192)
    graphs = GraphSettings(max_bs=64, kv_bounded=False)
    plan = plan_memory(_inputs(config, free=60 * GIB, graphs=graphs))
    pool_bytes = plan.pool_tokens * LLAMA_KV_BF16
    assert plan.headroom_bytes == 60 * GIB - pool_bytes - plan.activation_bytes
    assert int(60 * GIB * 0.15) <= plan.headroom_bytes < int(60 * GIB * 0.15) + 16 * LLAMA_KV_BF16
    assert graph_pool_shortfall(plan, plan.graph_estimate) == 0
    assert graph_pool_shortfall(plan, plan.graph_estimate + plan.headroom_bytes) == 0
    assert graph_pool_shortfall(plan, plan.graph_estimate + plan.headroom_bytes + MIB) == MIB
    # An explicit pool may leave nothing beside it; on CPU there is no device to fall short.
    full = dataclasses.replace(config, kv_cache_tokens=10**6)
    assert plan_memory(_inputs(full, free=60 * GIB, graphs=graphs)).headroom_bytes == 0
    cpu = ServeConfig(model="tiny", device="cpu")
    assert plan_memory(_inputs(cpu, TINY, free=64 * GIB)).headroom_bytes == 0


def test_a_drafts_vocabulary_rows_take_their_share_of_the_graph_pool() -> None:
    """A speculative engine of width 4 whose drafting step scores 3 vocabulary rows a batch
    row: 52 B a logit of them join the estimate, and the KV pool gives up twice as much."""
    config = ServeConfig(model="llama", device="cuda", context_length=8192)
    graphs = GraphSettings(max_bs=64, kv_bounded=False)
    without = plan_memory(_inputs(config, free=60 * GIB, graphs=graphs, widths=(StepWidth(4),)))
    drafting = (StepWidth(4, 3 * 128256),)
    drafted = plan_memory(_inputs(config, free=60 * GIB, graphs=graphs, widths=drafting))
    share = 64 * 3 * 128256 * DRAFT_BYTES_PER_LOGIT
    assert drafted.graph_estimate - without.graph_estimate == share
    assert drafted.activation_bytes - without.activation_bytes == 2 * share
    assert drafted.pool_tokens < without.pool_tokens
    assert drafted.max_step_tokens == max(config.chunked_prefill_tokens, 64 * 4)


def test_ranks_agree_on_the_smallest_graph_bound_then_the_smallest_pool() -> None:
    """Each rank plans from its own free memory; ``agree`` (every rank's minimum) is asked
    for the graphs' KV bound first, then the pool, and the plan takes the agreed values."""
    config = ServeConfig(model="llama", device="cuda", context_length=8192)
    graphs = GraphSettings(max_bs=64, kv_bounded=True)
    asked: list[int] = []
    other_rank = iter([1024, 20_000])  # the other rank's graph bound, then its pool

    def agree(value: int) -> int:
        asked.append(value)
        return min(value, next(other_rank))

    plan = plan_memory(_inputs(config, free=80 * GIB, graphs=graphs), agree)
    # This rank's own: the largest KV bucket whose 64 rows' step fits in 1/8 of 80 GiB, then
    # a pool (with the agreed bound's estimate) capped at 64 requests of 8192 + 16.
    fits = [graph_pool_bytes(LLAMA, 2, 64, 1, kv) <= 10 * GIB for kv in (4096, 8192)]
    assert fits == [True, False]
    assert asked == [4096, 64 * 8208]
    assert (plan.graph_max_kv, plan.pool_tokens, plan.num_pages) == (1024, 20_000, 1251)
    # The estimate is the agreed bound's.
    kv_step = graph_pool_bytes(LLAMA, 2, bs=64, width=1, kv_bound=1024)
    assert plan.graph_estimate == kv_step + CAPTURE_WORKSPACE_BYTES + SMALL_SEGMENTS_BYTES
    # Without graphs that grow with the bound, only the pool is agreed.
    asked.clear()
    other_rank = iter([20_000])
    plan_memory(_inputs(config, free=80 * GIB), agree)
    assert asked == [plan_memory(_inputs(config, free=80 * GIB)).pool_tokens]


def test_the_graph_bound_stops_at_the_context_served() -> None:
    """Graphs are built with the KV bound the estimate was made for, or the lowered context
    plus the reservation where that is smaller."""
    config = ServeConfig(model="llama", device="cuda", kv_cache_tokens=4096)
    graphs = GraphSettings(max_bs=8, kv_bounded=False)
    plan = plan_memory(_inputs(config, free=80 * GIB, graphs=graphs))
    assert (plan.context_length, plan.graph_max_kv) == (4080, 4096)
    step = graph_pool_bytes(LLAMA, 2, bs=8, width=1, kv_bound=None)
    assert plan.graph_estimate == step + CAPTURE_WORKSPACE_BYTES + SMALL_SEGMENTS_BYTES
