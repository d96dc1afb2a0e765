"""The plugin API: light specs read by every process, implementations loaded in the daemon.

An entry point in ``outrider.attention_backends`` or ``outrider.speculative`` names a
``PluginSpec`` instance. A spec module imports nothing heavy (no torch): the tokenizer process
and ``outrider plugins`` use specs only. ``PluginSpec.load()`` imports and returns the
implementation class inside the daemon.

``API_VERSION`` covers the modules of ``PUBLIC_MODULES``: the whole surface a plugin package
may import. A change that breaks one of their public names bumps ``API_VERSION``; every other
module of ``outrider.plugins`` (the built-in plugins, their helpers, the registry, the private
kernels) and all of ``outrider.daemon`` may change at any time.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from outrider.plugins.sampling_spec import SamplingSpec

API_VERSION = 1

# The public surface for plugin packages, covered by API_VERSION (a test holds the example
# third-party package to it).
PUBLIC_MODULES: tuple[str, ...] = (
    # Specs, capabilities, checks.
    "outrider.plugins.api",
    # The device surface: forward batches and their layouts, the paged KV cache, sampling.
    "outrider.plugins.device",
    "outrider.plugins.sampling",
    "outrider.plugins.sampling_spec",
    # The typed table of debug knobs the building blocks read.
    "outrider.plugins.debug",
    # Attention backends: the base class, and the reference backend a backend may extend.
    "outrider.plugins.attention.base",
    "outrider.plugins.attention.torch_impl",
    # Speculative workers: the base class and its deferred catch-up buffer.
    "outrider.plugins.speculative.base",
    "outrider.plugins.speculative.deferred",
    # Model building blocks: config parsing, layers, the weight loader, tensor-parallel groups
    # and linears, layer kernels, and the model families through their registry.
    "outrider.plugins.models.config",
    "outrider.plugins.models.layers",
    "outrider.plugins.models.loader",
    "outrider.plugins.models.weights",
    "outrider.plugins.models.parallel",
    "outrider.plugins.models.kernels",
    "outrider.plugins.models.registry",
)

PluginKind = Literal["attention", "speculative"]
Phase = Literal["extend", "decode", "verify", "draft_decode", "draft_extend"]
PHASES: tuple[Phase, ...] = ("extend", "decode", "verify", "draft_decode", "draft_extend")
DRAFT_PHASES: frozenset[Phase] = frozenset({"draft_decode", "draft_extend"})
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
    # --attention-config: the options (JSON) per backend name.
    attention_config: dict[str, str] = field(default_factory=dict)
    # --tensor-parallel-size: ranks a draft model is sharded over as the target is.
    tensor_parallel_size: int = 1

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

    def cut(self, width: int) -> StepShape:
        """The shape of a step whose rows verify ``width`` tokens: this one, plain decoding
        (1), this chain cut to ``width - 1`` drafts, or this tree cut to its best ``width - 1``
        nodes (its draft steps unchanged)."""
        if width == self.width:
            return self
        if width == 1:
            return NO_DRAFT
        assert 1 < width < self.width, (self, width)
        if self.tree:
            return StepShape(width=width, depth=self.depth, topk=self.topk)
        return StepShape(width=width, depth=width - 1, topk=1)

    def cuts(self) -> tuple[StepShape, ...]:
        """This shape at the sizes a step may be cut to, widest first: its own drafts (a
        chain's depth, a tree's nodes), then halved (rounded up) down to one, so that 7 gives
        7, 4, 2, 1."""
        if not self.speculative:
            return (self,)
        drafts = [self.width - 1]
        while drafts[-1] > 1:
            drafts.append((drafts[-1] + 1) // 2)
        return tuple(self.cut(count + 1) for count in drafts)


# Plain decoding: one token per row, nothing drafted.
NO_DRAFT = StepShape(width=1, depth=0, topk=1)


@dataclass(frozen=True)
class RequestFacts:
    """What a plugin's ``check_request`` may look at: one validated request, no tokens.

    Its fields are plugin API, read and built by plugins (and their tests); the front door
    builds it with ``from_sampling``."""

    temperature: float
    top_p: float
    top_k: int
    logprobs: int
    has_stop_strings: bool
    prompt_tokens: int

    @classmethod
    def from_sampling(
        cls, sampling: SamplingSpec, *, has_stop_strings: bool, prompt_tokens: int
    ) -> RequestFacts:
        """The facts of a request admitted with ``sampling`` (all but its seed)."""
        return cls(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            logprobs=sampling.logprobs,
            has_stop_strings=has_stop_strings,
            prompt_tokens=prompt_tokens,
        )


@dataclass(frozen=True)
class AttentionCapabilities:
    """What an attention backend can do; the registry checks the configuration against it.
    Causal attention is not declared: every phase needs it."""

    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    dtypes: frozenset[str] = frozenset({"float32", "bfloat16", "float16"})
    # None: any page size.
    page_sizes: frozenset[int] | None = None
    non_causal: bool = False
    tree_mask: bool = False
    # Per-layer sliding windows and per-head attention sinks (``AttentionShape``; gpt-oss).
    sliding_window: bool = False
    sinks: bool = False
    # Its launches may be captured in CUDA graphs.
    cuda_graphs: bool = False
    # Its work and memory grow with the layout's ``max_kv``: decode graphs are then captured
    # per KV bound bucket. False: it reads every length on the device, and one graph per batch
    # size, built with the largest bound, serves any length.
    graph_kv_bound: bool = True
    # It schedules each forward on the host from every row's exact KV length. In a speculative
    # cycle those exist only on the device (the accepted counts): routed to a phase of the
    # cycle (verify or a draft phase), the engine then waits for the previous cycle's lengths
    # before launching the next, and the overlap loop keeps only the host work before that
    # wait. Its draft phases need ``SpeculativeCapabilities.exact_draft_lengths``.
    host_plans: bool = False
    phases: frozenset[Phase] = frozenset(PHASES)


@dataclass(frozen=True)
class SpeculativeCapabilities:
    """What a speculative algorithm can do and needs; the registry checks the configuration
    against it, and the front door each request."""

    needs_draft_model: bool = False
    tree: bool = False  # takes --speculative-topk > 1
    # Drafts with non-causal attention: its draft_decode backend needs ``non_causal``.
    non_causal_draft: bool = False
    # The attention phases its draft model runs (with ``needs_draft_model``).
    draft_phases: frozenset[Phase] = DRAFT_PHASES
    # Every draft batch's KV lengths are known on the host once the cycle's starts are (each a
    # fixed amount past its row's start), as a backend that plans on the host needs
    # (``AttentionCapabilities.host_plans``). False: some follow the accepted counts, which
    # exist only on the device.
    exact_draft_lengths: bool = True
    # False: a request with temperature > 0 is refused.
    sampling: bool = True
    # False: a request with logprobs > 0 is refused.
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

    The registry checks a configuration against the declared capabilities itself; ``check``
    adds the plugin's own problems to those (every one at once; empty: none to add).
    ``check_request`` returns a message for a request this plugin cannot honour beyond what its
    capabilities say (answered ``unsupported``), else None.
    """

    name: str
    kind: PluginKind
    summary: str
    implementation: str  # "module:attribute", imported by load()
    api_version: int = API_VERSION
    options: type[msgspec.Struct] = NoOptions
    # Those of its kind are required: the registry loads no attention spec without, and its
    # check refuses a speculative spec without.
    attention: AttentionCapabilities | None = None
    speculative: SpeculativeCapabilities | None = None
    check: Callable[[PluginSpec, CheckContext], list[Problem]] = field(default=lambda spec, ctx: [])
    check_request: Callable[[RequestFacts], str | None] = field(default=lambda facts: None)

    def load(self) -> Any:
        module_name, _, attribute = self.implementation.partition(":")
        return getattr(importlib.import_module(module_name), attribute)

    def parse_options(self, raw: bytes | str | None) -> msgspec.Struct:
        """Validate ``--*-config`` JSON against the options struct (raises ValidationError)."""
        return msgspec.json.decode(raw or b"{}", type=self.options)
