"""``--device auto`` and ``--attention-backend auto``: the table's choice per slot, explicit
flags winning, fallbacks when a preferred backend cannot run, and what the CLI reports."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from outrider.daemon.config import AttentionSlot, ServeConfig
from outrider.daemon.flags import resolve
from outrider.daemon.processes import hardware
from outrider.daemon.processes.attention_choice import (
    CPU,
    HOPPER,
    OTHER_CUDA,
    SLOTS,
    Generation,
    choose_attention,
    choose_for,
    generation,
)
from outrider.plugins.attention.flashinfer_backend import head_dim_problem as flashinfer_head_dim
from outrider.plugins.attention.triton_backend import head_dim_problem as triton_head_dim
from outrider.plugins.registry import discover

OPEN: dict[AttentionSlot, str | None] = dict.fromkeys(SLOTS)
EVERY_BACKEND = frozenset({"fa4", "auto", "flashinfer", "triton", "torch"})
TREE = {"speculative_topk": 2, "speculative_num_steps": 3, "speculative_num_draft_tokens": 6}


def _installed(
    names: frozenset[str], no_tree_mask: frozenset[str] = frozenset()
) -> Callable[[AttentionSlot, str], list[str]]:
    """A stand-in for the checks: a backend not in ``names`` is not installed (``auto`` needs
    fa4 and triton, as its children); one in ``no_tree_mask`` is refused the verify and draft
    slots, as the checks refuse a backend without tree masks under a tree."""

    def problems(slot: AttentionSlot, name: str) -> list[str]:
        if name not in names or (name == "auto" and not {"fa4", "triton"} <= names):
            return [f"{name} is not installed"]
        if name in no_tree_mask and slot in ("verify", "draft"):
            return [f"{name} cannot draw a tree mask"]
        return []

    return problems


@pytest.mark.parametrize(
    ("case", "row", "requested", "installed", "no_tree_mask", "routes", "skipped"),
    [
        ("cpu", CPU, OPEN, EVERY_BACKEND, frozenset(), ("torch",) * 4, ()),
        ("hopper, everything", HOPPER, OPEN, EVERY_BACKEND, frozenset(),
         ("fa4", "auto", "auto", "auto"), ()),
        ("hopper without fa4", HOPPER, OPEN, EVERY_BACKEND - {"fa4"}, frozenset(),
         ("flashinfer", "triton", "triton", "triton"), ("fa4", "auto")),
        ("hopper, torch alone", HOPPER, OPEN, frozenset({"torch"}), frozenset(),
         ("torch",) * 4, ("fa4", "flashinfer", "triton", "auto")),
        ("ampere", OTHER_CUDA, OPEN, EVERY_BACKEND, frozenset(),
         ("flashinfer", "triton", "triton", "triton"), ()),
        ("explicit flags win", HOPPER, {**OPEN, "prefill": "torch", "decode": "fa4"},
         frozenset({"torch"}), frozenset(), ("torch", "fa4", "torch", "torch"),
         ("auto", "triton", "flashinfer")),
        ("a tree, auto without tree masks", HOPPER, OPEN, EVERY_BACKEND,
         frozenset({"auto", "triton"}), ("fa4", "auto", "flashinfer", "flashinfer"),
         ("auto", "triton")),
    ],
)  # fmt: skip
def test_each_open_slot_gets_the_first_backend_that_can_run(
    case: str,
    row: Generation,
    requested: dict[AttentionSlot, str | None],
    installed: frozenset[str],
    no_tree_mask: frozenset[str],
    routes: tuple[str, ...],
    skipped: tuple[str, ...],
) -> None:
    choice = choose_attention(requested, row, _installed(installed, no_tree_mask))
    assert tuple(choice.routes[slot] for slot in SLOTS) == routes, case
    assert sorted(s.backend for s in choice.skipped) == sorted(skipped), case
    assert choice.chosen == {slot for slot in SLOTS if requested[slot] is None}
    assert (choice.fallbacks() is None) == (not skipped)


def test_the_generation_comes_from_the_device_and_the_compute_capability() -> None:
    assert generation("cpu", None) is CPU
    assert generation("cuda", (9, 0)) is HOPPER
    assert generation("cuda", (8, 6)) is OTHER_CUDA
    assert generation("cuda", (10, 0)) is OTHER_CUDA
    assert generation("cuda", None) is OTHER_CUDA
    for row in (CPU, HOPPER, OTHER_CUDA):
        assert all(row.preferences[slot][-1] == "torch" for slot in SLOTS), row.name


def test_the_registry_judges_each_candidate_in_its_slot(family_config: ServeConfig) -> None:
    """The built-in plugins as installed here: on CPU torch everywhere; on a simulated Hopper
    the choice skips what is not installed and never takes a backend that cannot run."""
    registry = discover()
    on_cpu = choose_for(family_config, "float32", None, registry)
    assert set(on_cpu.routes.values()) == {"torch"} and on_cpu.skipped == ()
    assert on_cpu.describe() == "prefill torch, verify torch, draft torch (auto for CPU)"
    assert on_cpu.idle == {"decode"}  # the speculative cycle decodes in the verify phase
    plain = dataclasses.replace(family_config, speculative_algorithm="none", draft_model="")
    plain_choice = choose_for(plain, "float32", None, registry)
    assert plain_choice.idle == {"verify", "draft"}
    assert plain_choice.describe() == "prefill torch, decode torch (auto for CPU)"
    cuda = dataclasses.replace(family_config, device="cuda")
    hopper = choose_for(cuda, "bfloat16", (9, 0), registry)
    assert "auto for Hopper, SM 9.0" in hopper.describe()
    ctx = cuda.check_context("bfloat16", (9, 0), hopper.phase_routes)
    assert registry.check(ctx) == [] or set(hopper.routes.values()) == {"torch"}
    for skip in hopper.skipped:
        assert all(hopper.routes[slot] != skip.backend for slot in skip.slots)
    given = dataclasses.replace(cuda, decode_attention_backend="torch")
    assert choose_for(given, "bfloat16", (9, 0), registry).routes["decode"] == "torch"


@pytest.mark.parametrize(("head_dim", "decode"), [(24, "torch"), (64, "triton")])
def test_a_head_dim_a_backend_cannot_attend_with_moves_its_slots_on(
    tmp_path: Path, head_dim: int, decode: str
) -> None:
    """Hopper with triton installed and neither FA4 nor FlashInfer (as on this host): a
    target whose head dim triton's kernels do not take gets torch, named with the reason."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    config = {"model_type": "llama", "hidden_size": 4 * head_dim, "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cuda = ServeConfig(model=str(tmp_path), device="cuda", attention_backend="auto")
    choice = choose_for(cuda, "bfloat16", (9, 0), discover())
    # No draft model: the draft slot serves nothing here, and no head dim is checked for it.
    assert [choice.routes[slot] for slot in ("prefill", "decode", "verify")] == [decode] * 3
    why = f"triton takes head dims 16, 32, ..., 256, not 24 (--model {tmp_path})"
    assert any(skip.why == why for skip in choice.skipped) == (head_dim == 24)


