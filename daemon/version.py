"""The installed version of Outrider: one source, the distribution's metadata."""

from __future__ import annotations

import importlib.metadata

DISTRIBUTION = "outrider"


def installed_version() -> str:
    """``pyproject.toml``'s version as installed; "unknown" when run from an uninstalled tree."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
