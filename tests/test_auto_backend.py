"""The ``auto`` attention backend: its check of the two backends it routes, its route by batch
size (Triton's interpreter on CPU, compiled kernels on a GPU), and the engine decoding through
it on a GPU within the numeric rule of the split-KV backend alone."""

from __future__ import annotations

import dataclasses
import importlib.util

import msgspec
import pytest
import torch
from engine_harness import engine_for, request, run
from numeric_rule import MAX_DIFF, assert_within_rule
from test_attention_graphs import KINDS, make_batch, paged_rows, qkv
from test_triton_backend import DEVICE, SHAPE

from outrider.daemon.family import embedded_family
from outrider.plugins.api import (
    PHASES,
    AttentionCapabilities,
    CheckContext,
    Phase,
    PluginSpec,
)
from outrider.plugins.attention.auto_backend import SPEC, AutoOptions
from outrider.plugins.attention.auto_impl import AutoAttention
from outrider.plugins.device import ForwardBatch
from outrider.plugins.registry import discover
from outrider.protocol.messages import TokenLogprob

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed"
)
OPTION = "--attention-config auto"
ROUTES: dict[Phase, str] = {**dict.fromkeys(PHASES, "triton"), "decode": "auto"}


def _ctx(auto: str = "", **changes: object) -> CheckContext:
    ctx = CheckContext(
        device="cuda",
        dtype="bfloat16",
        page_size=16,
        overlap=True,
        attention_routes=ROUTES,
        speculative_algorithm="none",
        cuda_capability=(9, 0),
        attention_config={"auto": auto} if auto else {},
    )
    return dataclasses.replace(ctx, **changes)  # type: ignore[arg-type]


def _problems(auto: str, **changes: object) -> list[str]:
    return [str(p) for p in SPEC.check(SPEC, _ctx(auto, **changes))]


def test_auto_declares_the_decode_side_phases_on_cuda_and_defaults_to_fa4_between_triton() -> None:
    assert discover().get("attention", "auto") is SPEC
    caps = SPEC.attention
    assert caps is not None
    assert caps.phases == {"decode", "verify", "draft_decode", "draft_extend"}
    assert caps.devices == {"cuda"} and caps.tree_mask and caps.non_causal
    assert (caps.cuda_graphs, caps.graph_kv_bound, caps.host_plans) == (True, False, False)
    assert SPEC.parse_options(None) == AutoOptions("triton", "fa4", 8, 64)


@needs_triton
def test_auto_checks_the_backends_it_routes() -> None:
    assert _problems('{"small": "triton", "large": "triton"}') == []
    kv_bound, host_plans = (
        f"{OPTION}: large: {name} cannot be routed by auto, which takes backends that read every "
        "length on the device (no host plans, one CUDA graph per batch size)"
        for name in ("torch", "flashinfer")
    )
    assert _problems('{"large": "torch"}') == [kv_bound]
    assert _problems('{"large": "flashinfer"}') == [host_plans]
    assert _problems('{"small": "nope", "large": "triton"}') == [
        f"{OPTION}: small: unknown attention backend 'nope'"
    ]
    assert _problems('{"large": "triton", "large_from_batch": 8, "small_from_batch": 8}') == [
        f"{OPTION}: small_from_batch (8) must exceed large_from_batch (8), or be 0: no batch "
        "would reach large"
    ]
    assert _problems('{"large": "triton", "small_from_batch": 0}') == []
    # The routed backend's own checks, as if it ran the decode phase itself.
    assert _problems('{"large": "triton"}', dtype="float32") == []
    assert f"{OPTION}: large: --dtype: fa4 does not support float32" in _problems(
        "", dtype="float32"
    )


def test_auto_refuses_a_partner_without_tree_masks_or_non_causal_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A backend that reads its lengths on the device but draws causal attention alone (a
    third-party one, say) cannot serve the phases auto declares."""
    import outrider.plugins.registry as registry

    flat = PluginSpec(
        name="flat",
        kind="attention",
        summary="causal only",
        implementation="nowhere:Flat",
        attention=AttentionCapabilities(
            devices=frozenset({"cuda"}), cuda_graphs=True, graph_kv_bound=False
        ),
    )
    real = registry.named_spec
    monkeypatch.setattr(
        registry, "named_spec", lambda kind, name: flat if name == "flat" else real(kind, name)
    )
    assert _problems('{"small": "flat", "large": "flat"}') == [
        f"{OPTION}: {role}: flat cannot be routed by auto, which draws tree masks and non-causal "
        "blocks"
        for role in ("small", "large")
    ]


@needs_triton
def test_auto_routes_each_batch_by_its_size() -> None:
    """Below ``large_from_batch`` rows the small backend attends, from it the large one, from
    ``small_from_batch`` the small one again: the outputs are exactly theirs."""
    gen = torch.Generator().manual_seed(3)
    rows = paged_rows(gen, DEVICE, SHAPE)
    options = AutoOptions(small="torch", large="triton", large_from_batch=2, small_from_batch=4)
    auto = AutoAttention(SHAPE, options, DEVICE)
    assert [type(auto.route(bs)).__name__.removesuffix("Attention") for bs in range(1, 6)] == [
        "Torch", "Triton", "Triton", "Torch", "Torch",
    ]  # fmt: skip
    unbounded = AutoAttention(SHAPE, msgspec.structs.replace(options, small_from_batch=0), DEVICE)
    assert type(unbounded.route(4096)).__name__ == "TritonAttention"
    for bs in (1, 2, 3, 4):
        layout = make_batch(KINDS[0], rows, bs, gen)
        q, k, v = qkv(bs, gen, DEVICE, SHAPE)
        routed = ForwardBatch.bind(layout, auto, rows.kv).attend(0, q, k, v)
        alone = ForwardBatch.bind(layout, auto.route(bs), rows.kv).attend(0, q, k, v)
        assert torch.equal(routed, alone), bs


@pytest.mark.gpu
def test_the_engine_decodes_through_auto_within_the_rule_of_triton() -> None:
    """The embedded family in bf16, prompts on triton, decode batches of 1 to 10 rows through
    auto (triton below 4 rows and from 8, fa4 between) under CUDA graphs, against triton
    alone."""
    pytest.importorskip("flash_attn.cute")
    family = embedded_family()
    assert family is not None, "the family package is installed with the test extra"
    prompts = [[3 + (7 * i + 3 * j) % 4000 for j in range(5 + 9 * i)] for i in range(10)]
    requests = [request(i, p, max_new_tokens=32, logprobs=2) for i, p in enumerate(prompts)]

    def serve(decode: str) -> dict[int, list[TokenLogprob]]:
        engine = engine_for(
            str(family.target), device="cuda", dtype="bfloat16", attention_backend="triton",
            decode_attention_backend=decode, speculative_algorithm="none", max_running=12,
            attention_config=('auto={"large_from_batch": 4, "small_from_batch": 8}',),
        )  # fmt: skip
        outcomes = run(engine, requests, stagger=2)
        return {
            rid: [lp for u in o.updates for lp in u.logprobs or []] for rid, o in outcomes.items()
        }

    routed, alone = serve("auto"), serve("triton")
    same = sum(assert_within_rule(alone[r], routed[r], MAX_DIFF["bfloat16"]) for r in alone)
    print(f"auto: {same} of {len(alone)} requests token for token")
