"""The capability checks every plugin gets, whatever its own ``check`` adds: a configuration
against the declared ``AttentionCapabilities`` and ``SpeculativeCapabilities``, a request
against the speculative algorithm's, and the step shape resolved from the flags."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Literal

import msgspec

from outrider.plugins.api import (
    DRAFT_PHASES,
    PHASES,
    AttentionCapabilities,
    CheckContext,
    Phase,
    PluginSpec,
    Problem,
    RequestFacts,
    SpeculativeCapabilities,
    StepShape,
    verify_width,
)
from outrider.plugins.speculative.draft_config import read_config

log = logging.getLogger("outrider.plugins")

ATTENTION_FLAG = "--attention-backend"
SPECULATIVE_FLAG = "--speculative-algorithm"
PHASE_FLAGS: dict[Phase, str] = {
    "extend": "--prefill-attention-backend",
    "decode": "--decode-attention-backend",
    "verify": "--verify-attention-backend",
    "draft_decode": "--draft-attention-backend",
    "draft_extend": "--draft-attention-backend",
}


def attention_option(ctx: CheckContext, name: str) -> str:
    """The flag that routes attention backend ``name`` in ``ctx``, for its problems to name:
    ``--attention-backend`` when it serves every phase, else the flags of the phases it serves
    (a phase flag overrides ``--attention-backend``, whichever of the two chose it)."""
    phases = [phase for phase, routed in ctx.attention_routes.items() if routed == name]
    if not phases or len(phases) == len(ctx.attention_routes):
        return ATTENTION_FLAG
    return " / ".join(dict.fromkeys(PHASE_FLAGS[phase] for phase in phases))


TARGET_PHASES: tuple[Phase, ...] = ("extend", "decode", "verify")


def model_head_dim(path: str) -> int | None:
    """The attention head dim in ``path``'s config.json (``head_dim``, else hidden size over
    heads); None when there is none to read (the model loader reports that)."""
    config = read_config(path) if path else None
    if config is None:
        return None
    head_dim = config.get("head_dim")
    if isinstance(head_dim, int):
        return head_dim
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def head_dim_problems(
    spec: PluginSpec, ctx: CheckContext, why_not: Callable[[int], str | None]
) -> list[Problem]:
    """A problem for each model whose attention ``ctx`` routes to backend ``spec`` (the target
    for prompts, decode and verify; the draft for its steps) with a head dim ``why_not`` refuses
    (it says why, or None)."""
    option = f"{attention_option(ctx, spec.name)} {spec.name}"
    problems = []
    for flag, path in routed_models(spec, ctx):
        head_dim = model_head_dim(path)
        why = why_not(head_dim) if head_dim is not None else None
        if why is not None:
            problems.append(Problem(option, f"{spec.name} {why} ({flag} {path})"))
    return problems


def routed_models(spec: PluginSpec, ctx: CheckContext) -> Iterator[tuple[str, str]]:
    """``(flag, path)`` of each model whose attention ``ctx`` routes to backend ``spec``
    in some phase: the target for prompts, decode and verify, the draft for its steps."""
    models = (
        ("--model", ctx.model, TARGET_PHASES),
        ("--draft-model", ctx.draft_model, DRAFT_PHASES),
    )
    for flag, path, phases in models:
        if any(ctx.attention_routes.get(phase) == spec.name for phase in phases):
            yield flag, path


# The attention a model's config.json asks for beyond causal: what each needs of a backend.
ModelAttention = Literal["sliding_window", "sinks"]
MODEL_ATTENTION_WORDS: dict[ModelAttention, str] = {
    "sliding_window": "sliding-window layers (layer_types)",
    "sinks": "attention sinks (gpt_oss)",
}


def model_attention_needs(path: str) -> list[ModelAttention]:
    """The capabilities beyond causal attention that ``path``'s config.json asks of every
    backend its attention runs on (none where there is no config to read)."""
    config = read_config(path) if path else None
    if config is None:
        return []
    needs: list[ModelAttention] = []
    if "sliding_attention" in (config.get("layer_types") or ()):
        needs.append("sliding_window")
    if config.get("model_type") == "gpt_oss":
        needs.append("sinks")
    return needs


def model_attention_problems(
    spec: PluginSpec, caps: AttentionCapabilities, ctx: CheckContext
) -> list[Problem]:
    """A problem for each model whose attention ``ctx`` routes to backend ``spec`` and asks
    for what ``caps`` lacks (``model_attention_needs``)."""
    option = f"{attention_option(ctx, spec.name)} {spec.name}"
    problems = []
    for flag, path in routed_models(spec, ctx):
        for need in model_attention_needs(path):
            if not getattr(caps, need):
                why = f"{spec.name} has no {MODEL_ATTENTION_WORDS[need]}, which {flag} {path} has"
                problems.append(Problem(option, why))
    return problems


class PluginProblems(Exception):
    """A configuration its plugins cannot run; ``problems`` names every reason."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("\n".join(map(str, problems)))
        self.problems = problems


