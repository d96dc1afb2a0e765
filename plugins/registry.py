"""The plugin registry: entry points of both groups, resolved when the configuration is checked.

Discovery is lazy and loud. ``discover()`` reads entry-point metadata only; a spec module is
imported when its plugin is asked for (or when every plugin is listed). An entry point that
fails to import, names no ``PluginSpec``, has the wrong kind or an unsupported ``api_version``,
or shares its name with another plugin of its group, is listed with its error; the error is
raised only when that plugin is chosen.

The registry checks a configuration against the declared capabilities of the plugins it routes
(checks.py), then runs each plugin's own ``check`` in addition. ``resolve`` turns a configuration
that passes into ``ResolvedPlugins``: the one result that ``outrider plugins --check`` reports and
the engine builds from. A process discovers once and hands the registry (or the result) along.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from types import MappingProxyType

import msgspec

from outrider.plugins.api import (
    API_VERSION,
    DRAFT_PHASES,
    ENTRY_POINT_GROUPS,
    NO_DRAFT,
    AttentionCapabilities,
    CheckContext,
    Phase,
    PluginKind,
    PluginSpec,
    Problem,
    StepShape,
)
from outrider.plugins.checks import (
    SPECULATIVE_FLAG,
    PluginProblems,
    attention_option,
    attention_problems,
    draft_phases,
    speculative_problems,
    step_shape,
    used_phases,
)

SUPPORTED_API_VERSIONS = frozenset({API_VERSION})

KIND_NAMES: dict[PluginKind, str] = {
    "attention": "attention backend",
    "speculative": "speculative algorithm",
}


class PluginError(LookupError):
    """A chosen plugin is unknown or cannot be used; the message names what is available."""


@dataclass(frozen=True)
class Entry:
    """One entry point: its spec when usable as a plugin, else the error that says why not."""

    kind: PluginKind
    name: str
    target: str  # "module:attribute" named by the entry point
    dist: str | None
    version: str | None
    spec: PluginSpec | None
    error: str | None


@dataclass(frozen=True)
class ResolvedPlugin:
    """A chosen plugin and its options, parsed from the flags."""

    spec: PluginSpec
    options: msgspec.Struct


@dataclass(frozen=True)
class ResolvedPlugins:
    """The plugins a checked configuration runs, resolved once from its flags."""

    # Read-only; the phases routed to one backend share its entry.
    attention: Mapping[Phase, ResolvedPlugin]
    speculative: ResolvedPlugin | None  # None: --speculative-algorithm none
    shape: StepShape  # NO_DRAFT without a speculative algorithm


class Registry:
    """Entry points per kind; each spec is imported at most once, on first use."""

    def __init__(self, points: Mapping[PluginKind, Sequence[EntryPoint]]) -> None:
        self._points: dict[PluginKind, list[EntryPoint]] = {
            kind: sorted(points.get(kind, ()), key=lambda ep: (ep.name, ep.value))
            for kind in ENTRY_POINT_GROUPS
        }
        self._loaded: dict[tuple[PluginKind, int], Entry] = {}

    def entries(self, kind: PluginKind) -> list[Entry]:
        """Every entry point of ``kind`` (importing each spec), sorted by name."""
        return [self._entry(kind, i) for i in range(len(self._points[kind]))]

    def get(self, kind: PluginKind, name: str) -> PluginSpec:
        """The spec called ``name``; raises ``PluginError`` naming the available plugins."""
        entry = self._find(kind, name)
        if entry is None:
            raise PluginError(f"unknown {KIND_NAMES[kind]} {name!r}; {self._available(kind)}")
        if entry.spec is None:
            raise PluginError(f"{KIND_NAMES[kind]} {name!r} cannot be used: {entry.error}")
        return entry.spec

    def check(self, ctx: CheckContext) -> list[Problem]:
        """Every problem of the routed attention backends and the speculative algorithm."""
        problems: list[Problem] = []
        for name in dict.fromkeys(ctx.attention_routes.values()):
            problems += self._check_one("attention", name, attention_option(ctx, name), ctx)
        if ctx.speculative_algorithm != "none":
            problems += self._check_one(
                "speculative", ctx.speculative_algorithm, SPECULATIVE_FLAG, ctx
            )
        return problems

    def check_spec(self, spec: PluginSpec, ctx: CheckContext, option: str) -> list[Problem]:
        """The problems of ``spec`` under ``ctx``: its declared capabilities', then those of its
        own ``check``; a check that raises is itself reported against ``option``."""
        problems = self.declared_problems(spec, ctx)
        try:
            own = list(spec.check(spec, ctx))
        except Exception as exc:  # third-party code: report, never crash the start
            own = [Problem(option, f"{spec.name}: check raised {type(exc).__name__}: {exc}")]
        return problems + own

    def resolve(self, ctx: CheckContext) -> ResolvedPlugins:
        """The plugins ``ctx`` routes, checked, with their options and the step shape; raises
        ``PluginProblems`` naming every problem."""
        problems = self.check(ctx)
        if problems:
            raise PluginProblems(problems)
        by_name = {
            name: self._resolve_one("attention", name, ctx.attention_config.get(name))
            for name in dict.fromkeys(ctx.attention_routes.values())
        }
        attention = MappingProxyType(
            {phase: by_name[name] for phase, name in ctx.attention_routes.items()}
        )
        if ctx.speculative_algorithm == "none":
            return ResolvedPlugins(attention, None, NO_DRAFT)
        speculative = self._resolve_one(
            "speculative", ctx.speculative_algorithm, ctx.speculative_config
        )
        caps = speculative.spec.speculative
        assert caps is not None, "checked: a speculative spec declares its capabilities"
        return ResolvedPlugins(attention, speculative, step_shape(ctx, caps))

    def _resolve_one(self, kind: PluginKind, name: str, raw: str | None) -> ResolvedPlugin:
        spec = self.get(kind, name)
        return ResolvedPlugin(spec, spec.parse_options(raw))

    def _check_one(
        self, kind: PluginKind, name: str, option: str, ctx: CheckContext
    ) -> list[Problem]:
        try:
            spec = self.get(kind, name)
        except PluginError as exc:
            return [Problem(option, str(exc))]
        return self.check_spec(spec, ctx, option)

    def declared_problems(self, spec: PluginSpec, ctx: CheckContext) -> list[Problem]:
        """The problems of ``spec``'s declared capabilities under ``ctx`` alone, its own
        ``check`` left out: a verdict that holds wherever the plugin is installed."""
        if spec.kind == "attention":
            assert spec.attention is not None, "_load_spec admits attention specs with capabilities"
            return attention_problems(spec, spec.attention, ctx, self._draft_phases(ctx))
        if spec.speculative is None:
            return [Problem(SPECULATIVE_FLAG, f"{spec.name} declares no SpeculativeCapabilities")]
        return speculative_problems(spec, spec.speculative, ctx, self._attention_capabilities)

    def used_phases(self, ctx: CheckContext) -> tuple[Phase, ...]:
        """The attention phases ``ctx``'s configuration runs (``checks.used_phases``)."""
        return used_phases(ctx, self._draft_phases(ctx))

    def _draft_phases(self, ctx: CheckContext) -> frozenset[Phase]:
        """The phases the draft of ``ctx``'s speculative algorithm runs (an unknown or broken
        one counts as running every draft phase: its own check reports it)."""
        if ctx.speculative_algorithm == "none":
            return frozenset()
        try:
            caps = self.get("speculative", ctx.speculative_algorithm).speculative
        except PluginError:
            return DRAFT_PHASES
        return draft_phases(caps)

    def _attention_capabilities(self, name: str) -> AttentionCapabilities | None:
        """The declared capabilities of attention backend ``name``; None when it is unknown or
        broken (its own check reports that)."""
        try:
            return self.get("attention", name).attention
        except PluginError:
            return None

    def _find(self, kind: PluginKind, name: str) -> Entry | None:
        for i, ep in enumerate(self._points[kind]):
            if ep.name == name:
                return self._entry(kind, i)
        return None

    def _available(self, kind: PluginKind) -> str:
        entries = self.entries(kind)
        usable = [e.name for e in entries if e.spec is not None]
        broken = [e.name for e in entries if e.spec is None]
        text = "available: " + (", ".join(usable) or "none")
        if broken:
            text += "; failed to load: " + ", ".join(broken)
        return text

    def _entry(self, kind: PluginKind, index: int) -> Entry:
        key = (kind, index)
        if key not in self._loaded:
            self._loaded[key] = self._load(kind, index)
        return self._loaded[key]

    def _load(self, kind: PluginKind, index: int) -> Entry:
        points = self._points[kind]
        ep = points[index]
        dist = ep.dist.name if ep.dist is not None else None
        version = ep.dist.version if ep.dist is not None else None
        twins = [p for i, p in enumerate(points) if p.name == ep.name and i != index]
        if twins:
            others = ", ".join(_origin(other) for other in twins)
            error = f"name {ep.name!r} is also registered by {others}"
            return Entry(kind, ep.name, ep.value, dist, version, None, error)
        spec, load_error = _load_spec(kind, ep)
        return Entry(kind, ep.name, ep.value, dist, version, spec, load_error)


