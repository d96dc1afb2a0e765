"""The plugin API: light specs read by every process, implementations loaded in the daemon.

An entry point in ``outrider.attention_backends`` or ``outrider.speculative`` names a
``PluginSpec`` instance. A spec module imports nothing heavy (no torch): the tokenizer process
and ``outrider plugins`` use specs only. ``PluginSpec.load()`` imports and returns the
implementation class inside the daemon.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

API_VERSION = 1

PluginKind = Literal["attention", "speculative"]
Phase = Literal["extend", "decode", "verify", "draft_decode", "draft_extend"]
PHASES: tuple[Phase, ...] = ("extend", "decode", "verify", "draft_decode", "draft_extend")
ENTRY_POINT_GROUPS: dict[PluginKind, str] = {
    "attention": "outrider.attention_backends",
    "speculative": "outrider.speculative",
}


class NoOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Options struct of a plugin that takes none."""


@dataclass(frozen=True)
class Problem:
    """One reason a configuration cannot run, naming the option to change."""

    option: str
    message: str

    def __str__(self) -> str:
        return f"{self.option}: {self.message}"


@dataclass(frozen=True)
class CheckContext:
    """What a plugin's ``check`` may look at: the resolved serving configuration."""

    device: Literal["cpu", "cuda"]
    dtype: str
    page_size: int
    overlap: bool
    attention_routes: dict[Phase, str]
    speculative_algorithm: str
    # Compute capability (major, minor) of the CUDA device, None on CPU.
    cuda_capability: tuple[int, int] | None = None
    # --model (a directory or config.json path; "" when unknown).
    model: str = ""
    # The speculative flags as given (0 / "": not given).
    speculative_num_draft_tokens: int = 0
    speculative_num_steps: int = 0
    speculative_topk: int = 0
    speculative_config: str = ""
    draft_model: str = ""

    @property
    def speculative_width(self) -> int:
        return verify_width(
            self.speculative_num_draft_tokens, self.speculative_num_steps, self.speculative_topk
        )


def verify_width(num_draft_tokens: int, num_steps: int, topk: int) -> int:
    """Tokens verified per row (N, the root included) as the flags set them; 0 when they
    leave it to the plugin. A chain (topk <= 1) of S steps verifies S + 1, whatever
    ``--speculative-num-draft-tokens`` says; a tree verifies N."""
    if topk <= 1 and num_steps:
        return num_steps + 1
    return num_draft_tokens


@dataclass(frozen=True)
class StepShape:
    """The geometry of a decode batch row, resolved once from the speculative flags and handed
    to the scheduler, the runner and the speculative worker."""

    width: int  # N: tokens verified per row, the root included (1: plain decoding)
    depth: int  # S: draft depth; a chain has S = N - 1
    topk: int  # K: branching per draft step; 1 is a chain

    @property
    def speculative(self) -> bool:
        return self.width > 1

    @property
    def tree(self) -> bool:
        return self.topk > 1

    @property
    def max_commit(self) -> int:
        """Tokens a row commits at most: the drafts of the deepest path plus the bonus."""
        return min(self.depth, self.width - 1) + 1

    @property
    def kv_span(self) -> int:
        """KV positions a decode batch writes from a row's start: the verify block, and a tree
        drafter's ``K`` node slots for each of its ``S - 1`` forward steps."""
        return max(self.width, (self.depth - 1) * self.topk) if self.tree else self.width


# Plain decoding: one token per row, nothing drafted.
NO_DRAFT = StepShape(width=1, depth=0, topk=1)


@dataclass(frozen=True)
class RequestFacts:
    """What a plugin's ``check_request`` may look at: one validated request, no tokens."""

    temperature: float
    top_p: float
    top_k: int
    logprobs: int
    has_stop_strings: bool
    prompt_tokens: int


@dataclass(frozen=True)
class AttentionCapabilities:
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    dtypes: frozenset[str] = frozenset({"float32", "bfloat16", "float16"})
    # None: any page size.
    page_sizes: frozenset[int] | None = None
    causal: bool = True
    non_causal: bool = False
    tree_mask: bool = False
    cuda_graphs: bool = False
    # The backend reads per-row kv lengths on the host; the overlap loop then waits for the
    # step's "lengths published" event before launching it.
    needs_host_lengths: bool = False
    phases: frozenset[Phase] = frozenset(PHASES)


@dataclass(frozen=True)
class SpeculativeCapabilities:
    needs_draft_model: bool = False
    tree: bool = False  # takes --speculative-topk > 1
    sampling: bool = True
    logprobs: bool = True
    # Drafting reads tokens on the host: impossible under the overlap loop.
    needs_host_tokens: bool = False
    # Verify tokens per row (the root included) when no flag sets them.
    default_width: int = 4
    # A key of the draft's config.json holding the width instead (e.g. a block size).
    width_key: str = ""


