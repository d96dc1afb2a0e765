"""The ``outrider`` command itself (its subcommands have their own test files)."""

from __future__ import annotations

import importlib.metadata

import pytest

from outrider.daemon.cli import main
from outrider.protocol.messages import PROTOCOL_VERSION


def test_version_names_the_installed_distribution_and_the_protocol(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    installed = importlib.metadata.version("outrider")
    assert capsys.readouterr().out == f"outrider {installed} (client protocol {PROTOCOL_VERSION})\n"
