"""The front door's own serving counters: token totals and latency histograms, reported in
``ServerInfo`` next to the daemon's counters (the HTTP front renders them as ``/metrics``).

The front door is where a request arrives and where its frames leave, so latencies are taken
here, on one monotonic clock, per update (a step's tokens for one request), never per token:

| histogram                | observed                                        | requests      |
|--------------------------|-------------------------------------------------|---------------|
| ``time_to_first_token``  | arrival -> the update carrying its first tokens | all finished  |
| ``inter_token_latency``  | between two updates that carry tokens           | streamed      |
| ``e2e_request_latency``  | arrival -> its ``Finished``                     | all finished  |

A non-streamed request gets its tokens in its final update only: its first-token time is the
daemon's (``FinishInfo.first_token_at``, wall clock, one host), and it has no inter-token
times. A request ended with an ``Error`` is observed nowhere; one whose client vanished still
is (it runs to its final update).
"""

from __future__ import annotations

from bisect import bisect_left

from outrider.daemon.frontdoor.requests import LiveRequest
from outrider.daemon.internal import RequestUpdate
from outrider.protocol.messages import Finished, LatencyHistogram

# Fixed bucket upper bounds, seconds. Finer than vLLM's below 10 ms: a speculative step on
# a small model commits several tokens in a few milliseconds.
TTFT_BOUNDS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
    2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
ITL_BOUNDS = (
    0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
E2E_BOUNDS = (
    0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class Buckets:
    """One histogram being filled: a bisect and two additions per observation."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        # bisect_left: a value equal to a bound falls in that bound's bucket (le).
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def snapshot(self) -> LatencyHistogram:
        return LatencyHistogram(list(self.bounds), list(self.counts), self.sum)


class FrontDoorMetrics:
    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Buckets(TTFT_BOUNDS)
        self.itl = Buckets(ITL_BOUNDS)
        self.e2e = Buckets(E2E_BOUNDS)

    def on_update(self, req: LiveRequest, update: RequestUpdate, now: float) -> None:
        """``update`` of ``req`` reached the front door at ``now`` (``time.monotonic()``)."""
        if update.token_ids:
            self.generation_tokens += len(update.token_ids)
            if req.stream:
                if req.last_tokens_at is None:
                    self.ttft.observe(now - req.arrived_at)
                else:
                    self.itl.observe(now - req.last_tokens_at)
                req.last_tokens_at = now
        if update.finish is not None:
            self.prompt_tokens += update.finish.usage.prompt_tokens
            self.e2e.observe(now - req.arrived_at)
            first = update.finish.first_token_at
            if not req.stream and first > 0.0:
                self.ttft.observe(max(first - req.arrived_wall, 0.0))

    def on_finished_here(self, req: LiveRequest, final: Finished, now: float) -> None:
        """``req`` ended by the front door itself (the daemon never saw it)."""
        self.prompt_tokens += final.usage.prompt_tokens
        self.e2e.observe(now - req.arrived_at)
