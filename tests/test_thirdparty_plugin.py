"""A third-party plugin package, built and installed the way a user would, then discovered."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from outrider.plugins.api import PHASES, CheckContext
from outrider.plugins.registry import discover

FIXTURE = Path(__file__).parent / "fixtures" / "thirdparty_plugin"
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``outrider-example-plugin`` built into a wheel and installed into its own site dir."""
    root = tmp_path_factory.mktemp("thirdparty")
    # Build from a copy: an in-tree build would leave build/ and *.egg-info in the fixture.
    source = shutil.copytree(FIXTURE, root / "src")
    wheels, site = root / "wheels", root / "site"
    subprocess.run(
        [*PIP, "wheel", "--no-build-isolation", "--no-deps", "--no-index", "-w", wheels, source],
        check=True,
    )
    [wheel] = wheels.glob("outrider_example_plugin-0.1.0-*.whl")
    subprocess.run([*PIP, "install", "--no-deps", "--no-index", "-t", site, wheel], check=True)
    return site


def _plugins_cmd(site: Path, *args: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "outrider.daemon.cli.plugins", *args],
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_listed_as_json_with_options_problems_and_the_broken_one(site: Path) -> None:
    report = json.loads(_plugins_cmd(site, "--json", "--page-size", "1"))
    attention = {p["name"]: p for p in report["attention"]}
    assert "torch" in attention
    sdpa = attention["example-sdpa"]
    assert (sdpa["distribution"], sdpa["version"]) == ("outrider-example-plugin", "0.1.0")
    assert sdpa["summary"].startswith("Paged attention through torch SDPA")
    assert sdpa["options"] == [
        {"name": "max_pages_per_call", "type": "int", "default": 0, "required": False},
        {"name": "enable_gqa", "type": "bool", "default": True, "required": False},
    ]
    assert sdpa["capabilities"] == {
        "devices": ["cuda"],
        "dtypes": ["bfloat16", "float16"],
        "page_sizes": [16],
        "non_causal": False,
        "tree_mask": False,
        "sliding_window": False,
        "sinks": False,
        "cuda_graphs": False,
        "graph_kv_bound": True,
        "host_plans": False,
        "phases": ["decode", "draft_decode", "draft_extend", "extend", "verify"],
    }
    assert sdpa["usable"] is False
    options = {p["option"] for p in sdpa["problems"]}
    assert "--page-size" in options
    if report["machine"]["device"] == "cpu":
        assert {"--device", "--dtype"} <= options

    speculative = {p["name"]: p for p in report["speculative"]}
    assert speculative["ngram"]["usable"] is True
    broken = speculative["broken"]
    assert broken["usable"] is False
    assert "No module named 'outrider_example_missing_dependency'" in broken["error"]


def test_listed_as_text(site: Path) -> None:
    text = _plugins_cmd(site)
    assert "example-sdpa  [outrider-example-plugin 0.1.0]" in text
    assert "max_pages_per_call: int = 0" in text
    assert (
        "      capabilities: devices cuda; dtypes bfloat16, float16; page sizes 16\n"
        "        phases all; non-causal no; tree mask no; CUDA graphs no\n"
    ) in text
    assert "broken  [outrider-example-plugin 0.1.0]  failed to load" in text
    assert "ModuleNotFoundError" in text
    if "device cpu" in text:
        assert "--device: example-sdpa does not run on cpu" in text


