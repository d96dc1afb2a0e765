"""``/metrics``: one ``ServerInfo`` snapshot in the Prometheus text format.

Nothing is counted here: every value is the daemon's (its scheduler's counters, and the
front door's token totals and latency histograms, frontdoor/metrics.py), read over the ZeroMQ
client at each scrape. Names and meanings follow vLLM's with the ``outrider:`` prefix; every
series carries ``model_name`` (the served model name). Counters are exposed with ``_total``.

| metric                                         | type      | from ``ServerInfo``             |
|------------------------------------------------|-----------|---------------------------------|
| num_requests_running / num_requests_waiting    | gauge     | running / waiting               |
| kv_cache_usage_perc                            | gauge     | kv_used / kv_total, in [0, 1]   |
| prefix_cache_queries / prefix_cache_hits       | counter   | in requests (vLLM: in tokens)   |
| prompt_tokens / generation_tokens              | counter   | the front door's totals         |
| request_success {finished_reason}              | counter   | requests_finished               |
| time_to_first_token_seconds                    | histogram | every finished request          |
| inter_token_latency_seconds                    | histogram | streamed requests only          |
| e2e_request_latency_seconds                    | histogram | every finished request          |
| spec_decode_num_drafts / _num_draft_tokens /   | counter   | only with a speculative plugin  |
| _num_accepted_tokens / _per_pos {position}     |           |                                 |
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from outrider.protocol.messages import LatencyHistogram, ServerInfo

PREFIX = "outrider:"


class _Snapshot(Collector):
    def __init__(self, info: ServerInfo, model_name: str) -> None:
        self._info = info
        self._labels = [model_name]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric(self._labels, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric(self._labels, value)
        return family

    def _histogram(self, name: str, doc: str, h: LatencyHistogram) -> HistogramMetricFamily:
        buckets: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip(h.bounds, h.counts, strict=False):
            total += count
            buckets.append((floatToGoString(bound), total))
        buckets.append(("+Inf", sum(h.counts)))
        family = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric(self._labels, buckets, h.sum)
        return family

    def collect(self) -> Iterator[Metric]:
        info = self._info
        yield self._gauge("num_requests_running", "Requests running.", info.running)
        yield self._gauge("num_requests_waiting", "Requests waiting.", info.waiting)
        usage = info.kv_used_tokens / info.kv_total_tokens if info.kv_total_tokens else 0.0
        yield self._gauge("kv_cache_usage_perc", "KV cache usage, 1 = full.", usage)
        yield self._counter(
            "prefix_cache_queries",
            "Prefix cache lookups, in requests (vLLM counts tokens).",
            info.prefix_cache_queries,
        )
        yield self._counter(
            "prefix_cache_hits",
            "Prefix cache lookups that reused a cached prefix, in requests.",
            info.prefix_cache_hits,
        )
        yield self._counter(
            "prompt_tokens", "Prompt tokens of finished requests.", info.prompt_tokens
        )
        yield self._counter("generation_tokens", "Generated tokens.", info.generation_tokens)
        success = CounterMetricFamily(
            PREFIX + "request_success",
            "Finished requests, by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        for reason, count in sorted(info.requests_finished.items()):
            success.add_metric([*self._labels, reason], count)
        yield success
        yield self._histogram(
            "time_to_first_token_seconds",
            "Arrival to first token, streamed requests.",
            info.time_to_first_token,
        )
        yield self._histogram(
            "inter_token_latency_seconds",
            "Time between two outputs of a streamed request.",
            info.inter_token_latency,
        )
        yield self._histogram(
            "e2e_request_latency_seconds",
            "Arrival to the final frame, finished requests.",
            info.e2e_request_latency,
        )
        if info.plugins.get("speculative", "none") != "none":
            yield from self._speculative()

    def _speculative(self) -> Iterator[Metric]:
        info = self._info
        yield self._counter("spec_decode_num_drafts", "Verify steps applied.", info.spec_drafts)
        yield self._counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified.", info.spec_draft_tokens
        )
        yield self._counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted.", info.spec_accepted_tokens
        )
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(info.spec_accepted_per_position):
            per_pos.add_metric([*self._labels, str(position)], count)
        yield per_pos


def render_metrics(info: ServerInfo, model_name: str) -> bytes:
    """The Prometheus text exposition of ``info``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(info, model_name))
    return generate_latest(registry)
