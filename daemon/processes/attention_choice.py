"""What ``--attention-backend auto`` (the default) routes each attention slot to: a table of
preferences per slot for each GPU generation, and the first backend of a slot's list whose
checks pass in this configuration.

| generation      | prefill                        | decode, verify, draft           |
|-----------------|--------------------------------|---------------------------------|
| CPU             | torch                          | torch                           |
| Hopper (SM 9.x) | fa4, flashinfer, triton, torch | auto, triton, flashinfer, torch |
| other CUDA      | flashinfer, triton, torch      | triton, flashinfer, torch       |

Hopper's first choices are the mix measured fastest there (BENCHMARKS.md, "The backend
matrix"): FA4 for prompts, the ``auto`` plugin (split-KV triton for small batches, FA4 for
large ones) elsewhere. Split-KV triton comes before FlashInfer in the decode-side slots because
FlashInfer plans on the host, so a speculative cycle routed to it waits for the previous one.
Nothing was measured on other generations: their lists are Hopper's without FA4, which needs
SM 9.x and was measured on it only.

Invariants:
- a slot given by a flag is taken as given, never replaced: the checks refuse it by name;
- the choice is a pure function of the slots asked for, the generation's table and what the
  checks say of each candidate (``choose_attention``); ``choose_for`` builds those from the
  registry and the configuration;
- each candidate is checked alone in its slot (the other phases routed nowhere), against its
  declared capabilities, its own check, and what the speculative algorithm asks of that slot;
- every list ends with ``torch``, which runs everywhere: a slot whose list is exhausted keeps
  its last entry, and the checks of the whole configuration say why it cannot run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from outrider.daemon.config import SLOT_PHASES, AttentionSlot, Device, ServeConfig
from outrider.plugins.api import PHASES, CheckContext, Phase
from outrider.plugins.checks import PHASE_FLAGS
from outrider.plugins.registry import PluginError, Registry

SLOTS: tuple[AttentionSlot, ...] = ("prefill", "decode", "verify", "draft")
SLOT_FLAGS: dict[AttentionSlot, str] = {slot: PHASE_FLAGS[SLOT_PHASES[slot][0]] for slot in SLOTS}

# No backend has this name: the phases of the other slots, so a candidate is checked alone.
_ROUTED_NOWHERE = ""


@dataclass(frozen=True)
class Generation:
    """A row of the table: its name in logs and the backends each slot tries, best first."""

    name: str
    preferences: Mapping[AttentionSlot, tuple[str, ...]]


def _row(name: str, prefill: tuple[str, ...], decode_side: tuple[str, ...]) -> Generation:
    preferences: dict[AttentionSlot, tuple[str, ...]] = dict.fromkeys(SLOTS, decode_side)
    return Generation(name, preferences | {"prefill": prefill})


CPU = _row("CPU", ("torch",), ("torch",))
HOPPER = _row(
    "Hopper", ("fa4", "flashinfer", "triton", "torch"), ("auto", "triton", "flashinfer", "torch")
)
OTHER_CUDA = _row("CUDA", ("flashinfer", "triton", "torch"), ("triton", "flashinfer", "torch"))
# By the compute capability's major version; a generation not named here is OTHER_CUDA.
CUDA_GENERATIONS: dict[int, Generation] = {9: HOPPER}


def generation(device: Device, capability: tuple[int, int] | None) -> Generation:
    """The table's row for ``device`` (``capability`` None on CUDA: unknown, OTHER_CUDA)."""
    if device == "cpu":
        return CPU
    if capability is None:
        return OTHER_CUDA
    return CUDA_GENERATIONS.get(capability[0], OTHER_CUDA)


@dataclass(frozen=True)
class Skipped:
    """A preferred backend that could not run in ``slots``, and the first reason why."""

    backend: str
    slots: tuple[AttentionSlot, ...]
    why: str


