"""Fault soak: the real daemon (three processes, real sockets) under mixed traffic and faults at
once, for OUTRIDER_SOAK_SECONDS (default 30; a longer soak sets more), then checks that nothing
was lost, leaked or changed. Concurrently (tests/soak_workers.py):

- async and blocking clients send generate / stream requests from a seeded pool (greedy and
  seeded sampling, stop strings and tokens, logprobs, prompts and input ids, long outputs);
- aborts: abort() then read on, cancelled calls, closed and dropped streams, timeouts;
- clients closed with streams and generates in flight, a new one opened at once, and the
  tight ``Client(); health(); close(); Client(); generate(timeout=10)`` loop;
- malformed frames from raw DEALER sockets (garbage, wrong version or kind, invalid UTF-8,
  20,000-deep nesting, multi-part, out-of-range fields), and a frame over the size limit;
- a client process that streams and is SIGKILLed mid-way, restarted, again and again;
- a client that starts long streams and stops reading for longer than the front door waits
  for a slow consumer, then reads on: each ends once, finished or ``slow_consumer``.

Afterwards: every waited request got exactly one final frame and none was lost; the daemon
serves with its three processes alive; its counters add up with what it logged; its KV is back
in the prefix cache; a fixed set of greedy and seeded requests gives the same tokens as before;
RSS stayed bounded (the daemon's trend within the soak from 90 s of traffic); the log has no
Traceback and no ERROR.

``OUTRIDER_SOAK_SKIP=utf8,nesting`` leaves fault categories out (BadFrame categories, and
abort, disconnect, reconnect, kill, oversize, stall), to chase one failure at a time.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import Daemon, async_poll_until, build_model_dir
from soak_harness import (
    build_pool,
    determinism_problems,
    error_lines,
    finished_lines,
    fixed_set,
    output_key,
    process_alive,
    retracted_ids,
    rss_of,
    tracebacks,
)
from soak_workers import WAIT_S, Soak, run_soak, send_async, send_fixed

from outrider.protocol import AsyncClient, GenerateResult, ServerInfo
from outrider.protocol.messages import Ack, Error, Health

SOAK_SECONDS = float(os.environ.get("OUTRIDER_SOAK_SECONDS", "30"))
CONTEXT = 1024
PAGE_SIZE = 4  # daemon_harness.Daemon's --page-size
MAX_MESSAGE_BYTES = 65536
SOAK_ARGS = (
    "--context-length", str(CONTEXT),
    "--kv-cache-tokens", "8192",  # eight contexts: short requests never queue behind long ones
    "--max-message-bytes", str(MAX_MESSAGE_BYTES),
    "--log-level", "debug",  # a line per finished request, which the checks read
)  # fmt: skip
# Retract the youngest running request every 50 steps: retraction and re-admission meet the
# aborts and disconnects (the pool itself never runs out).
SOAK_ENV = {"OUTRIDER_DEBUG_RETRACT_EVERY": "50"}
# RSS bounds (kB), from 120 s soaks (about 7,400 requests) and one of 360 s on 2 CPU cores. The
# daemon's RSS swings by +-20 MB between samples (torch's allocations per batch) and settles
# 15-20 MB above the warmed-up baseline whatever the soak's length; the front door ends 1.0-1.6
# MB above, the detokenizer 0.1-0.2 MB. GROWTH bounds baseline -> idle after the soak. TREND
# bounds the median of the samples of the soak's last third over that of its middle third
# (about 2,500 requests apart), which moved by -9..+4 MB in the daemon, under 0.25 MB in the
# children: 16 MB is a leak of 6 KB a request in the daemon, 3 MB of 1.2 KB in a child. The
# daemon settles over its first 30 s or so: in a soak that short its last third still rose
# 3.6-18.3 MB over the middle one (six 30 s soaks, three of them at e4a5722), so its trend is
# checked from TREND_SECONDS of traffic on (the children's from any length); its growth bound
# holds at any length.
RSS_GROWTH_KB = {"daemon": 64_000, "frontdoor": 16_000, "detokenizer": 16_000}
RSS_TREND_KB = {"daemon": 16_000, "frontdoor": 3_000, "detokenizer": 3_000}
TREND_SECONDS = {"daemon": 90.0, "frontdoor": 0.0, "detokenizer": 0.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture
def soak_daemon(model_dir: Path, tmp_path: Path) -> Iterator[Daemon]:
    daemon = Daemon(model_dir, tmp_path / "soak", *SOAK_ARGS, env=SOAK_ENV, name="soak")
    try:
        daemon.wait_serving()
        yield daemon
    finally:
        daemon.kill_all()


@pytest.mark.e2e
@pytest.mark.timeout(SOAK_SECONDS + 300)
async def test_fault_soak(soak_daemon: Daemon, model_dir: Path) -> None:
    daemon = soak_daemon
    pids = {
        "daemon": daemon.pid,
        "frontdoor": daemon.child_pid("frontdoor"),
        "detokenizer": daemon.child_pid("detokenizer"),
    }
    soak = Soak(daemon, build_pool(model_dir, seed=2026), CONTEXT, MAX_MESSAGE_BYTES)
    async with soak.async_client() as observer:
        # Warm up (the allocators' high-water marks), then take the baseline.
        fixed_before = await send_fixed(soak, observer, "fixed-before")
        await asyncio.gather(*(send_async(soak, observer, "warm", s, True) for s in soak.pool))
        before = await _wait_idle(soak, observer)
        rss_before, log_start = rss_of(pids), len(daemon.log())
        pre_soak = set(soak.ledger.sent)

        soak.until = time.monotonic() + SOAK_SECONDS
        started = time.monotonic()
        await run_soak(soak, pids)
        traffic_s = time.monotonic() - started
        if soak.died:
            pytest.fail(_report(soak, daemon.log()), pytrace=False)

        idle = await _wait_idle(soak, observer)
        fixed_after = await send_fixed(soak, observer, "fixed-after")
        fixed_cached = await send_fixed(soak, observer, "fixed-cached")
        after = await _wait_idle(soak, observer)
        health = await observer.health(timeout=10)
    log = daemon.log()
    rss_after = rss_of(pids)
    window = list(finished_lines(log[log_start:]))
    print(f"\nsoak: {traffic_s:.0f} s of traffic, {len(soak.ledger.sent)} requests, "
          f"{dict(soak.tally.counts)}; the daemon finished "
          f"{dict(Counter(reason for _, reason in window))}")  # fmt: skip

    ledger = soak.ledger
    _check_frames_and_losses(soak, log[log_start:])
    _check_counters(soak, before, after, window, pre_soak)
    _check_fixed(soak, fixed_before, fixed_after, fixed_cached, retracted_ids(log))
    ledger.problems += determinism_problems(ledger)
    if health.status != "serving":
        ledger.problem(f"health after the soak: {health}")
    ledger.problems += [f"the {name} process is gone" for name, pid in pids.items()
                        if not process_alive(pid)]  # fmt: skip
    for info in (idle, after):  # idle, every page is free or cached: none is in use
        if info.kv_used_tokens != before.kv_used_tokens:
            ledger.problem(f"idle, {info.kv_used_tokens} KV tokens in use; "
                           f"{before.kv_used_tokens} before the soak: pages leaked")  # fmt: skip
    _check_rss(soak, rss_before, rss_after)
    ledger.problems += [f"log: {line}" for line in error_lines(log)]
    if ledger.problems:
        pytest.fail(_report(soak, log), pytrace=False)
    assert daemon.stop() == 0, log[-4000:]


async def _wait_idle(soak: Soak, client: AsyncClient) -> ServerInfo:
    last: list[ServerInfo] = []

    async def idle() -> ServerInfo | None:
        last[:] = [await client.server_info(timeout=10)]
        return last[0] if last[0].running == last[0].waiting == 0 else None

    try:
        return await async_poll_until(idle, WAIT_S, "the daemon going idle", interval=0.2)
    except TimeoutError as exc:
        pytest.fail(f"{exc}: {last}\n{_report(soak, soak.daemon.log())}", pytrace=False)


def _report(soak: Soak, log: str) -> str:
    problems = soak.ledger.problems
    if soak.died:  # calls failing with connection_lost are its echo
        echo = [p for p in problems if "connection_lost" in p]
        problems = [
            soak.died,
            f"the malformed frame awaiting its answer: {soak.bad_frame_in_flight or 'none'}",
            *(p for p in problems[: soak.problems_before_death] if p not in echo),
            f"({len(problems) - soak.problems_before_death} more problems after the death, "
            f"{len(echo)} calls ended with connection_lost)",
        ]
    kinds = Counter(p.split(":")[0].split(" (")[0].rstrip("0123456789-") for p in problems)
    shown = "\n".join(problems[:40])
    errors = "\n".join(error_lines(log)[:30])
    first = "\n".join(tracebacks(log)[:2])
    return (
        f"{len(problems)} problems {dict(kinds)}:\n{shown}\n--- log errors ---\n{errors}\n"
        f"--- first tracebacks ---\n{first}"
    )


def _check_rss(soak: Soak, before: dict[str, int], after: dict[str, int]) -> None:
    third = max(1, len(soak.rss) // 3)
    thirds = [soak.rss[:third], soak.rss[third:-third], soak.rss[-third:]]
    for name in RSS_GROWTH_KB:
        medians = [statistics.median([r[name] for _, r in part] or [0]) for part in thirds]
        print(f"RSS {name}: {before[name]} kB before, medians by third {medians} kB, "
              f"{after[name]} kB after")  # fmt: skip
        if after[name] - before[name] > RSS_GROWTH_KB[name]:
            soak.ledger.problem(f"{name} RSS grew {before[name]} -> {after[name]} kB")
        if TREND_SECONDS[name] > SOAK_SECONDS:
            print(f"RSS {name}: its trend is checked from {TREND_SECONDS[name]:g} s of traffic")
        elif medians[2] - medians[1] > RSS_TREND_KB[name]:
            soak.ledger.problem(f"{name} RSS kept growing: medians by third {medians} kB")


def _check_frames_and_losses(soak: Soak, log: str) -> None:
    """One final frame per waited request, none after a final, nothing lost."""
    ledger, frames = soak.ledger, soak.frames
    for entry in ledger.sent.values():
        problem = frames.sequence_problem(entry.request_id, entry.waited)
        if problem is not None and entry.outcome != "lost":  # a lost one is reported below
            ledger.problem(problem)
    for request_id, replies in frames.frames.items():
        if request_id not in ledger.sent and not all(
            isinstance(r, Health | ServerInfo | Ack | Error) for r in replies
        ):
            ledger.problem(f"frames for {request_id!r}, a request nobody sent: {replies}")
    if frames.undecodable:
        ledger.problem(f"{frames.undecodable} undecodable reply frames")
    logged = dict(finished_lines(log))
    for entry in ledger.lost():
        seen = logged.get(entry.request_id, "never finished")
        ledger.problem(f"lost {entry.request_id} ({entry.source}): the daemon says {seen}; "
                       f"{len(frames.frames.get(entry.request_id, []))} frames came")  # fmt: skip
    for what in ledger.lost_calls:
        ledger.problem(f"lost call: {what}")


def _check_counters(
    soak: Soak,
    before: ServerInfo,
    after: ServerInfo,
    window: list[tuple[str, str]],
    pre_soak: set[str],
) -> None:
    """requests_finished grew by what the daemon logged as finished plus the front door's
    own finals (max_new_tokens=0); each request is finished once, as its client saw it, and
    the requests given up are aborted."""
    ledger = soak.ledger
    entries = [e for rid, e in ledger.sent.items() if rid not in pre_soak]
    zero = sum(1 for e in entries if e.spec.max_new_tokens == 0 and e.result is not None)
    expected = Counter(reason for _, reason in window)
    expected["length"] += zero
    delta = {r: after.requests_finished[r] - before.requests_finished[r] for r in expected}
    if delta != dict(expected) or set(after.requests_finished) != {"stop", "length", "abort"}:
        ledger.problem(f"requests_finished grew by {delta}; the daemon logged {dict(expected)}")
    times = Counter(rid for rid, _ in window)
    reasons = dict(window)
    for rid, count in times.items():
        if count > 1 or rid not in ledger.sent:
            ledger.problem(
                f"{rid}: finished {count} times in the daemon, sent: {rid in ledger.sent}"
            )
    for entry in entries:
        rid, result = entry.request_id, entry.result
        if entry.spec.max_new_tokens == 0:
            continue
        if result is not None and reasons.get(rid) != result.finish_reason:
            ledger.problem(f"{rid}: the client got {result.finish_reason!r}, the daemon "
                           f"logged {reasons.get(rid)!r}")  # fmt: skip
        elif entry.reached and rid not in reasons:
            ledger.problem(f"{rid} ({entry.source}): reached the daemon, never finished")
        # Every request given up runs to the context limit (long_spec, killed_spec): only the
        # abort its client sent, or the front door sent for a vanished client, ends it soon.
        if not entry.waited and reasons.get(rid, "abort") != "abort":
            ledger.problem(f"{rid} ({entry.source}): given up, yet it ended {reasons[rid]!r}")


def _check_fixed(
    soak: Soak,
    before: list[GenerateResult | None],
    after: list[GenerateResult | None],
    cached: list[GenerateResult | None],
    retracted: set[str],
) -> None:
    """Same tokens before and after the soak; the second pass after it hits the prefix cache
    for every whole page of its prompt but the last token.

    NOTE: a request retracted while its last step is in flight finishes from the waiting queue
    with its KV already released unpublished, so its prompt is not cached: the cache check
    skips prompts whose first pass after the soak was retracted (OUTRIDER_DEBUG_RETRACT_EVERY).
    """
    ledger, checked = soak.ledger, 0
    for spec, first, second, third in zip(fixed_set(), before, after, cached, strict=True):
        if first is None or second is None or third is None:
            continue  # already a problem
        if not output_key(first) == output_key(second) == output_key(third):
            ledger.problem(f"fixed {spec}: {first.output_ids} before, {second.output_ids} after")
        if second.request_id in retracted:
            continue
        checked += 1
        prompt = third.usage.prompt_tokens
        if third.usage.cached_tokens != (prompt - 1) // PAGE_SIZE * PAGE_SIZE:
            ledger.problem(f"fixed {spec}: {third.usage.cached_tokens} of {prompt} prompt "
                           "tokens from the prefix cache on a repeat")  # fmt: skip
    if checked < len(after) // 2:
        ledger.problem(f"only {checked} of {len(after)} fixed requests ran unretracted")