def test_registry_refuses_it_on_cpu(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its own check finds nothing here: the declared capabilities are checked all the same."""
    monkeypatch.syspath_prepend(str(site))
    registry = discover()
    entry = {e.name: e for e in registry.entries("attention")}["example-sdpa"]
    assert entry.dist == "outrider-example-plugin"
    ctx = CheckContext(
        device="cpu",
        dtype="float32",
        page_size=1,
        overlap=True,
        attention_routes={phase: "example-sdpa" for phase in PHASES},
        speculative_algorithm="broken",
    )
    problems = {p.option: p.message for p in registry.check(ctx)}
    assert problems["--device"] == "example-sdpa does not run on cpu"
    assert problems["--page-size"] == "example-sdpa takes page sizes 16, not 1"
    assert "--dtype" in problems
    assert "speculative algorithm 'broken' cannot be used" in problems["--speculative-algorithm"]
    assert "--attention-config example-sdpa" not in problems

    options = {"example-sdpa": '{"max_pages_per_call": -1}'}
    problems = {
        p.option: p.message
        for p in registry.check(dataclasses.replace(ctx, attention_config=options))
    }
    assert problems["--attention-config example-sdpa"] == "max_pages_per_call must be >= 0, not -1"
    assert problems["--device"] == "example-sdpa does not run on cpu"


def test_trees_and_blocks_need_its_missing_masks(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """example-sdpa declares neither tree masks nor non-causal attention: a tree verified
    by it, and DFlash drafting with it, are refused naming the phase's flag."""
    monkeypatch.syspath_prepend(str(site))
    routes = {phase: "torch" for phase in PHASES}
    tree = CheckContext(
        device="cpu",
        dtype="float32",
        page_size=16,
        overlap=True,
        attention_routes=routes | {"verify": "example-sdpa"},
        speculative_algorithm="eagle3",
        speculative_num_steps=3,
        speculative_topk=2,
        speculative_num_draft_tokens=6,
    )
    problems = {p.option: p.message for p in discover().check(tree)}
    assert problems["--verify-attention-backend"] == (
        "eagle3 with --speculative-topk 2 verifies a tree (a tree mask), which example-sdpa "
        "cannot do"
    )
    block = dataclasses.replace(
        tree,
        attention_routes=routes | {"draft_decode": "example-sdpa", "draft_extend": "example-sdpa"},
        speculative_algorithm="dflash",
        speculative_topk=0,
        speculative_num_steps=0,
    )
    problems = {p.option: p.message for p in discover().check(block)}
    assert problems["--draft-attention-backend"] == (
        "dflash drafts with non-causal attention, which example-sdpa cannot do"
    )


def test_implementation_subclasses_the_builtin_backend(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch_impl = pytest.importorskip("outrider.plugins.attention.torch_impl")
    monkeypatch.syspath_prepend(str(site))
    implementation = discover().get("attention", "example-sdpa").load()
    assert issubclass(implementation, torch_impl.TorchAttention)


ROUTES = {
    "every phase": {"attention_backend": "example-dense"},
    "verify and drafts only": {
        "verify_attention_backend": "example-dense",
        "draft_attention_backend": "example-dense",
    },
}
DRAFTS = {
    "none": {},
    "eagle3 tree": {"speculative_num_steps": 3, "speculative_topk": 2,
                    "speculative_num_draft_tokens": 6},
    "dflash": {},
}  # fmt: skip


@pytest.mark.parametrize("routes", ROUTES)
@pytest.mark.parametrize("draft", DRAFTS)
def test_a_backend_on_the_public_surface_serves_the_engine(
    site: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path_factory: pytest.TempPathFactory,
    routes: str,
    draft: str,
) -> None:
    """example-dense imports only the public plugin surface; routed to any phase, the engine
    serves the same greedy tokens and the same acceptance as with the built-in backend."""
    pytest.importorskip("torch")
    from engine_harness import engine_for, requests_for, run, tokens_of
    from model_fixtures import save_random_dflash, save_random_eagle3, save_tiny_model

    monkeypatch.syspath_prepend(str(site))
    source = (site / "outrider_example_plugin" / "dense.py").read_text()
    imports = [line for line in source.splitlines() if line.startswith(("import", "from"))]
    assert [line for line in imports if "outrider" in line] == [
        "from outrider.plugins.attention.base import AttentionBackend",
        "from outrider.plugins.device import BatchLayout, ForwardBatch",
    ]
    root = tmp_path_factory.mktemp("dense")
    save_tiny_model("llama", root / "target")
    settings: dict[str, object] = dict(DRAFTS[draft])
    if draft == "eagle3 tree":
        settings |= {"speculative_algorithm": "eagle3",
                     "draft_model": str(save_random_eagle3(root / "eagle3"))}  # fmt: skip
    elif draft == "dflash":
        settings |= {"speculative_algorithm": "dflash",
                     "draft_model": str(save_random_dflash(root / "dflash"))}  # fmt: skip
    prompts = [[3 + (7 * i + j) % 250 for j in range(5 + 3 * i)] for i in range(6)]
    requests = requests_for(prompts, max_new_tokens=12)
    builtin = engine_for(str(root / "target"), **settings)
    dense = engine_for(str(root / "target"), **settings, **ROUTES[routes])
    assert dense.facts.plugins["attention.verify"] == "example-dense"
    assert tokens_of(run(dense, requests)) == tokens_of(run(builtin, requests))
    assert dense.scheduler.counters() == builtin.scheduler.counters()


def test_a_speculative_plugin_on_the_public_surface_is_lossless(
    site: Path, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """example-draft (a draft model from the public building blocks) serves the target-only
    greedy tokens, in the overlap loop and the serial one; with the target as its own draft,
    nearly every draft is accepted, so it really drafts."""
    pytest.importorskip("torch")
    import torch
    from engine_harness import engine_for, requests_for, run, tokens_of
    from model_fixtures import save_tiny_model

    monkeypatch.syspath_prepend(str(site))
    root = tmp_path_factory.mktemp("draft")
    with torch.no_grad():
        save_tiny_model("llama", root / "target")
        save_tiny_model("qwen2", root / "small")
    target = str(root / "target")
    prompts = [[3 + (5 * i + 3 * j) % 200 for j in range(4 + 5 * i)] for i in range(5)]
    prompts += [[7, 8, 9, 10] * 6]  # a repetitive prompt
    requests = requests_for(prompts, max_new_tokens=16)
    expected = tokens_of(run(engine_for(target), requests))

    small = engine_for(
        target, speculative_algorithm="example-draft", draft_model=str(root / "small")
    )
    assert small.facts.plugins["speculative"] == "example-draft"
    assert small.loop.runner.shape.width == 4
    assert tokens_of(run(small, requests)) == expected

    itself = engine_for(
        target,
        speculative_algorithm="example-draft",
        draft_model=target,
        speculative_num_draft_tokens=5,
        page_size=4,
        no_overlap=True,
    )
    assert tokens_of(run(itself, requests)) == expected
    counters = itself.scheduler.counters()
    # 5 tokens per verify, but for float32 near-ties between the draft's path and the target's
    assert 1 + counters.spec_accepted_tokens / counters.spec_drafts > 4.8


def test_the_speculative_plugin_is_listed(site: Path) -> None:
    report = json.loads(_plugins_cmd(site, "--json"))
    draft = {p["name"]: p for p in report["speculative"]}["example-draft"]
    assert (draft["distribution"], draft["version"]) == ("outrider-example-plugin", "0.1.0")
    assert draft["summary"].startswith("A small causal LM with the target's token ids")
    assert draft["error"] is None
    assert draft["capabilities"]["needs_draft_model"] is True
    assert draft["capabilities"]["exact_draft_lengths"] is True
    assert "example-draft  [outrider-example-plugin 0.1.0]" in _plugins_cmd(site)