@dataclass(frozen=True)
class AttentionChoice:
    """The backend of every slot, which of them were chosen for the hardware, and why."""

    routes: Mapping[AttentionSlot, str]
    chosen: frozenset[AttentionSlot]  # the slots left to ``auto``; the others were given
    generation: str
    skipped: tuple[Skipped, ...]
    # Slots whose phases no model runs (verify without speculation, decode with it, draft
    # without a draft model): routed and checked like the others, named nowhere.
    idle: frozenset[AttentionSlot] = frozenset()

    @property
    def phase_routes(self) -> dict[Phase, str]:
        by_phase = {p: self.routes[slot] for slot in SLOTS for p in SLOT_PHASES[slot]}
        return {phase: by_phase[phase] for phase in PHASES}

    def describe(self) -> str:
        """One line: each slot's backend, and what decided it."""
        named = [slot for slot in SLOTS if slot not in self.idle]
        slots = ", ".join(f"{slot} {self.routes[slot]}" for slot in named)
        if not self.chosen - self.idle:
            return f"{slots} (as given)"
        given = [slot for slot in named if slot not in self.chosen]
        reason = f"auto for {self.generation}" + (f"; {', '.join(given)} given" if given else "")
        return f"{slots} ({reason})"

    def fallbacks(self) -> str | None:
        """One line naming each preferred backend that could not run and where its slots went;
        None when every chosen slot got its first preference."""
        parts = []
        for skip in self.skipped:
            went = ", ".join(
                f"{slot} on {self.routes[slot]}" for slot in skip.slots if slot not in self.idle
            )
            if went:
                parts.append(f"{skip.backend} cannot run here ({skip.why}): {went}")
        return "attention auto: " + "; ".join(parts) if parts else None


def choose_attention(
    requested: Mapping[AttentionSlot, str | None],
    row: Generation,
    problems_of: Callable[[AttentionSlot, str], Sequence[str]],
) -> AttentionChoice:
    """Each slot ``requested`` leaves open (None) gets the first backend of ``row`` for it that
    ``problems_of`` finds no problem with; given slots stay as given."""
    routes: dict[AttentionSlot, str] = {}
    skipped: dict[str, tuple[list[AttentionSlot], str]] = {}
    for slot in SLOTS:
        given = requested[slot]
        if given is not None:
            routes[slot] = given
            continue
        candidates = row.preferences[slot]
        routes[slot] = candidates[-1]
        for name in candidates:
            problems = problems_of(slot, name)
            if not problems:
                routes[slot] = name
                break
            skipped.setdefault(name, ([], problems[0]))[0].append(slot)
    return AttentionChoice(
        routes=routes,
        chosen=frozenset(slot for slot in SLOTS if requested[slot] is None),
        generation=row.name,
        skipped=tuple(Skipped(name, tuple(slots), why) for name, (slots, why) in skipped.items()),
    )


def candidate_problems(
    registry: Registry, ctx: CheckContext
) -> Callable[[AttentionSlot, str], list[str]]:
    """What stops backend ``name`` in a slot under ``ctx``: the backend's own problems (its
    capabilities and its check, e.g. a package that is not installed) with the slot routed to
    it alone, and those the speculative algorithm names against the slot's flag (a tree mask,
    a non-causal block, host plans)."""

    def problems(slot: AttentionSlot, name: str) -> list[str]:
        phases = SLOT_PHASES[slot]
        routes = {p: name if p in phases else _ROUTED_NOWHERE for p in PHASES}
        slot_ctx = dataclasses.replace(ctx, attention_routes=routes)
        try:
            spec = registry.get("attention", name)
        except PluginError as exc:
            return [str(exc)]
        found = registry.check_spec(spec, slot_ctx, SLOT_FLAGS[slot])
        if ctx.speculative_algorithm != "none":
            found += [p for p in registry.check(slot_ctx) if p.option == SLOT_FLAGS[slot]]
        return [p.message for p in dict.fromkeys(found)]

    return problems


def choose_for(
    config: ServeConfig, dtype: str, capability: tuple[int, int] | None, registry: Registry
) -> AttentionChoice:
    """The attention routes of ``config`` run in ``dtype`` on this device (``capability`` on
    CUDA), each open slot chosen from the table."""
    ctx = config.check_context(dtype, capability, dict.fromkeys(PHASES, _ROUTED_NOWHERE))
    row = generation(config.device, capability)
    if capability is not None:
        row = dataclasses.replace(row, name=f"{row.name}, SM {capability[0]}.{capability[1]}")
    choice = choose_attention(config.requested_attention, row, candidate_problems(registry, ctx))
    used = set(registry.used_phases(ctx))  # the algorithm's alone, whatever the routes
    idle = frozenset(slot for slot in SLOTS if not used & set(SLOT_PHASES[slot]))
    return dataclasses.replace(choice, idle=idle)