def test_a_model_with_sliding_windows_and_sinks_is_routed_to_backends_that_serve_them(
    tmp_path: Path,
) -> None:
    """Hopper as on this host (triton installed, neither FA4 nor FlashInfer): gpt-oss's
    every slot goes to triton; flashinfer is skipped for lacking windows, auto (which serves
    them where both its backends do) for its large backend, FA4, missing; each named."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    config = {"model_type": "gpt_oss", "hidden_size": 256, "num_attention_heads": 4,
              "head_dim": 64, "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    cuda = ServeConfig(model=str(tmp_path), device="cuda", attention_backend="auto")
    choice = choose_for(cuda, "bfloat16", (9, 0), discover())
    assert [choice.routes[slot] for slot in ("prefill", "decode", "verify")] == ["triton"] * 3
    skipped = {skip.backend: skip.why for skip in choice.skipped}
    assert skipped["flashinfer"] == (
        f"flashinfer has no sliding-window layers (layer_types), which --model {tmp_path} has"
    )
    assert skipped["auto"] == (
        "large: --decode-attention-backend fa4: FlashAttention-4 is not installed "
        "(pip install 'outrider[fa4]')"
    )


def test_head_dim_limits_of_the_cuda_backends() -> None:
    assert [triton_head_dim(d) is None for d in (8, 16, 24, 96, 128, 256, 512)] == [
        False, True, False, False, True, True, False,
    ]  # fmt: skip
    assert [flashinfer_head_dim(d) is None for d in (32, 64, 96, 128, 256)] == [
        False, True, False, True, True,
    ]  # fmt: skip
    assert flashinfer_head_dim(96) == "takes head dims 64, 128, 256, not 96"


def test_an_explicit_backend_that_cannot_run_is_refused_not_replaced(
    family_config: ServeConfig,
) -> None:
    registry = discover()
    config = dataclasses.replace(family_config, prefill_attention_backend="auto")
    choice = choose_for(config, "float32", None, registry)
    assert choice.routes["prefill"] == "auto"
    problems = registry.check(config.check_context("float32", None, choice.phase_routes))
    assert any(p.option == "--prefill-attention-backend" for p in problems)


def test_device_auto_is_cuda_only_where_torch_sees_one(monkeypatch: pytest.MonkeyPatch) -> None:
    args = argparse.Namespace(model=None)
    monkeypatch.setattr(hardware, "cuda_available", lambda: False)
    assert resolve(args, {"OUTRIDER_LOAD_FORMAT": "dummy"}).device == "cpu"
    monkeypatch.setattr(hardware, "cuda_available", lambda: True)
    config = resolve(args, {})
    assert config.device == "cuda" and config.attention_backend == "auto"
    assert config.requested_attention == OPEN
    assert resolve(argparse.Namespace(device="cpu"), {}).device == "cpu"
    assert resolve(argparse.Namespace(attention_backend="triton"), {}).requested_attention == (
        dict.fromkeys(SLOTS, "triton")
    )


def test_dtype_auto_is_the_checkpoints_half_precision_on_cuda() -> None:
    cpu, cuda = ServeConfig(model="m"), ServeConfig(model="m", device="cuda")
    assert (cpu.serving_dtype("bfloat16"), cpu.dtype_reason("bfloat16")) == (
        "float32",
        "auto: float32 on CPU",
    )
    assert cuda.serving_dtype("float16") == "float16"
    assert cuda.dtype_reason("float16") == "auto: the checkpoint's"
    assert cuda.serving_dtype("float32") == "bfloat16"
    assert cuda.serving_dtype(None) == "bfloat16"
    assert ServeConfig(model="m", device="cuda", dtype="float32").dtype_reason("bf") == "--dtype"


@pytest.fixture
def family_config() -> ServeConfig:
    """The embedded family with an EAGLE-3 tree, its slots left to ``auto``."""
    from outrider.daemon.family import embedded_family

    family = embedded_family()
    if family is None:
        pytest.skip("the embedded family is not installed")
    return ServeConfig(
        model=str(family.target),
        attention_backend="auto",
        speculative_algorithm="eagle3",
        draft_model=str(family.drafts["eagle3"]),
        **TREE,  # type: ignore[arg-type]
    )
