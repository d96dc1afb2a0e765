from __future__ import annotations

import dataclasses
import datetime
import enum
import importlib.util
import json
import os
import sys
import textwrap
import uuid
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import pytest
from frontdoor_harness import model_facts

from outrider.daemon.cli import main as cli
from outrider.daemon.cli import plugins as plugins_cmd
from outrider.daemon.cli.option_types import option_type_text
from outrider.daemon.config import EXIT_CONFIG, ServeConfig
from outrider.daemon.family import Family, embedded_family
from outrider.daemon.frontdoor import validation as frontdoor_validation
from outrider.daemon.frontdoor.validation import Rejected, Validator, speculative_request_check
from outrider.plugins.api import (
    NO_DRAFT,
    PHASES,
    AttentionCapabilities,
    CheckContext,
    Phase,
    Problem,
    RequestFacts,
    StepShape,
)
from outrider.plugins.checks import PluginProblems, attention_problems, request_refusal
from outrider.plugins.registry import PluginError, Registry, discover
from outrider.plugins.speculative.ngram import NgramOptions
from outrider.protocol.messages import Generate

SPECS = """
from outrider.plugins.api import (
    AttentionCapabilities, PluginSpec, Problem, SpeculativeCapabilities,
)

ALPHA = PluginSpec(
    name="alpha", kind="attention", summary="any device", implementation="x:Y",
    attention=AttentionCapabilities(),
)
CUDA_ONLY = PluginSpec(
    name="cuda-only", kind="attention", summary="cuda, pages of 16", implementation="x:Y",
    attention=AttentionCapabilities(devices=frozenset({"cuda"}), page_sizes=frozenset({16})),
)
NO_CAPS = PluginSpec(name="no-caps", kind="attention", summary="", implementation="x:Y")
FUTURE = PluginSpec(
    name="future", kind="attention", summary="", implementation="x:Y", api_version=99,
    attention=AttentionCapabilities(),
)
QUIET = PluginSpec(
    name="quiet", kind="attention", summary="cuda, pages of 16, an own check that finds nothing",
    implementation="x:Y", check=lambda spec, ctx: [],
    attention=AttentionCapabilities(devices=frozenset({"cuda"}), page_sizes=frozenset({16})),
)
CHAIN = PluginSpec(
    name="chain", kind="speculative", summary="", implementation="x:Y",
    speculative=SpeculativeCapabilities(),
    check=lambda spec, ctx: [Problem("--speculative-config", "chain needs a draft model")],
)
RAISING = PluginSpec(
    name="raising", kind="speculative", summary="", implementation="x:Y",
    speculative=SpeculativeCapabilities(),
    check=lambda spec, ctx: 1 / 0,
)
STRICT = PluginSpec(
    name="strict", kind="speculative", summary="greedy, no logprobs, short prompts",
    implementation="x:Y", check=lambda spec, ctx: [],
    speculative=SpeculativeCapabilities(needs_draft_model=True, sampling=False, logprobs=False),
    check_request=lambda facts: "strict takes 100 prompt tokens at most"
    if facts.prompt_tokens > 100 else None,
)
UNDECLARED = PluginSpec(name="undeclared", kind="speculative", summary="", implementation="x:Y")
WINDOWED = PluginSpec(
    name="windowed", kind="speculative", summary="its width from the draft", implementation="x:Y",
    speculative=SpeculativeCapabilities(needs_draft_model=True, width_key="block_size"),
)
NOT_A_SPEC = 42
"""


