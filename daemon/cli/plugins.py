"""``outrider plugins``: every installed plugin, its options, and whether it can run here.

Runnable on its own as ``python -m outrider.daemon.cli.plugins``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from outrider.daemon.cli.option_types import option_type_text
from outrider.daemon.cli.plugin_matrix import build_matrix, format_matrix
from outrider.daemon.config import EXIT_CONFIG, ConfigError, ServeConfig
from outrider.daemon.family import embedded_family
from outrider.daemon.flags import add_serve_arguments, resolve
from outrider.daemon.processes.endpoint_checks import endpoint_problems
from outrider.daemon.processes.hardware import cuda_capability
from outrider.daemon.processes.placement import torch_threads
from outrider.daemon.processes.preflight import ServedPlugins, preflight, resolve_plugins
from outrider.daemon.sampling_defaults import SamplingDefaults, resolve_sampling_defaults
from outrider.plugins.api import (
    ENTRY_POINT_GROUPS,
    PHASES,
    AttentionCapabilities,
    CheckContext,
    PluginKind,
    Problem,
    SpeculativeCapabilities,
)
from outrider.plugins.checks import ATTENTION_FLAG, SPECULATIVE_FLAG
from outrider.plugins.models.config import model_dir
from outrider.plugins.registry import (
    KIND_NAMES,
    Entry,
    Registry,
    discover,
)

# The built-in backend that speculative plugins are checked against.
DEFAULT_ATTENTION_BACKEND = "torch"


class OptionField(msgspec.Struct, frozen=True):
    name: str
    type: str
    default: Any = None
    required: bool = False


class PluginReport(msgspec.Struct, frozen=True):
    name: str
    distribution: str | None
    version: str | None
    target: str
    summary: str | None
    options: list[OptionField]
    capabilities: AttentionCapabilities | SpeculativeCapabilities | None
    usable: bool
    problems: list[Problem]
    error: str | None  # set when the entry point cannot be used at all


class MachineReport(msgspec.Struct, frozen=True):
    device: str
    dtype: str
    page_size: int
    cuda_capability: tuple[int, int] | None


class Report(msgspec.Struct, frozen=True):
    machine: MachineReport
    attention: list[PluginReport]
    speculative: list[PluginReport]


def add_plugins_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the listing as JSON")
    parser.add_argument(
        "--page-size",
        type=int,
        default=16,
        help="KV page size to check plugins against (default: 16)",
    )
    parser.add_argument(
        "--matrix",
        action="store_true",
        help="print the support matrix of the attention backends, phase by phase and with every "
        "speculative algorithm, as the capability checks of `outrider serve` judge it (Markdown; "
        "with --json, JSON)",
    )
    parser.add_argument(
        "--check",
        nargs=argparse.REMAINDER,
        metavar="SERVE_FLAGS",
        help="check these `outrider serve` flags (and OUTRIDER_* settings) as serve would "
        "resolve them, the embedded family and the model files included, without starting: "
        f"prints what would run, or every problem and exits {EXIT_CONFIG}",
    )


def run_plugins(args: argparse.Namespace) -> int:
    """Print every discovered plugin per group; always exits 0 (the listing is the answer).
    With ``--check``, the verdict on a serving configuration instead; with ``--matrix``, the
    support matrix (cli/plugin_matrix.py)."""
    if args.check is not None:
        return run_serve_check(args.check)
    registry = discover()
    if args.matrix:
        matrix = build_matrix(registry, page_size=args.page_size)
        if args.json:
            encoded = msgspec.json.encode(matrix, order="deterministic")
            print(msgspec.json.format(encoded, indent=2).decode())
        else:
            print(format_matrix(matrix), end="")
        return 0
    report = build_report(registry, machine_context(args.page_size), serve_configs(registry))
    if args.json:
        encoded = msgspec.json.encode(report, order="deterministic")
        print(msgspec.json.format(encoded, indent=2).decode())
    else:
        print(format_report(report))
    return 0


@dataclass(frozen=True)
class ServeCheck:
    """What ``outrider serve`` would run with some flags, resolved as it resolves them."""

    config: ServeConfig
    dtype: str
    dtype_reason: str
    cuda_capability: tuple[int, int] | None
    problems: list[str]  # the start-up refusals, each naming its flag
    plugins: ServedPlugins | None  # None: a plugin problem (``plugin_problems`` says which)
    plugin_problems: str
    sampling_defaults: SamplingDefaults | None


def serve_check(config: ServeConfig) -> ServeCheck:
    """Every check ``outrider serve`` makes of ``config`` before it loads weights, without
    stopping at the first that fails: the endpoints it binds (``endpoint_problems``), the
    files (``preflight``), the model's config.json as the loader reads it, the sampling
    defaults and the plugins, in the dtype the daemon would choose."""
    problems = endpoint_problems(config)
    file_problems = preflight(config)
    problems += file_problems
    checkpoint_dtype = None
    if not file_problems:
        try:
            checkpoint_dtype = _checkpoint_dtype(config.model)
        except ConfigError as exc:
            problems.append(str(exc))
    defaults = None
    try:
        defaults = resolve_sampling_defaults(config)
    except ConfigError as exc:
        problems.append(str(exc))
    dtype = config.serving_dtype(checkpoint_dtype)
    capability = cuda_capability() if config.device == "cuda" else None
    if capability is None and config.device == "cuda" and _torch_installed():
        problems.append("--device cuda: no CUDA device is available")
    try:
        plugins: ServedPlugins | None = resolve_plugins(config, dtype, capability)
        plugin_problems = ""
    except ConfigError as exc:
        plugins, plugin_problems = None, str(exc)
    reason = config.dtype_reason(checkpoint_dtype)
    return ServeCheck(
        config, dtype, reason, capability, problems, plugins, plugin_problems, defaults
    )


def run_serve_check(argv: list[str], environ: Mapping[str, str] | None = None) -> int:
    """``outrider plugins --check``: resolve ``argv`` and the ``OUTRIDER_*`` settings as
    ``outrider serve`` does (``resolve``, the embedded family without ``--model``), then
    ``serve_check``; prints what would run, or every problem (exit ``EXIT_CONFIG``)."""
    parser = argparse.ArgumentParser(prog="outrider plugins --check")
    add_serve_arguments(parser)
    try:
        config = resolve(parser.parse_args(argv), environ)
    except ConfigError as exc:
        print(f"outrider plugins --check: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    check = serve_check(config)
    for problem in check.problems:
        print(f"outrider plugins --check: {problem}", file=sys.stderr)
    if check.plugins is None:
        print(check.plugin_problems)
        return EXIT_CONFIG
    if check.problems:
        return EXIT_CONFIG
    print(_verdict(check, check.plugins))
    return 0


def _verdict(check: ServeCheck, served: ServedPlugins) -> str:
    config, plugins = check.config, served.plugins
    routes = ", ".join(f"{phase} {p.spec.name}" for phase, p in plugins.attention.items())
    verdict = f"the configuration can run: speculative {config.speculative_algorithm}; {routes}"
    if plugins.shape.speculative:
        verdict += f"; {plugins.shape.width} tokens verified per row"
    family = embedded_family()
    embedded = family is not None and model_dir(config.model) == family.target
    lines = [verdict, f"  --model {config.model}" + (" (the embedded family)" if embedded else "")]
    if config.draft_model:
        lines.append(f"  --draft-model {config.draft_model}")
    detail = f", torch threads {torch_threads(config)}" if config.device == "cpu" else ""
    if check.cuda_capability is not None:
        detail = ", compute capability {}.{}".format(*check.cuda_capability)
    lines.append(f"  --device {config.device}{detail}, dtype {check.dtype} ({check.dtype_reason})")
    lines.append(f"  attention: {served.attention.describe()}")
    fallbacks = served.attention.fallbacks()
    if fallbacks is not None:
        lines.append(f"  {fallbacks}")
    if check.sampling_defaults is not None:
        lines.append(f"  sampling defaults: {check.sampling_defaults.describe()}")
    return "\n".join(lines)


def _checkpoint_dtype(model: str) -> str | None:
    """The checkpoint's dtype as the loader reads its config.json (transformers' AutoConfig);
    a config.json the loader refuses raises ``ConfigError`` naming ``--model``. Without
    transformers (a light install) nothing is parsed here: None."""
    if importlib.util.find_spec("transformers") is None:
        return None
    from outrider.plugins.models.config import ModelConfig

    try:
        return ModelConfig.from_pretrained(model).dtype
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--model {model}: {exc}") from None


def machine_context(page_size: int) -> CheckContext:
    """This machine as the daemon would see it: CUDA in bfloat16 if torch sees a GPU."""
    capability = cuda_capability()
    return CheckContext(
        device="cpu" if capability is None else "cuda",
        dtype="float32" if capability is None else "bfloat16",
        page_size=page_size,
        overlap=True,
        attention_routes={phase: DEFAULT_ATTENTION_BACKEND for phase in PHASES},
        speculative_algorithm="none",
        cuda_capability=capability,
    )


def serve_configs(
    registry: Registry, environ: Mapping[str, str] | None = None
) -> dict[str, ServeConfig]:
    """Per speculative plugin, the configuration of ``outrider serve --speculative-algorithm
    NAME`` (``OUTRIDER_*`` settings and the embedded family included); a plugin for which
    serve would find no model is left out."""
    configs = {}
    for entry in registry.entries("speculative"):
        args = argparse.Namespace(speculative_algorithm=entry.name)
        try:
            configs[entry.name] = resolve(args, environ)
        except ConfigError:
            continue
    return configs


def build_report(
    registry: Registry, ctx: CheckContext, served: Mapping[str, ServeConfig] | None = None
) -> Report:
    """Every plugin checked against ``ctx``; a speculative one with the model and draft model
    of its ``served`` configuration (``serve_configs``), as serve would run it."""
    machine = MachineReport(ctx.device, ctx.dtype, ctx.page_size, ctx.cuda_capability)
    speculative = []
    for entry in registry.entries("speculative"):
        config = (served or {}).get(entry.name)
        if config is not None:
            entry_ctx = dataclasses.replace(ctx, model=config.model, draft_model=config.draft_model)
        else:
            entry_ctx = ctx
        speculative.append(_plugin_report(registry, entry, entry_ctx))
    return Report(
        machine,
        attention=[_plugin_report(registry, e, ctx) for e in registry.entries("attention")],
        speculative=speculative,
    )


def format_report(report: Report) -> str:
    m = report.machine
    lines = [f"checked against: device {m.device}, dtype {m.dtype}, page size {m.page_size}"]
    kinds: list[tuple[PluginKind, list[PluginReport]]] = [
        ("attention", report.attention),
        ("speculative", report.speculative),
    ]
    for kind, plugins in kinds:
        lines += ["", f"{KIND_NAMES[kind]}s ({ENTRY_POINT_GROUPS[kind]})"]
        if not plugins:
            lines.append("  none installed")
        for p in plugins:
            dist = f"{p.distribution} {p.version}" if p.distribution else "no distribution"
            verdict = "failed to load" if p.error else "usable" if p.usable else "not usable here"
            lines.append(f"  {p.name}  [{dist}]  {verdict}")
            if p.error:
                lines.append(f"      error: {p.error}")
                continue
            lines.append(f"      {p.summary}")
            lines.append("      options:" + ("" if p.options else " none"))
            for o in p.options:
                default = "required" if o.required else f"= {o.default!r}"
                lines.append(f"        {o.name}: {o.type} {default}")
            if p.capabilities is not None:
                first, *rest = _capability_lines(p.capabilities)
                lines.append(f"      capabilities: {first}")
                lines += [f"        {line}" for line in rest]
            lines += [f"      {problem}" for problem in p.problems]
    return "\n".join(lines)


def _plugin_report(registry: Registry, entry: Entry, ctx: CheckContext) -> PluginReport:
    spec = entry.spec
    if spec is None:
        return PluginReport(
            entry.name,
            entry.dist,
            entry.version,
            entry.target,
            None,
            [],
            None,
            False,
            [],
            entry.error,
        )
    if entry.kind == "attention":
        ctx = dataclasses.replace(ctx, attention_routes={phase: spec.name for phase in PHASES})
        problems = registry.check_spec(spec, ctx, ATTENTION_FLAG)
    else:
        ctx = dataclasses.replace(ctx, speculative_algorithm=spec.name)
        problems = registry.check_spec(spec, ctx, SPECULATIVE_FLAG)
    return PluginReport(
        entry.name,
        entry.dist,
        entry.version,
        entry.target,
        spec.summary,
        _options(spec.options),
        spec.attention if entry.kind == "attention" else spec.speculative,
        not problems,
        problems,
        None,
    )


def _capability_lines(caps: AttentionCapabilities | SpeculativeCapabilities) -> list[str]:
    if isinstance(caps, SpeculativeCapabilities):
        width = f"the draft's {caps.width_key}" if caps.width_key else str(caps.default_width)
        return [
            f"draft model {_yes(caps.needs_draft_model)}; trees {_yes(caps.tree)}; "
            f"non-causal draft {_yes(caps.non_causal_draft)}; "
            f"host tokens {_yes(caps.needs_host_tokens)}",
            f"sampling {_yes(caps.sampling)}; logprobs {_yes(caps.logprobs)}; "
            f"default width {width}",
        ]
    pages = "any" if caps.page_sizes is None else ", ".join(map(str, sorted(caps.page_sizes)))
    phases = [phase for phase in PHASES if phase in caps.phases]
    return [
        f"devices {', '.join(sorted(caps.devices))}; dtypes {', '.join(sorted(caps.dtypes))}; "
        f"page sizes {pages}",
        f"phases {'all' if len(phases) == len(PHASES) else ', '.join(phases)}; "
        f"non-causal {_yes(caps.non_causal)}; tree mask {_yes(caps.tree_mask)}; "
        f"CUDA graphs {_yes(caps.cuda_graphs)}",
    ]


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _options(options: type[msgspec.Struct]) -> list[OptionField]:
    result = []
    for f in msgspec.structs.fields(options):
        if f.required:
            result.append(OptionField(f.encode_name, option_type_text(f.type), required=True))
            continue
        default = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
        result.append(
            OptionField(f.encode_name, option_type_text(f.type), msgspec.to_builtins(default))
        )
    return result


def _torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="outrider plugins", description="List installed plugins and whether they run here."
    )
    add_plugins_arguments(parser)
    return run_plugins(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
