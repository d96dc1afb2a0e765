"""The scheduler's counters: finishes by reason and speculative acceptance, reported with the
queue and KV occupancy as ``Counters``."""

from __future__ import annotations

from dataclasses import dataclass, field

from outrider.daemon.internal import Counters
from outrider.daemon.scheduler.radix import PrefixCache
from outrider.plugins.api import StepShape


@dataclass
class SpecCounters:
    """Speculative counters over requests' applied verify steps (prefill counts nothing)."""

    max_drafts: int
    drafts: int = 0  # verify results applied (one per request per step)
    draft_tokens: int = 0
    accepted_tokens: int = 0  # before finish truncation
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.max_drafts

    def record(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1


class SchedulerStats:
    def __init__(self, shape: StepShape) -> None:
        self.finished_by_reason: dict[str, int] = {}
        # Without speculation nothing is drafted: no positions, never recorded.
        self.spec = SpecCounters(shape.max_commit - 1)

    def finished(self, reason: str) -> None:
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1

    def verified(self, drafted: int, accepted: int) -> None:
        """One speculative row's verify result applied: ``accepted`` of its ``drafted``."""
        self.spec.record(drafted, accepted)

    def snapshot(self, running: int, waiting: int, cache: PrefixCache) -> Counters:
        spec = self.spec
        return Counters(
            running=running,
            waiting=waiting,
            kv_used_tokens=cache.used_pages() * cache.page_size,
            kv_total_tokens=cache.usable_pages * cache.page_size,
            prefix_cache_queries=cache.queries,
            prefix_cache_hits=cache.hits,
            requests_finished=dict(self.finished_by_reason),
            spec_drafts=spec.drafts,
            spec_draft_tokens=spec.draft_tokens,
            spec_accepted_tokens=spec.accepted_tokens,
            spec_accepted_per_position=list(spec.accepted_per_position),
        )