def speculative_problems(
    spec: PluginSpec,
    caps: SpeculativeCapabilities,
    ctx: CheckContext,
    attention_caps: Callable[[str], AttentionCapabilities | None],
) -> list[Problem]:
    """What ``spec``'s declared capabilities refuse in ``ctx``; ``attention_caps`` looks up
    a routed backend's capabilities."""
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
        problems += _tree_problems(name, ctx, attention_caps)
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
    if caps.non_causal_draft:
        problems += _backend_lacks(
            ctx,
            "draft_decode",
            "non_causal",
            f"{name} drafts with non-causal attention",
            attention_caps,
        )
    if caps.needs_draft_model and not caps.exact_draft_lengths:
        problems += _host_planners(name, ctx, caps.draft_phases, attention_caps)
    return problems


def _host_planners(
    name: str,
    ctx: CheckContext,
    phases: frozenset[Phase],
    attention_caps: Callable[[str], AttentionCapabilities | None],
) -> list[Problem]:
    """A problem for each flag routing one of ``phases`` to a backend that plans on the host,
    which draft ``name``'s batches cannot give (their lengths follow the accepted counts)."""
    problems: dict[str, Problem] = {}
    for phase in PHASES:
        backend, flag = ctx.attention_routes[phase], PHASE_FLAGS[phase]
        caps = attention_caps(backend)
        if phase in phases and caps is not None and caps.host_plans and flag not in problems:
            problems[flag] = Problem(
                flag,
                f"{backend} plans each batch on the host from exact lengths, and {name}'s "
                "draft batches follow the accepted counts, known only on the device: route "
                "the draft phases to another backend",
            )
    return list(problems.values())


def _tree_problems(
    name: str, ctx: CheckContext, attention_caps: Callable[[str], AttentionCapabilities | None]
) -> list[Problem]:
    """A tree (topk K > 1) needs its depth S and size N, at most as many nodes as its
    K + (S - 1) K^2 scored candidates, and tree masks in the verify and draft phases."""
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
    need = f"{name} with --speculative-topk {k} verifies a tree (a tree mask)"
    problems += _backend_lacks(ctx, "verify", "tree_mask", need, attention_caps)
    problems += _backend_lacks(ctx, "draft_decode", "tree_mask", need, attention_caps)
    return problems


def _backend_lacks(
    ctx: CheckContext,
    phase: Phase,
    capability: Literal["non_causal", "tree_mask"],
    need: str,
    attention_caps: Callable[[str], AttentionCapabilities | None],
) -> list[Problem]:
    """A problem naming ``phase``'s flag when its routed backend lacks ``capability``;
    ``need`` says what needs it ("..., which NAME cannot do")."""
    name = ctx.attention_routes[phase]
    caps = attention_caps(name)  # None: the attention check reports it
    if caps is None or getattr(caps, capability):
        return []
    return [Problem(PHASE_FLAGS[phase], f"{need}, which {name} cannot do")]


def request_refusal(spec: PluginSpec, facts: RequestFacts) -> str | None:
    """Why the speculative algorithm ``spec`` cannot serve a request (answered
    ``unsupported``): what its declared capabilities refuse, else its own ``check_request``;
    None when it can."""
    caps = spec.speculative
    if caps is not None and not caps.sampling and facts.temperature > 0:
        return (
            f"speculative algorithm {spec.name!r} decodes greedily only: temperature must be 0, "
            f"got {facts.temperature!r}"
        )
    if caps is not None and not caps.logprobs and facts.logprobs > 0:
        return (
            f"speculative algorithm {spec.name!r} returns no logprobs: logprobs must be 0, "
            f"got {facts.logprobs}"
        )
    return spec.check_request(facts)


