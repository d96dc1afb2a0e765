from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SYSTEMD_DIR = Path(__file__).resolve().parents[1] / "systemd"
UNIT = SYSTEMD_DIR / "outrider.service"
ENV_EXAMPLE = SYSTEMD_DIR / "outrider.env.example"
MAX_EXPOSURE = 2.5

needs_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)


def _settings(path: Path) -> dict[str, list[str]]:
    """KEY=VALUE lines (a key may repeat, as in systemd units); comments and sections skipped."""
    settings: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and line[0] not in "#;[" and "=" in line:
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def _seconds(value: str) -> float:
    units = {"s": 1, "min": 60, "": 1}
    match = re.fullmatch(r"(\d+)(s|min|)", value)
    assert match, value
    return int(match[1]) * units[match[2]]


@pytest.fixture
def testable_unit(tmp_path: Path) -> Path:
    """The unit with ExecStart on a binary that exists here (verify checks that it does)."""
    text = UNIT.read_text().replace("ExecStart=/opt/outrider/bin/outrider ", "ExecStart=/bin/true ")
    assert "ExecStart=/bin/true serve" in text
    copy = tmp_path / "outrider.service"
    copy.write_text(text)
    return copy


def test_unit_keeps_the_required_settings() -> None:
    unit = _settings(UNIT)
    assert unit["Type"] == ["notify"]
    assert unit["NotifyAccess"] == ["main"]
    assert unit["ExecStart"] == ["/opt/outrider/bin/outrider serve"]
    assert unit["EnvironmentFile"] == ["/etc/outrider/outrider.env"]
    assert unit["KillMode"] == ["mixed"]
    assert unit["Restart"] == ["on-failure"]
    assert "WatchdogSec" in unit
    assert unit["DevicePolicy"] == ["closed"]
    assert unit["DeviceAllow"] == ["char-nvidia* rw"]
    assert unit.get("PrivateDevices", ["no"]) == ["no"]
    assert "MemoryDenyWriteExecute" not in unit
    families = unit["RestrictAddressFamilies"][0].split()
    assert {"AF_UNIX", "AF_NETLINK", "AF_INET", "AF_INET6"} <= set(families)
    for key in ("RuntimeDirectory", "StateDirectory", "CacheDirectory"):
        assert unit[key] == ["outrider"]
    assert unit["ProtectSystem"] == ["strict"]


def test_stop_timeout_exceeds_the_drain_deadline() -> None:
    drain = float(_settings(ENV_EXAMPLE)["OUTRIDER_DRAIN_TIMEOUT"][0])
    assert _seconds(_settings(UNIT)["TimeoutStopSec"][0]) > drain


def test_jit_caches_live_under_the_cache_directory() -> None:
    env = _settings(ENV_EXAMPLE)
    for key in (
        "TRITON_CACHE_DIR",
        "TORCHINDUCTOR_CACHE_DIR",
        "FLASHINFER_WORKSPACE_BASE",
        "CUTE_DSL_CACHE_DIR",
    ):
        assert env[key][0].startswith("/var/cache/outrider/"), key
    assert env["OUTRIDER_MODEL"] and env["OUTRIDER_DEVICE"] == ["cuda"]


@needs_analyze
def test_systemd_analyze_verify_is_silent(testable_unit: Path) -> None:
    result = subprocess.run(
        ["systemd-analyze", "verify", str(testable_unit)], capture_output=True, text=True
    )
    # verify exits 0 even on unknown keys: any stderr output is a failure.
    assert result.stderr == ""
    assert result.returncode == 0


@needs_analyze
def test_security_exposure_is_low(testable_unit: Path) -> None:
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(testable_unit)],
        capture_output=True,
        text=True,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match[1]) <= MAX_EXPOSURE
