"""The attention backends an engine builds (build.py wires them): the target's, one instance per
distinct backend name shared by the phases routed to it; each draft backend a speculative
worker asks for, new, and remembered for the runner; and the start-up log line of what was
chosen for the device, the dtype and each phase, and why."""

from __future__ import annotations

import logging

import torch

from outrider.daemon.config import ServeConfig
from outrider.daemon.processes.attention_choice import AttentionChoice
from outrider.plugins.api import Phase
from outrider.plugins.attention.base import AttentionBackend
from outrider.plugins.device import AttentionShape
from outrider.plugins.registry import ResolvedPlugins

log = logging.getLogger("outrider.engine")


def log_choices(
    config: ServeConfig,
    checkpoint_dtype: str | None,
    dtype_name: str,
    capability: tuple[int, int] | None,
    attention: AttentionChoice,
) -> None:
    """What the device, dtype and attention routes are, and what decided each (one line; a
    second one when a preferred attention backend could not run)."""
    gpu = ""
    if capability is not None:
        major, minor = capability
        gpu = f" ({torch.cuda.get_device_name()}, compute capability {major}.{minor})"
    log.info(
        "device %s%s, dtype %s (%s); attention: %s",
        config.device, gpu, dtype_name, config.dtype_reason(checkpoint_dtype),
        attention.describe(),
    )  # fmt: skip
    fallbacks = attention.fallbacks()
    if fallbacks is not None:
        log.warning("%s", fallbacks)


def target_backends(
    plugins: ResolvedPlugins,
    phases: tuple[Phase, ...],
    shape: AttentionShape,
    device: torch.device,
) -> dict[Phase, AttentionBackend]:
    """The target's backends for ``phases``: one instance per distinct name, shared by the
    phases routed to it (a slot no model runs builds nothing: its route was never checked
    against a model's head dim)."""
    instances: dict[str, AttentionBackend] = {}
    routes: dict[Phase, AttentionBackend] = {}
    for phase in phases:
        resolved = plugins.attention[phase]
        name = resolved.spec.name
        if name not in instances:
            instances[name] = new_backend(plugins, phase, shape, device)
        routes[phase] = instances[name]
    return routes


def remembered(made: list[AttentionBackend], backend: AttentionBackend) -> AttentionBackend:
    """``backend``, noted in ``made`` (the runner keeps the draft's backends)."""
    made.append(backend)
    return backend


def new_backend(
    plugins: ResolvedPlugins, phase: Phase, shape: AttentionShape, device: torch.device
) -> AttentionBackend:
    """A new instance of the backend routed to ``phase``, with its options."""
    resolved = plugins.attention[phase]
    backend: AttentionBackend = resolved.spec.load()(shape, resolved.options, device)
    return backend
