"""The ``ServerInfo`` reply: the model facts, the daemon's counters and the front door's own
(finals it gave, token totals, latency histograms), and the sampling defaults in
``configuration["sampling_defaults"]``."""

from __future__ import annotations

from collections.abc import Mapping

from outrider.daemon.frontdoor.metrics import FrontDoorMetrics
from outrider.daemon.internal import Counters, ModelFacts
from outrider.daemon.sampling_defaults import SamplingDefaults
from outrider.protocol.messages import ServerInfo

FINISH_REASONS = ("stop", "length", "abort")


def server_info(
    request_id: str,
    boot_id: str,
    facts: ModelFacts,
    c: Counters,
    finished_here: Mapping[str, int],
    defaults: SamplingDefaults,
    metrics: FrontDoorMetrics,
) -> ServerInfo:
    """``finished_here``: the finals the front door gave without the daemon, by reason."""
    sampling_defaults = {
        "temperature": defaults.temperature,
        "top_p": defaults.top_p,
        "top_k": defaults.top_k,
        "source": defaults.source,
    }
    return ServerInfo(
        request_id=request_id,
        boot_id=boot_id,
        model=facts.model,
        configuration=facts.configuration | {"sampling_defaults": sampling_defaults},
        plugins=facts.plugins,
        running=c.running,
        waiting=c.waiting,
        kv_used_tokens=c.kv_used_tokens,
        kv_total_tokens=c.kv_total_tokens,
        prefix_cache_queries=c.prefix_cache_queries,
        prefix_cache_hits=c.prefix_cache_hits,
        requests_finished=requests_finished(c, finished_here),
        spec_drafts=c.spec_drafts,
        spec_draft_tokens=c.spec_draft_tokens,
        spec_accepted_tokens=c.spec_accepted_tokens,
        spec_accepted_per_position=c.spec_accepted_per_position,
        prompt_tokens=metrics.prompt_tokens,
        generation_tokens=metrics.generation_tokens,
        time_to_first_token=metrics.ttft.snapshot(),
        inter_token_latency=metrics.itl.snapshot(),
        e2e_request_latency=metrics.e2e.snapshot(),
    )


def requests_finished(c: Counters, finished_here: Mapping[str, int]) -> dict[str, int]:
    """The daemon's count plus the finals given by the front door.

    NOTE: the daemon counts a request when it emits its final update, before any client can
    receive that final, and a client asks only after receiving it; so whatever final frame the
    caller has received is counted, and so is a request whose client vanished.
    """
    counts = dict.fromkeys(FINISH_REASONS, 0)
    for source in (c.requests_finished, finished_here):
        for reason, count in source.items():
            counts[reason] = counts.get(reason, 0) + count
    return counts
