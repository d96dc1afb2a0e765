"""Without ``--model`` the daemon serves the embedded family: its target with its DFlash
draft; the algorithm and the draft can be overridden, and without the family installed the
flag is required. Requests that leave sampling values out get the target's
generation_config.json values, chosen by measurement (benchmarks/family_generation.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from frontdoor_harness import model_facts

from outrider.daemon import family
from outrider.daemon.config import ConfigError, ServeConfig
from outrider.daemon.flags import add_serve_arguments, resolve
from outrider.daemon.frontdoor.validation import Validator
from outrider.daemon.sampling_defaults import (
    SamplingDefaults,
    read_generation_config,
    resolve_sampling_defaults,
)
from outrider.protocol.messages import Generate

ROOT = Path(__file__).resolve().parent.parent
FAMILY_DEFAULTS = (1.0, 0.95, 0)  # temperature, top_p, top_k of the shipped generation_config
VOCAB = 8192


def _resolve(*argv: str) -> ServeConfig:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return resolve(parser.parse_args(list(argv)), environ={})


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A family package on the path, under another name (the real one may be installed)."""
    root = tmp_path / "fake_family"
    for part in ("target", "dflash", "eagle3"):
        (root / part).mkdir(parents=True)
        (root / part / "config.json").write_text("{}")
    (root / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(family, "PACKAGE", "fake_family")
    return root


def test_no_model_serves_the_family_with_dflash(installed: Path) -> None:
    config = _resolve()
    assert (config.model, config.speculative_algorithm, config.draft_model) == (
        str(installed / "target"),
        "dflash",
        str(installed / "dflash"),
    )


def test_the_algorithm_and_the_draft_can_be_overridden(installed: Path) -> None:
    config = _resolve("--speculative-algorithm", "eagle3")
    assert (config.speculative_algorithm, config.draft_model) == (
        "eagle3",
        str(installed / "eagle3"),
    )
    config = _resolve("--speculative-algorithm", "none")
    assert (config.model, config.speculative_algorithm, config.draft_model) == (
        str(installed / "target"),
        "none",
        "",
    )
    config = _resolve("--speculative-algorithm", "eagle3", "--draft-model", "/elsewhere")
    assert config.draft_model == "/elsewhere"
    config = _resolve("--model", "/my/model", "--speculative-algorithm", "eagle3")
    assert (config.model, config.draft_model) == ("/my/model", "")


def test_without_the_family_the_model_is_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(family, "PACKAGE", "no_such_family_package")
    with pytest.raises(ConfigError, match=r"--model is required \(or OUTRIDER_MODEL\): the "):
        _resolve()


def test_the_family_serves_with_its_generation_config(installed: Path) -> None:
    # The target's generation_config.json holds sampling defaults chosen by measurement.
    assert _resolve().generation_config == "auto"
    assert _resolve("--speculative-algorithm", "none").generation_config == "auto"
    assert _resolve("--generation-config", "none").generation_config == "none"
    generation = installed / "target" / "generation_config.json"
    generation.write_text(json.dumps({"do_sample": True, "temperature": 0.9, "top_p": 0.8}))
    defaults = resolve_sampling_defaults(_resolve())
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.9, 0.8, 0)
    assert defaults.source == f"from {generation}"
    assert resolve_sampling_defaults(_resolve("--generation-config", "none")) == SamplingDefaults(
        source="Outrider's defaults: --generation-config none"
    )


@pytest.fixture
def shipped() -> Path:
    """The installed family's generation_config.json."""
    found = family.embedded_family()
    if found is None:
        pytest.skip("the embedded family is not installed")
    return found.target / "generation_config.json"


def test_the_installed_familys_defaults_are_its_files_values(shipped: Path) -> None:
    """BENCHMARKS.md, "Sampling defaults of the embedded family": temperature 1, top_p 0.95,
    top_k 0; the EOS and pad ids stay the recipe's."""
    assert json.loads(shipped.read_text()) | {"transformers_version": None} == {
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 0.95,
        "top_k": 0,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "transformers_version": None,
    }
    defaults = resolve_sampling_defaults(_resolve())
    assert defaults == read_generation_config(shipped)
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == FAMILY_DEFAULTS
    assert (defaults.source, defaults.ignored) == (f"from {shipped}", ())


def test_the_recipes_export_writes_the_shipped_defaults() -> None:
    """A retrained family ships the same defaults: the export writes ``GENERATION_DEFAULTS``."""
    pytest.importorskip("torch")  # recipe.model imports it
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))  # after site-packages: the checkout shadows nothing
    from recipe import model

    written = json.loads(
        (ROOT / "family/outrider_family/target/generation_config.json").read_text()
    )
    assert {key: written[key] for key in model.GENERATION_DEFAULTS} == model.GENERATION_DEFAULTS
    assert (written["eos_token_id"], written["pad_token_id"]) == (model.EOS_ID, model.PAD_ID)


def test_requests_leaving_values_out_get_the_familys_defaults(shipped: Path) -> None:
    validator = Validator(model_facts(None, VOCAB), None, None, read_generation_config(shipped))

    def admitted(**fields: Any) -> tuple[float, float, int]:
        msg = Generate(request_id="r", input_ids=[5, 6], seed=1, **fields)
        sampling = validator.admit(msg, validator.check(msg), [5, 6]).sampling
        return (sampling.temperature, sampling.top_p, sampling.top_k)

    assert admitted() == FAMILY_DEFAULTS
    assert admitted(temperature=0.0) == (0.0, 0.95, 0)
    assert admitted(temperature=0.7, top_p=1.0, top_k=20) == (0.7, 1.0, 20)
    assert admitted(top_k=5) == (1.0, 0.95, 5)
