"""``outrider plugins``: every installed plugin, its options, and whether it can run here.

Runnable on its own as ``python -m outrider.daemon.plugins_cmd``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

import msgspec

from outrider.daemon.config import EXIT_CONFIG, ConfigError, add_serve_arguments, resolve
from outrider.plugins.api import (
    ENTRY_POINT_GROUPS,
    PHASES,
    AttentionCapabilities,
    CheckContext,
    PluginKind,
    Problem,
    SpeculativeCapabilities,
)
from outrider.plugins.checks import ATTENTION_FLAG, SPECULATIVE_FLAG, PluginProblems
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
        "--page-size", type=int, default=16, help="KV page size to check plugins against"
    )
    parser.add_argument(
        "--check",
        nargs=argparse.REMAINDER,
        metavar="SERVE_FLAGS",
        help="check these `outrider serve` flags (and OUTRIDER_* settings) without starting: "
        f"prints every problem and exits {EXIT_CONFIG} if there is one (--model is not read)",
    )


def run_plugins(args: argparse.Namespace) -> int:
    """Print every discovered plugin per group; always exits 0 (the listing is the answer).
    With ``--check``, the verdict on a serving configuration instead."""
    if args.check is not None:
        return run_serve_check(args.check)
    report = build_report(discover(), machine_context(args.page_size))
    if args.json:
        encoded = msgspec.json.encode(report, order="deterministic")
        print(msgspec.json.format(encoded, indent=2).decode())
    else:
        print(format_report(report))
    return 0


def run_serve_check(argv: list[str], environ: Mapping[str, str] | None = None) -> int:
    """The plugin verdict on ``outrider serve`` flags, as the daemon would reach it at start
    (``--dtype auto`` taken as float32 on CPU, bfloat16 on CUDA)."""
    parser = argparse.ArgumentParser(prog="outrider plugins --check")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    if args.model is None:
        args.model = "(not read)"
    try:
        config = resolve(args, environ)
    except ConfigError as exc:
        print(f"outrider plugins --check: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    capability = _cuda_capability() if config.device == "cuda" else None
    dtype = config.dtype
    if dtype == "auto":
        dtype = "float32" if config.device == "cpu" else "bfloat16"
    try:
        plugins = discover().resolve(config.check_context(dtype, capability))
    except PluginProblems as exc:
        print("the configuration cannot run:")
        print("\n".join(f"  {problem}" for problem in exc.problems))
        return EXIT_CONFIG
    routes = ", ".join(f"{phase} {p.spec.name}" for phase, p in plugins.attention.items())
    verdict = f"the configuration can run: speculative {config.speculative_algorithm}; {routes}"
    if plugins.shape.speculative:
        verdict += f"; {plugins.shape.width} tokens verified per row"
    print(verdict)
    return 0


def machine_context(page_size: int) -> CheckContext:
    """This machine as the daemon would see it: CUDA in bfloat16 if torch sees a GPU."""
    capability = _cuda_capability()
    return CheckContext(
        device="cpu" if capability is None else "cuda",
        dtype="float32" if capability is None else "bfloat16",
        page_size=page_size,
        overlap=True,
        attention_routes={phase: DEFAULT_ATTENTION_BACKEND for phase in PHASES},
        speculative_algorithm="none",
        cuda_capability=capability,
    )


def build_report(registry: Registry, ctx: CheckContext) -> Report:
    machine = MachineReport(ctx.device, ctx.dtype, ctx.page_size, ctx.cuda_capability)
    return Report(
        machine,
        attention=[_plugin_report(registry, e, ctx) for e in registry.entries("attention")],
        speculative=[_plugin_report(registry, e, ctx) for e in registry.entries("speculative")],
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
            result.append(OptionField(f.encode_name, _type_name(f.type), required=True))
            continue
        default = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
        result.append(OptionField(f.encode_name, _type_name(f.type), msgspec.to_builtins(default)))
    return result


def _type_name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def _cuda_capability() -> tuple[int, int] | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return (major, minor)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="outrider plugins", description="List installed plugins and whether they run here."
    )
    add_plugins_arguments(parser)
    return run_plugins(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
