"""Without ``--model`` the daemon serves the embedded family: its target with its DFlash
draft; the algorithm and the draft can be overridden, and without the family installed the
flag is required."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from outrider.daemon import family
from outrider.daemon.config import ConfigError, ServeConfig, add_serve_arguments, resolve
from outrider.daemon.sampling_defaults import read_generation_config


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


def test_the_family_keeps_outriders_sampling_defaults(installed: Path) -> None:
    # Its generation_config.json is the recipe's export (do_sample false), not a choice.
    assert _resolve().generation_config == "none"
    assert _resolve("--speculative-algorithm", "none").generation_config == "none"
    assert _resolve("--generation-config", "auto").generation_config == "auto"
    assert _resolve("--model", "/my/model").generation_config == "auto"


def test_the_installed_familys_generation_config_reads_as_greedy() -> None:
    """Why the family defaults to ``--generation-config none``: its file says greedy. Once the
    family ships sampling defaults chosen by measurement, that default goes (family.py)."""
    found = family.embedded_family()
    if found is None:
        pytest.skip("the embedded family is not installed")
    path = found.target / "generation_config.json"
    assert read_generation_config(path).temperature == 0.0
