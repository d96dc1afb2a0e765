"""``/metrics``: the daemon's counters in the Prometheus text format, parsed back with
prometheus_client's own parser; the counters move exactly as the requests sent say."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from http_harness import API_KEY, AUTH, FAMILY, HttpDaemon
from prometheus_client.parser import text_string_to_metric_families

from outrider.daemon.frontdoor.metrics import Buckets
from outrider.daemon.http.metrics import render_metrics
from outrider.protocol.messages import ServerInfo

MODEL = "outrider-family"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, labels other than model_name) -> value."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name") == MODEL
            samples[s.name, tuple(sorted(labels.items()))] = s.value
    return samples


def test_buckets_are_upper_inclusive_and_render_cumulative() -> None:
    buckets = Buckets((0.1, 1.0))
    for seconds in (0.05, 0.1, 0.5, 1.0, 3.0):
        buckets.observe(seconds)
    assert buckets.counts == [2, 2, 1]
    info = ServerInfo(
        "r", "b", "m", {}, {"speculative": "none"}, 1, 2, 30, 120, 0, 0, {"stop": 4},
        e2e_request_latency=buckets.snapshot(),
    )  # fmt: skip
    samples = _samples(render_metrics(info, MODEL).decode())
    e2e = "outrider:e2e_request_latency_seconds"
    assert [samples[f"{e2e}_bucket", (("le", le),)] for le in ("0.1", "1.0", "+Inf")] == [2, 4, 5]
    assert samples[f"{e2e}_count", ()] == 5 and samples[f"{e2e}_sum", ()] == pytest.approx(4.65)
    assert samples["outrider:kv_cache_usage_perc", ()] == 0.25
    assert samples["outrider:request_success_total", (("finished_reason", "stop"),)] == 4
    assert not any(name.startswith("outrider:spec_decode") for name, _ in samples)
    # A histogram never filled (the default) renders as an empty one.
    assert samples["outrider:time_to_first_token_seconds_count", ()] == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    # n-gram speculation verifies with the target alone: the speculative counters move.
    http = HttpDaemon(tmp_path_factory.mktemp("metrics"), "--api-key", API_KEY, speculative="ngram")
    try:
        yield http
        assert http.daemon.stop() == 0, http.daemon.log()
    finally:
        http.daemon.kill_all()


def _streamed_usage(server: HttpDaemon, body: dict[str, Any]) -> dict[str, Any]:
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream(
        "POST", server.base + "/v1/completions", json=body, headers=headers
    ) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage: dict[str, Any] = json.loads(events[-2])["usage"]
    return usage


def _delta(after: dict[Any, float], before: dict[Any, float], name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)


@pytest.mark.e2e
@pytest.mark.skipif(FAMILY is None, reason="the embedded family is not installed")
def test_counters_move_as_the_requests_say(server: HttpDaemon) -> None:
    scrape = lambda: httpx.get(server.base + "/metrics", headers=AUTH)  # noqa: E731
    # With --api-key, /metrics needs it too (a scrape configuration can send a bearer token).
    assert httpx.get(server.base + "/metrics").status_code == 401
    first = scrape()
    assert first.status_code == 200 and first.headers["content-type"].startswith("text/plain")
    before = _samples(first.text)
    prompts = ["The sea", "Once upon a time there was", "A B A B A B A B"]
    usages = [
        _streamed_usage(server, {"prompt": p, "max_tokens": 5, "ignore_eos": True}) for p in prompts
    ]
    # One non-streamed request: counted in tokens, TTFT (the daemon's) and E2E, not in ITL.
    plain = httpx.post(
        server.base + "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 4, "ignore_eos": True},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()["usage"]
    after = _samples(scrape().text)

    def delta(name: str, **labels: str) -> float:
        return _delta(after, before, name, **labels)

    assert [u["completion_tokens"] for u in usages] == [5, 5, 5]
    assert delta("outrider:generation_tokens_total") == 15 + 4
    prompt_tokens = sum(u["prompt_tokens"] for u in usages) + plain["prompt_tokens"]
    assert delta("outrider:prompt_tokens_total") == prompt_tokens
    assert delta("outrider:request_success_total", finished_reason="length") == 4
    assert delta("outrider:request_success_total", finished_reason="stop") == 0
    assert delta("outrider:time_to_first_token_seconds_count") == 4
    assert delta("outrider:e2e_request_latency_seconds_count") == 4
    # Each streamed request: one gap per output after its first, at most one per token.
    itl = delta("outrider:inter_token_latency_seconds_count")
    assert 3 <= itl <= 3 * 4
    assert after["outrider:num_requests_running", ()] == 0
    assert after["outrider:num_requests_waiting", ()] == 0
    for histogram in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        name = f"outrider:{histogram}_seconds"
        counts = [v for (n, _), v in after.items() if n == f"{name}_bucket"]
        assert counts == sorted(counts) and counts[-1] == after[f"{name}_count", ()]
    # The speculative counters are the sums of the requests' own.
    usages.append(plain)
    drafts = sum(u.get("spec_drafts", 0) for u in usages)
    accepted = sum(u.get("spec_accepted_tokens", 0) for u in usages)
    assert drafts > 0
    assert delta("outrider:spec_decode_num_drafts_total") == drafts
    assert delta("outrider:spec_decode_num_accepted_tokens_total") == accepted
    per_pos = "outrider:spec_decode_num_accepted_tokens_per_pos_total"
    positions = [labels for name, labels in after if name == per_pos]
    assert sum(delta(per_pos, **dict(labels)) for labels in positions) == accepted
    assert delta("outrider:spec_decode_num_draft_tokens_total") >= drafts