def used_phases(ctx: CheckContext, drafts: frozenset[Phase]) -> tuple[Phase, ...]:
    """The phases a configuration runs: prompts and plain decoding, or prompts and the
    speculative cycle's verify, and ``drafts``, the phases its draft model runs (none for
    n-gram, which drafts from the tokens alone)."""
    if ctx.speculative_algorithm == "none":
        return ("extend", "decode")
    return ("extend", "verify", *(phase for phase in PHASES if phase in drafts))


def draft_phases(caps: SpeculativeCapabilities | None) -> frozenset[Phase]:
    """The phases the draft of an algorithm declaring ``caps`` runs (an algorithm that
    declares none counts as running every draft phase: its own check reports it)."""
    if caps is None:
        return DRAFT_PHASES
    return caps.draft_phases if caps.needs_draft_model else frozenset()


def attention_problems(
    spec: PluginSpec,
    caps: AttentionCapabilities,
    ctx: CheckContext,
    drafts: frozenset[Phase] = DRAFT_PHASES,
) -> list[Problem]:
    problems: list[Problem] = []
    name = spec.name
    if ctx.device not in caps.devices:
        problems.append(Problem("--device", f"{name} does not run on {ctx.device}"))
    if ctx.dtype not in caps.dtypes:
        problems.append(Problem("--dtype", f"{name} does not support {ctx.dtype}"))
    if caps.page_sizes is not None and ctx.page_size not in caps.page_sizes:
        sizes = ", ".join(str(p) for p in sorted(caps.page_sizes))
        problems.append(
            Problem("--page-size", f"{name} takes page sizes {sizes}, not {ctx.page_size}")
        )
    for phase in used_phases(ctx, drafts):
        if ctx.attention_routes[phase] == name:
            problems += phase_problems(name, caps, phase)
    problems += model_attention_problems(spec, caps, ctx)
    try:
        spec.parse_options(ctx.attention_config.get(name))
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        problems.append(Problem(f"--attention-config {name}", str(exc)))
    return problems


def phase_problems(name: str, caps: AttentionCapabilities, phase: Phase) -> list[Problem]:
    """The refusal of backend ``name`` routed to ``phase``, a phase it does not serve (the
    phase rule of ``attention_problems``, for one phase); empty when it serves it."""
    if phase in caps.phases:
        return []
    served = ", ".join(p for p in PHASES if p in caps.phases)
    return [
        Problem(
            PHASE_FLAGS[phase],
            f"{name} cannot run the {phase} phase (it serves {served}): route that "
            f"phase to another backend with {PHASE_FLAGS[phase]}",
        )
    ]


def step_shape(ctx: CheckContext, caps: SpeculativeCapabilities) -> StepShape:
    """N, S and K from the flags (already checked), the plugin's default width where they
    leave it open."""
    name = ctx.speculative_algorithm
    topk = max(ctx.speculative_topk, 1)
    given = ctx.speculative_num_draft_tokens
    width = verify_width(given, ctx.speculative_num_steps, topk)
    if not width:
        width = _default_width(caps, ctx.draft_model)
        log.info("speculative %s: %d tokens verified per row (its default)", name, width)
    if given and given != width:
        log.info(
            "speculative %s: a chain of %d steps verifies %d tokens, not "
            "--speculative-num-draft-tokens %d",
            name, width - 1, width, given,
        )  # fmt: skip
    depth = ctx.speculative_num_steps if topk > 1 else width - 1
    return StepShape(width, depth, topk)


def _default_width(caps: SpeculativeCapabilities, draft_model: str) -> int:
    if not caps.width_key:
        return caps.default_width
    config = read_config(draft_model)
    if config is None or not isinstance(config.get(caps.width_key), int):
        raise PluginProblems([Problem("--draft-model", f"no {caps.width_key} in {draft_model}")])
    return int(config[caps.width_key])