def discover() -> Registry:
    """The installed plugins of both groups (entry-point metadata only; nothing imported)."""
    return Registry(
        {kind: tuple(entry_points(group=group)) for kind, group in ENTRY_POINT_GROUPS.items()}
    )


def named_spec(kind: PluginKind, name: str) -> PluginSpec:
    """The spec of the installed plugin ``name`` alone, as ``Registry.get`` gives it, without
    discovering the others: for a plugin that runs another (``auto`` attention). Raises
    ``PluginError``."""
    points = tuple(entry_points(group=ENTRY_POINT_GROUPS[kind], name=name))
    if not points:
        raise PluginError(f"unknown {KIND_NAMES[kind]} {name!r}")
    if len(points) > 1:
        others = ", ".join(_origin(ep) for ep in points)
        raise PluginError(f"{KIND_NAMES[kind]} {name!r} is registered more than once: {others}")
    spec, error = _load_spec(kind, points[0])
    if spec is None:
        raise PluginError(f"{KIND_NAMES[kind]} {name!r} cannot be used: {error}")
    return spec


def _load_spec(kind: PluginKind, ep: EntryPoint) -> tuple[PluginSpec | None, str | None]:
    try:
        obj = ep.load()
    except Exception as exc:  # third-party import-time code may raise anything
        return None, f"import of {ep.value} failed: {type(exc).__name__}: {exc}"
    if not isinstance(obj, PluginSpec):
        return None, f"{ep.value} is a {type(obj).__name__}, not a PluginSpec"
    if obj.api_version not in SUPPORTED_API_VERSIONS:
        supported = ", ".join(str(v) for v in sorted(SUPPORTED_API_VERSIONS))
        return None, f"api_version {obj.api_version} is not supported (supported: {supported})"
    if obj.kind != kind:
        return None, f"spec kind is {obj.kind!r}, but it is registered as {kind!r}"
    if obj.name != ep.name:
        return None, f"entry point {ep.name!r} names a spec called {obj.name!r}"
    if kind == "attention" and obj.attention is None:
        return None, "an attention backend spec must declare AttentionCapabilities"
    return obj, None


def _origin(ep: EntryPoint) -> str:
    dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "no distribution"
    return f"{ep.value} ({dist})"