@pytest.fixture
def specs_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"fake_plugins_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(SPECS))
    (tmp_path / f"{name}_broken.py").write_text("raise RuntimeError('no GPU library')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _registry(module: str, attention: dict[str, str], speculative: dict[str, str]) -> Registry:
    def points(group: str, names: dict[str, str]) -> list[EntryPoint]:
        return [EntryPoint(n, f"{module}{target}", group) for n, target in names.items()]

    return Registry(
        {
            "attention": points("outrider.attention_backends", attention),
            "speculative": points("outrider.speculative", speculative),
        }
    )


@pytest.fixture
def registry(specs_module: str) -> Registry:
    return _registry(
        specs_module,
        {
            "alpha": ":ALPHA",
            "cuda-only": ":CUDA_ONLY",
            "quiet": ":QUIET",
            "no-caps": ":NO_CAPS",
            "future": ":FUTURE",
            "chain": ":CHAIN",  # a speculative spec in the attention group
            "number": ":NOT_A_SPEC",
            "broken": "_broken:SPEC",
        },
        {
            "chain": ":CHAIN",
            "raising": ":RAISING",
            "strict": ":STRICT",
            "undeclared": ":UNDECLARED",
            "windowed": ":WINDOWED",
        },
    )


def _ctx(
    routes: dict[Phase, str] | str = "alpha",
    speculative: str = "none",
    device: Literal["cpu", "cuda"] = "cpu",
    page_size: int = 16,
) -> CheckContext:
    if isinstance(routes, str):
        routes = {phase: routes for phase in PHASES}
    return CheckContext(
        device=device,
        dtype="float32",
        page_size=page_size,
        overlap=True,
        attention_routes=routes,
        speculative_algorithm=speculative,
    )


def test_specs_are_imported_only_when_asked(specs_module: str, registry: Registry) -> None:
    assert specs_module not in sys.modules
    assert registry.get("attention", "alpha").name == "alpha"
    assert specs_module in sys.modules


def test_bad_entries_are_listed_with_their_errors(registry: Registry) -> None:
    errors = {e.name: e.error for e in registry.entries("attention")}
    assert errors["alpha"] is None
    assert errors["cuda-only"] is None
    assert "RuntimeError: no GPU library" in str(errors["broken"])
    assert "not a PluginSpec" in str(errors["number"])
    assert "api_version 99" in str(errors["future"])
    assert "kind is 'speculative'" in str(errors["chain"])
    assert "AttentionCapabilities" in str(errors["no-caps"])
    assert [e.name for e in registry.entries("attention")] == sorted(errors)


def test_get_names_what_is_available(registry: Registry) -> None:
    with pytest.raises(PluginError) as unknown:
        registry.get("attention", "fa9")
    message = str(unknown.value)
    assert "unknown attention backend 'fa9'" in message
    assert "available: alpha, cuda-only" in message
    assert "failed to load: broken" in message
    with pytest.raises(PluginError, match="'broken' cannot be used: import of"):
        registry.get("attention", "broken")


def test_same_name_twice_is_an_error_for_both(specs_module: str) -> None:
    registry = Registry(
        {
            "attention": [
                EntryPoint("alpha", f"{specs_module}:ALPHA", "outrider.attention_backends"),
                EntryPoint("alpha", f"{specs_module}:CUDA_ONLY", "outrider.attention_backends"),
            ]
        }
    )
    entries = registry.entries("attention")
    assert len(entries) == 2
    assert all(e.spec is None and "also registered by" in str(e.error) for e in entries)
    with pytest.raises(PluginError, match="also registered"):
        registry.get("attention", "alpha")


def test_check_passes_a_usable_configuration(registry: Registry) -> None:
    assert registry.check(_ctx("alpha")) == []


def test_check_names_the_flag_of_an_unknown_backend(registry: Registry) -> None:
    [problem] = registry.check(_ctx("fa9"))
    assert problem.option == "--attention-backend"
    assert "unknown attention backend 'fa9'" in problem.message

    routes: dict[Phase, str] = {phase: "alpha" for phase in PHASES}
    routes.update(extend="fa9", draft_decode="fa8", draft_extend="fa8")
    options = [p.option for p in registry.check(_ctx(routes))]
    assert options == ["--prefill-attention-backend", "--draft-attention-backend"]


def test_check_reports_every_problem_together(registry: Registry) -> None:
    routes: dict[Phase, str] = {phase: "cuda-only" for phase in PHASES}
    routes["decode"] = "broken"
    problems = registry.check(_ctx(routes, speculative="chain", page_size=1))
    assert {p.option for p in problems} == {
        "--device",
        "--page-size",
        "--decode-attention-backend",
        "--speculative-config",
    }
    assert Problem("--device", "cuda-only does not run on cpu") in problems


def test_check_reports_unknown_and_raising_algorithms(registry: Registry) -> None:
    [unknown] = registry.check(_ctx(speculative="medusa"))
    assert unknown.option == "--speculative-algorithm"
    assert "unknown speculative algorithm 'medusa'; available: chain, raising" in unknown.message
    [raised] = registry.check(_ctx(speculative="raising"))
    assert raised.option == "--speculative-algorithm"
    assert "ZeroDivisionError" in raised.message


def test_discover_finds_the_builtin_backend() -> None:
    [torch_entry] = [e for e in discover().entries("attention") if e.name == "torch"]
    assert torch_entry.dist == "outrider"
    assert torch_entry.target == "outrider.plugins.attention.torch_backend:SPEC"


# --- the capability checks the registry runs --------------------------------------------


def test_capability_checks_run_whatever_the_own_check_returns(registry: Registry) -> None:
    assert registry.check(_ctx("quiet", page_size=1)) == [
        Problem("--device", "quiet does not run on cpu"),
        Problem("--page-size", "quiet takes page sizes 16, not 1"),
    ]
    assert registry.check(_ctx(speculative="strict")) == [
        Problem("--draft-model", "strict needs a draft model directory")
    ]


def test_a_raising_check_is_reported_beside_the_capability_problems(registry: Registry) -> None:
    ctx = dataclasses.replace(_ctx(speculative="raising"), draft_model="draft")
    assert registry.check(ctx) == [
        Problem("--draft-model", "raising uses no draft model; leave it out"),
        Problem(
            "--speculative-algorithm",
            "raising: check raised ZeroDivisionError: division by zero",
        ),
    ]


def test_a_speculative_spec_must_declare_capabilities(registry: Registry) -> None:
    assert registry.check(_ctx(speculative="undeclared")) == [
        Problem("--speculative-algorithm", "undeclared declares no SpeculativeCapabilities")
    ]


def test_attention_options_are_checked(registry: Registry) -> None:
    ctx = dataclasses.replace(_ctx("alpha"), attention_config={"alpha": '{"x": 1}'})
    assert registry.check(ctx) == [
        Problem("--attention-config alpha", "Object contains unknown field `x`")
    ]


# --- requests the capabilities refuse ---------------------------------------------------

SAMPLED = RequestFacts(
    temperature=0.7, top_p=1.0, top_k=0, logprobs=2, has_stop_strings=False, prompt_tokens=5
)


def test_requests_are_refused_by_the_capabilities_then_the_own_check(registry: Registry) -> None:
    strict = registry.get("speculative", "strict")
    assert request_refusal(strict, SAMPLED) == (
        "speculative algorithm 'strict' decodes greedily only: temperature must be 0, got 0.7"
    )
    greedy = dataclasses.replace(SAMPLED, temperature=0.0)
    assert request_refusal(strict, greedy) == (
        "speculative algorithm 'strict' returns no logprobs: logprobs must be 0, got 2"
    )
    plain = dataclasses.replace(greedy, logprobs=0)
    assert request_refusal(strict, plain) is None
    long = dataclasses.replace(plain, prompt_tokens=101)
    assert request_refusal(strict, long) == "strict takes 100 prompt tokens at most"
    assert request_refusal(registry.get("speculative", "chain"), SAMPLED) is None


def test_the_front_door_answers_a_refusal_unsupported(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(frontdoor_validation, "discover", lambda: registry)
    check = speculative_request_check("strict")
    validator = Validator(model_facts(None, 100, speculative_algorithm="strict"), None, check)
    msg = Generate(request_id="r", input_ids=[5, 6], temperature=0.5)
    with pytest.raises(Rejected) as refused:
        validator.admit(msg, validator.check(msg), [5, 6])
    assert refused.value.code == "unsupported"
    assert refused.value.message == (
        "speculative algorithm 'strict' decodes greedily only: temperature must be 0, got 0.5"
    )
    greedy = Generate(request_id="g", input_ids=[5, 6], temperature=0.0)
    assert validator.admit(greedy, validator.check(greedy), [5, 6]).input_ids == [5, 6]


# --- resolution -------------------------------------------------------------------------


def _builtin_ctx(**overrides: object) -> CheckContext:
    ctx = CheckContext(
        device="cpu",
        dtype="float32",
        page_size=16,
        overlap=True,
        attention_routes={phase: "torch" for phase in PHASES},
        speculative_algorithm="ngram",
    )
    return dataclasses.replace(ctx, **overrides)  # type: ignore[arg-type]  # test overrides


def test_resolve_gives_a_frozen_result_with_the_step_shape() -> None:
    plugins = discover().resolve(
        _builtin_ctx(speculative_num_steps=3, speculative_config='{"window": 64}')
    )
    assert plugins.shape == StepShape(width=4, depth=3, topk=1)
    assert plugins.speculative is not None
    assert plugins.speculative.spec.name == "ngram"
    assert plugins.speculative.options == NgramOptions(window=64)
    assert [plugins.attention[phase].spec.name for phase in PHASES] == ["torch"] * len(PHASES)
    assert plugins.attention["extend"] is plugins.attention["draft_decode"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plugins.shape = NO_DRAFT  # type: ignore[misc]  # frozen
    with pytest.raises(TypeError):
        plugins.attention["decode"] = plugins.attention["extend"]  # type: ignore[index]

    assert discover().resolve(_builtin_ctx()).shape == StepShape(width=8, depth=7, topk=1)
    plain = discover().resolve(_builtin_ctx(speculative_algorithm="none"))
    assert (plain.speculative, plain.shape) == (None, NO_DRAFT)


def test_resolve_raises_every_problem() -> None:
    with pytest.raises(PluginProblems) as refused:
        discover().resolve(_builtin_ctx(speculative_topk=3, draft_model="x"))
    assert refused.value.problems == [
        Problem("--draft-model", "ngram uses no draft model; leave it out"),
        Problem("--speculative-topk", "ngram drafts chains only: use 1, not 3"),
    ]


def test_resolve_reads_the_width_from_the_draft(registry: Registry, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"block_size": 6}))
    ctx = dataclasses.replace(_ctx(speculative="windowed"), draft_model=str(tmp_path))
    assert registry.resolve(ctx).shape == StepShape(width=6, depth=5, topk=1)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(PluginProblems) as refused:
        registry.resolve(ctx)
    assert refused.value.problems == [Problem("--draft-model", f"no block_size in {tmp_path}")]


# --- one discovery per process path -----------------------------------------------------


@pytest.fixture
def registries(monkeypatch: pytest.MonkeyPatch) -> list[Registry]:
    """Every ``Registry`` made while the test runs (``discover()`` makes one)."""
    made: list[Registry] = []
    init = Registry.__init__

    def counting(self: Registry, *args: object) -> None:
        made.append(self)
        init(self, *args)  # type: ignore[arg-type]  # Registry's own arguments

    monkeypatch.setattr(Registry, "__init__", counting)
    return made


def test_outrider_plugins_discovers_once(
    registries: list[Registry], capsys: pytest.CaptureFixture[str]
) -> None:
    tree = ["--speculative-algorithm", "eagle3", "--speculative-topk", "2"]
    tree += ["--speculative-num-steps", "2", "--speculative-num-draft-tokens", "4"]
    assert plugins_cmd.run_serve_check([*tree, "--draft-model", "/nonexistent"], {}) == (
        EXIT_CONFIG
    )
    assert len(registries) == 1
    assert plugins_cmd.main([]) == 0
    assert len(registries) == 2
    assert "capabilities:" in capsys.readouterr().out


def test_the_front_door_discovers_once(registries: list[Registry]) -> None:
    assert speculative_request_check("ngram") is not None
    assert len(registries) == 1


def test_the_engine_discovers_once(
    registries: list[Registry], tmp_path_factory: pytest.TempPathFactory
) -> None:
    pytest.importorskip("torch")
    from engine_harness import engine_for
    from model_fixtures import save_tiny_model

    directory = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", directory)
    registries.clear()
    engine = engine_for(str(directory), speculative_algorithm="ngram", speculative_num_steps=3)
    assert len(registries) == 1
    assert engine.facts.configuration["speculative_num_draft_tokens"] == 4


# --- the flashinfer backend's declared phases -------------------------------------------


def _flashinfer_ctx(routes: dict[Phase, str], speculative: str) -> CheckContext:
    ctx = _ctx(routes, speculative, device="cuda")
    return dataclasses.replace(ctx, dtype="bfloat16", cuda_capability=(9, 0))


def test_flashinfer_serves_plain_decoding_on_every_phase_flag() -> None:
    spec = discover().get("attention", "flashinfer")
    assert spec.attention is not None
    everywhere = {phase: "flashinfer" for phase in PHASES}
    # The verify and draft routes are unused without speculation.
    assert attention_problems(spec, spec.attention, _flashinfer_ctx(everywhere, "none")) == []


def test_flashinfer_serves_every_phase_of_dflash_and_eagle3_trees() -> None:
    spec = discover().get("attention", "flashinfer")
    assert spec.attention is not None
    registry = discover()
    everywhere = {phase: "flashinfer" for phase in PHASES}
    for algorithm in ("dflash", "eagle3", "ngram"):
        ctx = _flashinfer_ctx(everywhere, algorithm)
        assert attention_problems(spec, spec.attention, ctx) == [], algorithm
    # DFlash's draft runs its decode phase only (the context is projected, not attended), its
    # block non-causal.
    dflash = dataclasses.replace(_flashinfer_ctx(everywhere, "dflash"), draft_model="/draft")
    assert registry.declared_problems(registry.get("speculative", "dflash"), dflash) == []
    # A tree's verify and draft steps take a custom mask.
    tree = dataclasses.replace(
        _flashinfer_ctx(everywhere, "eagle3"),
        speculative_topk=4,
        speculative_num_steps=3,
        speculative_num_draft_tokens=8,
        draft_model="/draft",
    )
    assert registry.declared_problems(registry.get("speculative", "eagle3"), tree) == []
    # The registry knows n-gram runs no draft model (whatever else this machine lacks).
    ngram = _flashinfer_ctx(everywhere, "ngram")
    problems = registry.check(dataclasses.replace(ngram, speculative_num_draft_tokens=4))
    assert [p for p in problems if "phase" in p.message] == []


def test_the_phases_a_configuration_runs_follow_its_draft() -> None:
    """Used phases decide which routes a check reads: DFlash's draft never runs the extend
    phase, so a backend routed there alone is never asked; n-gram runs no draft phase."""
    serves_verify_only = AttentionCapabilities(phases=frozenset({"extend", "verify"}))
    spec = dataclasses.replace(discover().get("attention", "torch"), name="verifier")
    routes = {phase: "torch" for phase in PHASES}
    routes |= {"verify": "verifier", "draft_extend": "verifier"}
    dflash = _ctx(routes, "dflash")
    assert attention_problems(spec, serves_verify_only, dflash, frozenset({"draft_decode"})) == []
    [problem] = attention_problems(spec, serves_verify_only, dflash)
    assert problem.option == "--draft-attention-backend"
    assert problem.message.startswith("verifier cannot run the draft_extend phase")
    assert attention_problems(spec, serves_verify_only, _ctx(routes, "ngram"), frozenset()) == []


def test_a_standalone_draft_is_refused_a_backend_that_plans_on_the_host() -> None:
    """The standalone draft's catch-up sits at each row's accepted length, which only the
    device has: a draft phase on flashinfer is refused, naming the flag."""
    registry = discover()
    ctx = dataclasses.replace(
        _flashinfer_ctx({phase: "flashinfer" for phase in PHASES}, "standalone"),
        draft_model="/draft",
    )
    problems = registry.declared_problems(registry.get("speculative", "standalone"), ctx)
    assert [str(p) for p in problems] == [
        "--draft-attention-backend: flashinfer plans each batch on the host from exact lengths, "
        "and standalone's draft batches follow the accepted counts, known only on the device: "
        "route the draft phases to another backend"
    ]
    on_torch = dataclasses.replace(
        ctx,
        attention_routes=ctx.attention_routes | {"draft_decode": "torch", "draft_extend": "torch"},
    )
    assert registry.declared_problems(registry.get("speculative", "standalone"), on_torch) == []


def test_flashinfer_checks_its_install_and_the_compute_capability(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = discover().get("attention", "flashinfer")
    ctx = dataclasses.replace(
        _flashinfer_ctx({phase: "flashinfer" for phase in PHASES}, "none"),
        cuda_capability=(7, 5),
    )
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    [missing] = spec.check(spec, ctx)
    assert str(missing) == (
        "--attention-backend flashinfer: FlashInfer is not installed "
        "(pip install 'outrider[flashinfer]')"
    )
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    [old] = spec.check(spec, ctx)
    assert str(old) == (
        "--attention-backend flashinfer: flashinfer needs compute capability 8.0 or newer, not 7.5"
    )
    assert spec.check(spec, dataclasses.replace(ctx, cuda_capability=(9, 0))) == []


# --- outrider plugins resolves what outrider serve runs -------------------------------------


@pytest.fixture
def family() -> Family:
    found = embedded_family()
    if found is None:
        pytest.skip("the outrider-family distribution is not installed")
    return found


@pytest.fixture
def no_outrider_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.startswith("OUTRIDER_")]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize(
    "flags",
    [[], ["--speculative-algorithm", "eagle3"], ["--speculative-algorithm", "none"]],
    ids=["defaults", "eagle3", "none"],
)
@pytest.mark.usefixtures("no_outrider_env")
def test_plugins_check_resolves_what_serve_runs(
    flags: list[str],
    family: Family,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("torch")
    from outrider.daemon.processes import start
    from outrider.daemon.processes.preflight import resolve_plugins
    from outrider.plugins.models.config import ModelConfig

    served: list[ServeConfig] = []
    monkeypatch.setattr(cli, "configure_logging", lambda level, fmt: None)
    monkeypatch.setattr(start, "main", lambda config: served.append(config) or 0)
    assert cli.main(["serve", *flags]) == 0
    checked: list[plugins_cmd.ServeCheck] = []
    check = plugins_cmd.serve_check
    monkeypatch.setattr(
        plugins_cmd, "serve_check", lambda config: checked.append(check(config)) or checked[-1]
    )
    assert cli.main(["plugins", "--check", *flags]) == 0
    [config], [result] = served, checked
    assert result.config == config
    assert config.model == str(family.target)
    # What the engine builds from (build.py): the dtype and the plugins, from the same config.
    dtype = config.serving_dtype(ModelConfig.from_pretrained(config.model).dtype)
    assert result.dtype == dtype
    assert result.plugins == resolve_plugins(config, dtype, None)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(
        f"the configuration can run: speculative {config.speculative_algorithm};"
    )
    assert out[1] == f"  --model {family.target} (the embedded family)"
    if config.draft_model:
        assert out[2] == f"  --draft-model {config.draft_model}"
    # The family's generation_config.json (tests/test_family_defaults.py).
    generation = family.target / "generation_config.json"
    assert out[-1] == f"  sampling defaults: temperature 1, top_p 0.95, top_k 0 (from {generation})"


@pytest.mark.usefixtures("no_outrider_env")
def test_plugins_check_runs_the_embedded_family_with_dflash(
    family: Family, capsys: pytest.CaptureFixture[str]
) -> None:
    assert plugins_cmd.run_serve_check([]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("the configuration can run: speculative dflash;")
    assert out[2] == f"  --draft-model {family.drafts['dflash']}"
    assert plugins_cmd.run_serve_check(["--speculative-algorithm", "dflash"]) == 0


@pytest.mark.usefixtures("no_outrider_env")
def test_plugins_check_refuses_what_serve_refuses_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["plugins", "--check", "--model", "/nonexistent"]) == EXIT_CONFIG
    assert capsys.readouterr().err == (
        "outrider plugins --check: --model /nonexistent: no such file or directory\n"
    )
    # A config.json the loader cannot run: refused by what the loader reads, before loading.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    code = plugins_cmd.run_serve_check(["--model", str(tmp_path), "--load-format", "dummy"])
    assert code == EXIT_CONFIG
    assert capsys.readouterr().err == (
        f"outrider plugins --check: --model {tmp_path}: model_type 'gpt2' is not supported "
        "(supported: gpt_oss, llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe)\n"
    )


@pytest.mark.usefixtures("no_outrider_env")
def test_the_listing_checks_drafting_plugins_with_the_drafts_serve_would_use(
    family: Family, capsys: pytest.CaptureFixture[str]
) -> None:
    assert plugins_cmd.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    verdicts = {p["name"]: (p["usable"], p["problems"]) for p in report["speculative"]}
    assert verdicts["dflash"] == (True, []) and verdicts["eagle3"] == (True, [])
    assert verdicts["ngram"] == (True, [])
    usable, problems = verdicts["standalone"]  # no embedded draft: it needs --draft-model
    assert not usable and "--draft-model" in json.dumps(problems)


# --- the option types as the listing prints them ----------------------------------------

TRITON_OPTIONS = [
    "kv_splits: int (0 to 64) = 0",
    "block_n: int (0 to 256) = 0",
    "num_warps: int (0 to 16) = 0",
    "num_stages: int (0 to 8) = 0",
    "programs_per_sm: int (0 to 16) = 0",
]
DRAFT_OPTIONS = [
    "sample: one of: argmax, coupled, rejection = 'coupled'",
    "deferred_catch_up: int (0 to 1024) = 128",
]


def _listed_options(text: str) -> dict[str, list[str]]:
    """Per plugin of the ``outrider plugins`` text, its option lines."""
    listed: dict[str, list[str]] = {}
    plugin, in_options = "", False
    for line in text.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            plugin, in_options = line.split()[0], False
        elif line.startswith("      options:"):
            listed[plugin], in_options = [], True
        elif in_options and line.startswith("        "):
            listed[plugin].append(line.strip())
        else:
            in_options = False
    return listed


@pytest.mark.usefixtures("no_outrider_env")
def test_the_listing_names_the_builtin_option_types_in_words(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert plugins_cmd.main([]) == 0
    listed = _listed_options(capsys.readouterr().out)
    assert listed == {
        "auto": [
            "small: str = 'triton'",
            "large: str = 'fa4'",
            "large_from_batch: int >= 1 = 8",
            "small_from_batch: int >= 0 = 64",
        ],
        "fa4": [],
        "flashinfer": [],
        "torch": [],
        "triton": TRITON_OPTIONS,
        "dflash": DRAFT_OPTIONS,
        "eagle3": DRAFT_OPTIONS,
        "ngram": ["max_match: int = 8", "min_match: int = 1", "window: int = 1024"],
        "standalone": DRAFT_OPTIONS,
    }


class _Mode(enum.Enum):
    FAST = "fast"
    EXACT = "exact"


@pytest.mark.parametrize(
    ("annotation", "text"),
    [
        (bool, "bool"),
        (str, "str"),
        (Annotated[float, msgspec.Meta(ge=0)], "float >= 0"),
        (Annotated[float, msgspec.Meta(gt=0, lt=1)], "float > 0 and < 1"),
        (Annotated[int, msgspec.Meta(gt=0, multiple_of=8)], "int > 0, a multiple of 8"),
        (Annotated[str, msgspec.Meta(min_length=1)], "str (length >= 1)"),
        (Literal["b", "a"] | None, "one of: a, b or null"),
        (Annotated[list[int], msgspec.Meta(max_length=4)], "list of int (length <= 4)"),
        (dict[str, float], "object of str to float"),
        (tuple[int, str], "[int, str]"),
        (_Mode, "one of: fast, exact"),
        (Any, "any"),
        (datetime.date, "date"),
    ],
)
def test_option_types_read_as_their_json(annotation: object, text: str) -> None:
    assert option_type_text(annotation) == text
