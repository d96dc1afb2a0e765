"""The built-in ``ngram`` speculative plugin's spec: prompt lookup with no draft model."""

from __future__ import annotations

import msgspec

from outrider.plugins.api import (
    CheckContext,
    PluginSpec,
    Problem,
    SpeculativeCapabilities,
)


class NgramOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``--speculative-config`` of ``ngram``."""

    # The longest and shortest suffix of a row's text matched against its earlier text.
    max_match: int = 8
    min_match: int = 1
    # Tokens of history searched (the latest ones, the root included).
    window: int = 1024


def _check(spec: PluginSpec, ctx: CheckContext) -> list[Problem]:
    try:
        options = spec.parse_options(ctx.speculative_config)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return []  # the registry reports it
    assert isinstance(options, NgramOptions)
    if not 1 <= options.min_match <= options.max_match < options.window:
        return [
            Problem(
                "--speculative-config",
                "ngram: need 1 <= min_match <= max_match < window, got "
                f"{options.min_match}, {options.max_match}, {options.window}",
            )
        ]
    return []


SPEC = PluginSpec(
    name="ngram",
    kind="speculative",
    summary="prompt lookup: drafts continue the latest earlier match of the text's suffix, "
    "found on the device",
    implementation="outrider.plugins.speculative.ngram_impl:NgramWorker",
    options=NgramOptions,
    speculative=SpeculativeCapabilities(default_width=8),
    check=_check,
)