@dataclass(frozen=True)
class PluginSpec:
    """The light description an entry point names.

    ``check`` returns every problem at once (empty: usable); ``check_request`` returns a
    message for a request this plugin cannot honour (answered ``unsupported``), else None.
    """

    name: str
    kind: PluginKind
    summary: str
    implementation: str  # "module:attribute", imported by load()
    api_version: int = API_VERSION
    options: type[msgspec.Struct] = NoOptions
    attention: AttentionCapabilities | None = None
    speculative: SpeculativeCapabilities | None = None
    check: Callable[[PluginSpec, CheckContext], list[Problem]] = field(
        default=lambda spec, ctx: default_check(spec, ctx)
    )
    check_request: Callable[[RequestFacts], str | None] = field(default=lambda facts: None)

    def load(self) -> Any:
        module_name, _, attribute = self.implementation.partition(":")
        return getattr(importlib.import_module(module_name), attribute)

    def parse_options(self, raw: bytes | str | None) -> msgspec.Struct:
        """Validate ``--*-config`` JSON against the options struct (raises ValidationError)."""
        return msgspec.json.decode(raw or b"{}", type=self.options)


def default_check(spec: PluginSpec, ctx: CheckContext) -> list[Problem]:
    """Capability-driven checks shared by all plugins of a kind; a spec's own ``check`` may
    add to them."""
    if spec.speculative is not None:
        return _speculative_check(spec, spec.speculative, ctx)
    problems: list[Problem] = []
    caps = spec.attention
    if caps is None:
        return problems
    flag = f"--attention-backend {spec.name}"
    if ctx.device not in caps.devices:
        problems.append(Problem("--device", f"{spec.name} does not run on {ctx.device}"))
    if ctx.dtype not in caps.dtypes:
        problems.append(Problem("--dtype", f"{spec.name} does not support {ctx.dtype}"))
    if caps.page_sizes is not None and ctx.page_size not in caps.page_sizes:
        sizes = ", ".join(str(p) for p in sorted(caps.page_sizes))
        problems.append(
            Problem("--page-size", f"{spec.name} takes page sizes {sizes}, not {ctx.page_size}")
        )
    for phase, name in ctx.attention_routes.items():
        if name == spec.name and phase not in caps.phases:
            problems.append(Problem(flag, f"{spec.name} cannot run the {phase} phase"))
    return problems


def _speculative_check(
    spec: PluginSpec, caps: SpeculativeCapabilities, ctx: CheckContext
) -> list[Problem]:
    problems: list[Problem] = []
    name = spec.name
    if caps.needs_draft_model and not ctx.draft_model:
        problems.append(Problem("--draft-model", f"{name} needs a draft model directory"))
    if not caps.needs_draft_model and ctx.draft_model:
        problems.append(Problem("--draft-model", f"{name} uses no draft model; leave it out"))
    if ctx.speculative_topk > 1 and not caps.tree:
        problems.append(
            Problem(
                "--speculative-topk",
                f"{name} drafts chains only: use 1, not {ctx.speculative_topk}",
            )
        )
    elif ctx.speculative_topk > 1:
        problems += _tree_problems(name, ctx)
    if caps.needs_host_tokens and ctx.overlap:
        problems.append(
            Problem("--no-overlap", f"{name} reads tokens on the host: it needs the serial loop")
        )
    if ctx.speculative_num_draft_tokens == 1:
        problems.append(
            Problem("--speculative-num-draft-tokens", "must be at least 2 (the root and a draft)")
        )
    try:
        spec.parse_options(ctx.speculative_config)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        problems.append(Problem("--speculative-config", f"{name}: {exc}"))
    return problems


def _tree_problems(name: str, ctx: CheckContext) -> list[Problem]:
    """A tree (topk K > 1) needs its depth S and size N, at most as many nodes as its
    K + (S - 1) K^2 scored candidates, and tree masks in the verify and draft phases."""
    from outrider.plugins.registry import backend_lacks

    k, s, n = ctx.speculative_topk, ctx.speculative_num_steps, ctx.speculative_num_draft_tokens
    problems = []
    if s < 1:
        problems.append(Problem("--speculative-num-steps", f"a tree (topk {k}) needs its depth"))
    if n < 2:
        problems.append(
            Problem("--speculative-num-draft-tokens", f"a tree (topk {k}) needs its size N")
        )
    elif s >= 1 and n - 1 > k + (s - 1) * k * k:
        problems.append(
            Problem(
                "--speculative-num-draft-tokens",
                f"a tree of depth {s} and topk {k} scores {k + (s - 1) * k * k} candidates: "
                f"at most {k + (s - 1) * k * k + 1}, not {n}",
            )
        )
    need = f"{name} with --speculative-topk {k} verifies a tree"
    problems += backend_lacks(ctx, "verify", "tree_mask", need + " (a tree mask)")
    problems += backend_lacks(ctx, "draft_decode", "tree_mask", need + " (a tree mask)")
    return problems
