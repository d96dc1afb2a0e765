"""End to end: the real daemon (``outrider serve``: daemon, front door and detokenizer
processes, real ``ipc://`` sockets) serving many requests.

One module-scoped daemon serves the tests that can share it; the lifecycle tests start their
own. Expected tokens come from the in-process engine (tests/engine_harness.py) built on the
same model directory with the same page size and context length.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio
import zmq.auth
from daemon_harness import (
    MODEL_CONTEXT,
    START_TIMEOUT_S,
    Daemon,
    NotifySocket,
    RawDealer,
    RecordingClient,
    UnreadClient,
    async_poll_until,
    build_model_dir,
    daemons,
    poll_until,
)
from e2e_workload import (
    VOCAB,
    Expected,
    Reference,
    Spec,
    Workload,
    build_workload,
    check_result,
)
from model_fixtures import save_random_dflash, save_random_eagle3

from outrider.daemon.config import EXIT_CONFIG
from outrider.protocol import (
    AsyncClient,
    Client,
    GenerateResult,
    RequestError,
    ServerInfo,
    Timeout,
)
from outrider.protocol.frames import request_codec
from outrider.protocol.messages import Ack, Error, Finished

CONTEXT = 1024  # the shared daemon's --context-length
SHARED_ARGS = (
    "--context-length", str(CONTEXT),
    "--kv-cache-tokens", "1040",  # a context and a page: concurrent requests retract
    "--max-message-bytes", "8192",
)  # fmt: skip


# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def shared_process(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The shared daemon, started (not yet serving: the reference is built meanwhile)."""
    daemon = Daemon(model_dir, tmp_path_factory.mktemp("shared"), *SHARED_ARGS)
    try:
        yield daemon
        code = daemon.stop()
    finally:
        daemon.kill_all()
    log = daemon.log()
    if not daemon.served:
        return  # it never got to serve: the test that waited for it reported why
    assert code == 0, log[-4000:]
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    with torch.no_grad():
        return Reference(model_dir, CONTEXT)


@pytest.fixture(scope="module")
def workload(reference: Reference) -> Workload:
    with torch.no_grad():
        return build_workload(reference)


@pytest.fixture(scope="module")
def shared(shared_process: Daemon, workload: Workload) -> Daemon:
    shared_process.wait_serving()
    return shared_process


# --- checks -------------------------------------------------------------------------------


async def _submit(
    client: AsyncClient, spec: Spec, request_id: str, stream: bool
) -> tuple[GenerateResult, list[Any]]:
    """One request; for a stream, also its chunks (checked to add up to the result)."""
    if not stream:
        return await client.generate(request_id=request_id, **spec.kwargs()), []
    chunks = []
    tokens = client.stream(request_id=request_id, **spec.kwargs())
    async for chunk in tokens:
        assert chunk.request_id == request_id
        assert chunk.token_ids or chunk.text, "an empty chunk"
        chunks.append(chunk)
    result = tokens.result
    assert result is not None
    assert [t for c in chunks for t in c.token_ids] == result.output_ids
    assert "".join(c.text for c in chunks) == result.text
    if spec.logprobs:
        assert [lp for c in chunks for lp in c.logprobs] == result.logprobs
    else:
        assert all(c.logprobs is None for c in chunks)
    return result, chunks


async def _info(client: AsyncClient) -> ServerInfo:
    return await client.server_info(timeout=10)


async def _wait_idle(client: AsyncClient) -> ServerInfo:
    async def idle() -> ServerInfo | None:
        info = await _info(client)
        return info if info.running == info.waiting == info.kv_used_tokens == 0 else None

    return await async_poll_until(idle, 20.0, "the daemon going idle")


def _delta(after: ServerInfo, before: ServerInfo) -> dict[str, int]:
    reasons = ("stop", "length", "abort")
    assert set(after.requests_finished) == set(reasons)
    return {r: after.requests_finished[r] - before.requests_finished[r] for r in reasons}


# --- 1. concurrency and correctness -------------------------------------------------------


@pytest.mark.e2e
async def test_many_concurrent_requests_match_the_engine(
    shared: Daemon, workload: Workload, reference: Reference
) -> None:
    jobs: list[tuple[str, Spec, Expected | None, bool]] = []
    for i, (case, expected) in enumerate(zip(workload.cases, workload.expected, strict=True)):
        jobs.append((f"case{i}-generate", case, expected, False))
        jobs.append((f"case{i}-stream", case, expected, True))
    zero = Spec("prompt", "hello", max_new_tokens=0)
    jobs += [("zero-generate", zero, None, False), ("zero-stream", zero, None, True)]
    assert len(jobs) >= 64
    async with RecordingClient(shared.endpoint) as one, RecordingClient(shared.endpoint) as two:
        clients = [one, two]
        before = await _info(one)
        results = await asyncio.gather(
            *(
                _submit(clients[i % 2], spec, request_id, stream)
                for i, (request_id, spec, _, stream) in enumerate(jobs)
            )
        )
        after = await _wait_idle(one)

    expected_reasons: Counter[str] = Counter()
    by_id: dict[str, GenerateResult] = {}
    for (request_id, spec, want, _), (result, chunks) in zip(jobs, results, strict=True):
        by_id[request_id] = result
        if want is None:  # max_new_tokens=0: answered at once, no chunks
            assert result.output_ids == [] and result.text == "" and chunks == []
            assert result.finish_reason == "length"
            assert result.usage.prompt_tokens == len(reference.input_ids(spec))
            expected_reasons["length"] += 1
            continue
        check_result(result, spec, want, request_id, reference.decode)
        expected_reasons[want.reason] += 1
    # Both submissions of a case agree (greedy and seeded sampling alike).
    for i in range(len(workload.cases)):
        assert by_id[f"case{i}-generate"].output_ids == by_id[f"case{i}-stream"].output_ids
    # The workload reaches every finish path it means to: each stop string and stop token
    # matches, and one sampled request ends at EOS.
    for spec, want in zip(workload.cases, workload.expected, strict=True):
        if spec.stop:
            assert want.reason == "stop" and want.matched_stop == spec.stop[-1], spec
        elif spec.stop_token_ids:
            assert want.reason == "stop" and want.matched_stop == spec.stop_token_ids[0], spec
    eos = [w for s, w in zip(workload.cases, workload.expected, strict=True) if s.temperature > 1]
    assert [(w.reason, w.matched_stop in (1, 2)) for w in eos] == [("stop", True)]

    assert _delta(after, before) == {
        "stop": expected_reasons["stop"],
        "length": expected_reasons["length"],
        "abort": 0,
    }
    assert after.kv_total_tokens == 1040
    # Every request that reached the daemon looked up the prefix cache (once per admission).
    assert after.prefix_cache_queries - before.prefix_cache_queries >= 2 * len(workload.cases)
    # Exactly one final frame per request, and it is the last frame of its request.
    for i, (request_id, *_rest) in enumerate(jobs):
        frames = clients[i % 2].frames[request_id]
        assert [isinstance(f, Finished) for f in frames] == [False] * (len(frames) - 1) + [True]
    job_ids = {request_id for request_id, *_ in jobs}
    for client in clients:
        assert client.undecodable == 0
        # Beside the jobs' frames: server_info answers, and the probes of a loaded daemon.
        others = [f for rid, frames in client.frames.items() if rid not in job_ids for f in frames]
        assert all(isinstance(f, ServerInfo) or f == Ack("") for f in others), [
            f for f in others if not isinstance(f, ServerInfo)
        ]


@pytest.mark.e2e
@pytest.mark.parametrize("algorithm", ["ngram", "eagle3", "dflash"])
async def test_speculative_daemon_serves_the_workload_losslessly(
    spawn: Callable[..., Daemon],
    workload: Workload,
    reference: Reference,
    algorithm: str,
    tmp_path: Path,
) -> None:
    """The whole mixed workload (greedy, seeded sampling, stop strings and tokens, EOS,
    logprobs, chat) through a daemon drafting with each algorithm (random drafts): results
    equal the target-only engine's, and the speculative counters add up."""
    flags = ["--speculative-algorithm", algorithm, "--speculative-num-draft-tokens", "5"]
    if algorithm == "eagle3":
        flags += ["--draft-model", str(save_random_eagle3(tmp_path / "draft"))]
    elif algorithm == "dflash":
        flags += ["--draft-model", str(save_random_dflash(tmp_path / "draft", block_size=5))]
    daemon = spawn(algorithm, *SHARED_ARGS, *flags)
    daemon.wait_serving()
    jobs = [
        (f"case{i}-{'stream' if stream else 'generate'}", case, expected, stream)
        for i, (case, expected) in enumerate(zip(workload.cases, workload.expected, strict=True))
        for stream in (False, True)
    ]
    async with AsyncClient(daemon.endpoint) as client:
        info = await _info(client)
        assert info.configuration["speculative_num_draft_tokens"] == 5
        assert info.plugins["speculative"] == algorithm
        results = await asyncio.gather(
            *(_submit(client, spec, rid, stream) for rid, spec, _, stream in jobs)
        )
        after = await _wait_idle(client)
    for (request_id, spec, want, _), (result, _chunks) in zip(jobs, results, strict=True):
        check_result(result, spec, want, request_id, reference.decode)
    usages = [result.usage for result, _ in results]
    assert after.spec_drafts == sum(u.spec_drafts for u in usages) > 0
    assert after.spec_accepted_tokens == sum(u.spec_accepted_tokens for u in usages)
    if algorithm == "ngram":  # the random drafts may never agree with the target
        assert after.spec_accepted_tokens > 0
    # Each verify row drafted 4, 2 or 1 tokens (the drafting policy cuts the chain where the
    # random drafts' acceptance makes a shorter one pay); the first cycles, of kinds not yet
    # measured, the whole chain.
    assert after.spec_drafts < after.spec_draft_tokens <= 4 * after.spec_drafts
    assert sum(after.spec_accepted_per_position) == after.spec_accepted_tokens
    assert daemon.stop() == 0
    assert "Traceback" not in daemon.log()


# --- 2. bad input -------------------------------------------------------------------------

BAD_REQUESTS: list[tuple[str, dict[str, Any], str, str]] = [
    # (name, generate() arguments, code, text the message must contain)
    ("id-too-big", {"input_ids": [5, 300]}, "invalid_request",
     "input_ids[1] = 300 is out of range: vocab_size is 300"),
    ("id-negative", {"input_ids": [5, -1]}, "invalid_request", "`$.input_ids[1]`"),
    ("prompt-id-too-big", {"prompt": "héllo"}, "invalid_request",
     "prompt token 2 (id 301 from the tokenizer) is out of range: vocab_size is 300"),
    ("empty-ids", {"input_ids": []}, "invalid_request",
     "input_ids is empty: the prompt has no tokens"),
    ("empty-messages", {"messages": []}, "invalid_request", "messages is an empty list"),
    ("too-long", {"input_ids": [5] * CONTEXT}, "prompt_too_long",
     f"input_ids is {CONTEXT} tokens; the context length is {CONTEXT}"),
    ("bad-role", {"messages": [{"role": "robot", "content": "hi"}]}, "invalid_request",
     "messages: chat template failed: TemplateError: unknown role robot"),
    ("temperature-tiny", {"input_ids": [5], "temperature": 1e-6}, "invalid_request",
     "temperature must be 0 (greedy) or in [1e-05, 100], got 1e-06"),
    ("temperature-big", {"input_ids": [5], "temperature": 100.5}, "invalid_request",
     "Expected `float` <= 100.0 - at `$.temperature`"),
    ("temperature-nan", {"input_ids": [5], "temperature": math.nan}, "invalid_request",
     "`$.temperature`"),
    ("top-p-zero", {"input_ids": [5], "top_p": 0.0}, "invalid_request",
     "Expected `float` > 0.0 - at `$.top_p`"),
    ("top-p-big", {"input_ids": [5], "top_p": 1.5}, "invalid_request",
     "Expected `float` <= 1.0 - at `$.top_p`"),
    ("top-k-big", {"input_ids": [5], "top_k": VOCAB + 1}, "invalid_request",
     f"top_k must be 0 (off) or in [1, {VOCAB}] (vocab_size), got {VOCAB + 1}"),
    ("logprobs-21", {"input_ids": [5], "logprobs": 21}, "invalid_request",
     "Expected `int` <= 20 - at `$.logprobs`"),
    ("seed-2^63", {"input_ids": [5], "seed": 2**63}, "invalid_request",
     "Expected `int` <= 9223372036854775807 - at `$.seed`"),
    ("max-new-negative", {"input_ids": [5], "max_new_tokens": -1}, "invalid_request",
     "Expected `int` >= 0 - at `$.max_new_tokens`"),
    ("17-stops", {"input_ids": [5], "stop": [f"s{i}" for i in range(17)]}, "invalid_request",
     "Expected `array` of length <= 16 - at `$.stop`"),
    ("empty-stop", {"input_ids": [5], "stop": ["ok", ""]}, "invalid_request",
     "stop[1] is an empty string"),
    ("long-stop", {"input_ids": [5], "stop": ["x" * 257]}, "invalid_request",
     "stop[0] has 257 characters; the limit is 256"),
    ("stop-token-big", {"input_ids": [5], "stop_token_ids": [7, 300]}, "invalid_request",
     "stop_token_ids[1] = 300 is out of range: vocab_size is 300"),
]  # fmt: skip


def _body(**fields: Any) -> bytes:
    return msgspec.msgpack.encode(fields)


async def _raw_frames(endpoint: str) -> None:
    """Frames that are not valid requests, each answered with a typed error."""
    header = request_codec().header
    version = header[0] & 0x0F
    generate = {"type": "generate", "request_id": "raw-1", "input_ids": [5]}
    ctx = zmq.asyncio.Context()
    try:
        raw = RawDealer(ctx, endpoint)
        cases: list[tuple[list[bytes], Error]] = [
            ([b""], Error("", "malformed", "empty frame")),
            ([b"\x00garbage"], Error("", "malformed", "unknown frame kind 0x00")),
            ([header + b"\xc1\xc1"], Error("", "malformed", "undecodable body")),
            (
                [header + _body(**generate), b"extra"],
                Error("", "malformed", "expected one message frame after the routing id, got 2"),
            ),
            ([bytes([0x70 | version]) + _body(**generate)],
             Error("", "malformed", f"unknown frame kind {0x70 | version:#04x}")),
            (
                [bytes([header[0] + 1]) + _body(**generate)],
                Error(
                    "raw-1",
                    "unsupported_version",
                    f"protocol version {version + 1} is not supported (this peer speaks "
                    f"1 to {version})",
                ),
            ),
            (
                [bytes([header[0] + 1]) + b"\xc1"],
                Error("", "unsupported_version", f"protocol version {version + 1}"),
            ),
            (
                [header + _body(**generate, prompt="hello")],
                Error(
                    "raw-1",
                    "invalid_request",
                    "exactly one of prompt, input_ids, messages must be set; got prompt and "
                    "input_ids",
                ),
            ),
        ]  # fmt: skip
        for parts, want in cases:
            reply = await raw.call(*parts)
            assert isinstance(reply, Error), (parts, reply)
            assert (reply.request_id, reply.code) == (want.request_id, want.code), reply
            assert want.message in reply.message, reply
        # The same connection still works after all that.
        reply = await raw.call(header + _body(type="health", request_id="raw-health"))
        assert not isinstance(reply, Error) and reply.request_id == "raw-health"
    finally:
        ctx.destroy(linger=0)


@pytest.mark.e2e
async def test_bad_inputs_get_typed_errors_while_others_are_served(
    shared: Daemon, workload: Workload, reference: Reference
) -> None:
    async with (
        RecordingClient(shared.endpoint) as owner,
        AsyncClient(shared.endpoint, timeout=20) as other,
    ):
        before = await _info(other)
        background = [
            asyncio.create_task(_submit(owner, spec, f"bg{i}", stream=i % 2 == 0))
            for i, spec in enumerate(workload.background)
        ]
        # A long request owned by ``owner``, aborted at the end.
        long_stream = owner.stream(input_ids=[5, 6, 7], request_id="long", ignore_eos=True)
        first = await long_stream.__anext__()
        assert first.token_ids

        for name, kwargs, code, message in BAD_REQUESTS:
            with pytest.raises(RequestError) as caught:
                await other.generate(request_id=f"bad-{name}", **{"max_new_tokens": 4, **kwargs})
            assert caught.value.code == code, (name, caught.value)
            assert message in caught.value.message, (name, caught.value.message)
            assert caught.value.request_id == f"bad-{name}"
        await _raw_frames(shared.endpoint)

        # Request ids are each client's own: another client's "long" is no obstacle.
        mine = await other.generate(
            input_ids=[5], request_id="long", max_new_tokens=2, ignore_eos=True
        )
        assert mine.request_id == "long" and len(mine.output_ids) == 2
        for target in ("never-sent", "long"):  # only the owner may abort its request
            with pytest.raises(RequestError) as caught:
                await other.abort(target)
            assert caught.value.code == "unknown_request"
            assert caught.value.message == f"target_id {target!r} is not a request in flight"

        # A frame over --max-message-bytes: libzmq drops that client's connection.
        async with AsyncClient(shared.endpoint, timeout=20) as big:
            with pytest.raises(RequestError) as caught:
                await big.generate(prompt="x" * 10_000, max_new_tokens=1, request_id="too-big")
            assert caught.value.code == "connection_lost"
            assert caught.value.request_id == "too-big"
            health = await big.health(timeout=10)  # it reconnects on its own
            assert health.status == "serving"

        info = await _info(other)
        assert info.running >= 1, "the long request still runs: the errors were concurrent"
        await owner.abort("long")
        rest = [chunk async for chunk in long_stream]
        assert long_stream.result is not None
        assert long_stream.result.finish_reason == "abort"
        got = [t for c in [first, *rest] for t in c.token_ids]
        assert got == long_stream.result.output_ids
        assert 0 < len(got) < CONTEXT - 3

        results = await asyncio.gather(*background)
        after = await _wait_idle(other)
    for i, (spec, want, (result, _)) in enumerate(
        zip(workload.background, workload.background_expected, results, strict=True)
    ):
        check_result(result, spec, want, f"bg{i}", reference.decode)
        assert owner.finals(f"bg{i}") == 1
    # The background, and the other client's own "long".
    assert _delta(after, before) == {"stop": 0, "length": len(background) + 1, "abort": 1}


@pytest.mark.e2e
async def test_client_gone_mid_stream_aborts_and_frees_kv(shared: Daemon) -> None:
    async with AsyncClient(shared.endpoint, timeout=20) as observer:
        before = await _wait_idle(observer)
        async with AsyncClient(shared.endpoint) as leaving:
            tokens = leaving.stream(input_ids=[9, 8, 7, 6, 5], ignore_eos=True)
            assert (await tokens.__anext__()).token_ids
            during = await _info(observer)
            assert during.running == 1 and during.kv_used_tokens > 0
        # Leaving the block closed the client mid-stream: the chunks it had received come
        # out, then the error (never a Finished).
        with pytest.raises(RequestError) as caught:
            async for _ in tokens:
                pass
        assert caught.value.code == "connection_lost"
        assert tokens.result is None
        after = await _wait_idle(observer)
    assert _delta(after, before) == {"stop": 0, "length": 0, "abort": 1}


@pytest.mark.e2e
async def test_timeout_close_and_cancel_abort_the_request(shared: Daemon) -> None:
    long = {"input_ids": [4, 5, 6], "ignore_eos": True}  # runs to the context limit
    async with AsyncClient(shared.endpoint, timeout=20) as client:
        before = await _wait_idle(client)
        with pytest.raises(Timeout):
            await client.generate(**long, timeout=0.3)
        after_timeout = await _wait_idle(client)

        tokens = client.stream(**long)
        assert (await tokens.__anext__()).token_ids
        tokens.close()
        after_close = await _wait_idle(client)

        task = asyncio.create_task(client.generate(**long))

        async def running() -> bool:
            return (await _info(client)).running == 1

        await async_poll_until(running, 10, "the request running")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        after_cancel = await _wait_idle(client)
    abort_only = {"stop": 0, "length": 0, "abort": 1}
    assert _delta(after_timeout, before) == abort_only
    assert _delta(after_close, after_timeout) == abort_only
    assert _delta(after_cancel, after_close) == abort_only


@pytest.mark.e2e
async def test_longest_prompt_gets_one_token(shared: Daemon, reference: Reference) -> None:
    spec = Spec("input_ids", [3 + i % 290 for i in range(CONTEXT - 1)], max_new_tokens=None)
    (want,) = reference.expect([spec])
    assert len(want.output_ids) == 1 and want.reason == "length"
    async with AsyncClient(shared.endpoint, timeout=30) as client:
        result, _ = await _submit(client, spec, "longest", stream=True)
        await _wait_idle(client)
    check_result(result, spec, want, "longest", reference.decode)


# --- 3. lifecycle -------------------------------------------------------------------------


@pytest.fixture
def spawn(model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Starts daemons of this test (``spawn(name, *flags, ...)``, daemon_harness.daemons)."""
    with daemons(model_dir, tmp_path) as start:
        yield start


@pytest.fixture
def unread_client() -> Iterator[Callable[[str, int], UnreadClient]]:
    """Starts ``UnreadClient`` processes; each is killed at teardown."""
    started: list[UnreadClient] = []

    def start(endpoint: str, streams: int) -> UnreadClient:
        started.append(UnreadClient(endpoint, streams))
        return started[-1]

    yield start
    for client in started:
        client.kill()


@pytest.fixture
def notify() -> Iterator[NotifySocket]:
    sock = NotifySocket()
    yield sock
    sock.close()


@pytest.mark.e2e
def test_notify_second_daemon_and_drain(spawn: Callable[..., Daemon], notify: NotifySocket) -> None:
    daemon = spawn("first", env=notify.env(2_000_000))  # WATCHDOG_USEC: a ping every 1 s
    with Client(daemon.endpoint) as client:
        # Nothing is bound while the model loads: health() times out.
        with pytest.raises(Timeout) as caught:
            client.health(timeout=0.3)
        assert caught.value.code == "timeout"
        assert isinstance(caught.value, TimeoutError)
        assert "READY=1" not in notify.assignments

        ready = notify.wait_for("READY=1", 90)
        before_ready = notify.assignments[:ready]
        assert before_ready and before_ready[0] == "STATUS=starting"
        assert "STATUS=loading the model" in before_ready
        assert any(a.startswith("EXTEND_TIMEOUT_USEC=") for a in before_ready)
        assert notify.assignments[ready + 1].startswith("STATUS=serving ")
        notify.wait_for("WATCHDOG=1", 5, after=ready)  # idle, it still pings
        health = client.health()
        assert health.status == "serving"

        # A second daemon on the same socket refuses to start; the first keeps serving.
        second = spawn("second", endpoint=daemon.endpoint)
        assert second.wait_exit(60) == EXIT_CONFIG
        assert (
            f"outrider serve: --listen: another daemon (pid {daemon.pid}) serves {daemon.endpoint}"
            in second.log()
        )
        assert client.health().boot_id == health.boot_id
        result = client.generate(input_ids=[5, 6, 7], max_new_tokens=5, temperature=0)
        assert len(result.output_ids) <= 5 and result.finish_reason in ("length", "stop")
        assert "STOPPING=1" not in notify.assignments

        # A hung child (its event loop stopped) stops the pings until it beats again.
        detokenizer = daemon.child_pid("detokenizer")
        os.kill(detokenizer, signal.SIGSTOP)
        try:
            hung = "no heartbeat from the detokenizer process: the watchdog pings stop"
            poll_until(lambda: hung in daemon.log(), 15, "the hung child noticed")
            silent = len(notify.drain())
            time.sleep(2.5)  # more than two watchdog intervals
            assert "WATCHDOG=1" not in notify.drain()[silent:]
        finally:
            os.kill(detokenizer, signal.SIGCONT)
        notify.wait_for("WATCHDOG=1", 5, after=silent)
        # It serves again (eos ignored: an unseeded sampled request may draw it within two).
        resumed = client.generate(input_ids=[5, 6], max_new_tokens=2, ignore_eos=True)
        assert resumed.finish_reason == "length"

        # SIGTERM with a long request in flight: STOPPING=1, new requests refused, the
        # running one completes, exit 0.
        long_stream = client.stream(
            input_ids=[5, 6, 7], max_new_tokens=1500, ignore_eos=True, temperature=0
        )
        first = next(long_stream)
        busy = len(notify.drain())
        notify.wait_for("WATCHDOG=1", 5, after=busy)  # busy, it pings too
        daemon.send_signal(signal.SIGTERM)
        notify.wait_for("STOPPING=1", 10, after=ready)
        with Client(daemon.endpoint, timeout=10) as late:
            with pytest.raises(RequestError) as refused:
                late.generate(input_ids=[5], max_new_tokens=2, request_id="late")
            assert refused.value.code == "shutting_down"
            assert refused.value.request_id == "late"
            assert late.health().status == "draining"
        rest = list(long_stream)
        assert long_stream.result is not None
        assert long_stream.result.finish_reason == "length"
        assert len(long_stream.result.output_ids) == 1500
        assert [t for c in [first, *rest] for t in c.token_ids] == long_stream.result.output_ids
    assert daemon.wait_exit(30) == 0
    daemon.wait_group_gone()
    assert "Traceback" not in daemon.log()
    # The socket file went with it (removed under the lock); the lock file stays.
    socket_path = Path(daemon.endpoint.removeprefix("ipc://"))
    assert not socket_path.exists()
    assert socket_path.with_name(socket_path.name + ".lock").exists()
    sent = notify.drain()
    assert (sent.count("READY=1"), sent.count("STOPPING=1")) == (1, 1)
    assert "WATCHDOG=trigger" not in sent


@pytest.mark.e2e
def test_restart_and_drain_deadline(
    spawn: Callable[..., Daemon], unread_client: Callable[[str, int], UnreadClient]
) -> None:
    first = spawn("first", "--drain-timeout", "1")
    boot = first.wait_serving().boot_id
    with Client(first.endpoint, timeout=30) as client:
        assert client.health().boot_id == boot
        # A client that reads nothing: its pipe fills, the daemon aborts its requests as a
        # slow consumer; it must survive the daemon's death below all the same.
        before = client.server_info().requests_finished["abort"]
        idle = unread_client(first.endpoint, 16)
        poll_until(
            lambda: client.server_info().requests_finished["abort"] - before == 16,
            30,
            "the slow consumer's requests aborted",
        )
        # The daemon dies with a call in flight: the call fails with connection_lost.
        stream = client.stream(input_ids=[5, 6, 7], ignore_eos=True, request_id="in-flight")
        assert next(stream).token_ids
        first.send_signal(signal.SIGKILL)
        with pytest.raises(RequestError) as caught:
            list(stream)
        assert caught.value.code == "connection_lost"
        assert caught.value.request_id == "in-flight"
        assert first.wait_exit(10) == -signal.SIGKILL
        first.wait_group_gone()  # the orphaned children exit on their own
        code, results = idle.read_now()
        assert code == 0, idle.output  # libzmq's heartbeat bug would abort it (-SIGABRT)
        assert len(results) == 16, idle.output
        assert all(chunks > 0 and error == "connection_lost" for chunks, error in results)

        # A new daemon on the same path; the same client is served by it.
        second = spawn("second", "--drain-timeout", "1", endpoint=first.endpoint)
        new_boot = second.wait_serving().boot_id
        assert new_boot != boot
        health = client.health(timeout=10)
        assert health.status == "serving" and health.boot_id == new_boot
        result = client.generate(input_ids=[5, 6, 7], max_new_tokens=3, ignore_eos=True)
        assert len(result.output_ids) == 3

        # SIGTERM with requests that outlive --drain-timeout 1: each ends with a final
        # 'abort' frame, then the daemon exits 0.
        streams = [
            client.stream(input_ids=[5, 6, 7, 10 + i], ignore_eos=True, request_id=f"d{i}")
            for i in range(6)
        ]
        firsts = [next(stream) for stream in streams]
        second.send_signal(signal.SIGTERM)
        for stream, first_chunk in zip(streams, firsts, strict=True):
            chunks = [first_chunk, *stream]
            assert stream.result is not None
            assert stream.result.finish_reason == "abort"
            assert 0 < len(stream.result.output_ids) < MODEL_CONTEXT - 4
            assert [t for c in chunks for t in c.token_ids] == stream.result.output_ids
    assert second.wait_exit(30) == 0
    assert "Traceback" not in second.log()


# --- 4. start-up refusals -----------------------------------------------------------------


def _curve_files(directory: Path, secret_mode: int = 0o600) -> tuple[str, Path, Path]:
    """A server secret certificate (``secret_mode``), a directory with one client public
    certificate, and that client's secret certificate (kept outside it)."""
    directory.mkdir(parents=True, exist_ok=True)
    _, server_secret = zmq.auth.create_certificates(directory, "server")
    os.chmod(server_secret, secret_mode)
    clients = directory / "clients"
    clients.mkdir()
    _, client_secret = zmq.auth.create_certificates(clients, "client")
    moved = directory / "client.key_secret"
    os.rename(client_secret, moved)
    return server_secret, clients, moved


@pytest.mark.e2e
def test_start_up_refusals(spawn: Callable[..., Daemon], model_dir: Path, tmp_path: Path) -> None:
    empty_model = tmp_path / "empty-model"
    empty_model.mkdir()
    bad_generation = _model_copy(model_dir, tmp_path / "bad-generation", '{"top_p": 0}')
    missing_model = tmp_path / "no-such-model"
    secret, _, _ = _curve_files(tmp_path / "curve")
    open_secret, open_clients, _ = _curve_files(tmp_path / "curve-0644", secret_mode=0o644)
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken_tcp = f"tcp://127.0.0.1:{holder.getsockname()[1]}"
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    taken_name = f"outrider-e2e-{os.getpid()}"
    abstract.bind(b"\0" + taken_name.encode())
    abstract.listen()
    in_use = "address already in use (another process holds it)"
    # name: (flags, spawn options, the one line on stderr, refused before spawning children)
    cases: dict[str, tuple[list[str], dict[str, str], str, bool]] = {
        "backend": (
            ["--attention-backend", "nope"],
            {},
            "outrider serve: the configuration cannot run:\n"
            "  --attention-backend: unknown attention backend 'nope'; available: auto, fa4, "
            "flashinfer, torch, triton",
            False,
        ),
        "dtype": (
            ["--dtype", "bfloat16", "--device", "cpu"],
            {},
            "outrider serve: --dtype bfloat16 is not supported on CPU (use float32)",
            True,
        ),
        "no-model": (
            ["--model", str(missing_model)],
            {},
            f"outrider serve: --model {missing_model}: no such file or directory",
            True,
        ),
        "empty-model": (
            ["--model", str(empty_model)],
            {},
            f"outrider serve: --model {empty_model}: no config.json in the directory",
            True,
        ),
        "bad-generation-config": (
            ["--model", str(bad_generation)],
            {},
            f"outrider serve: --generation-config auto: {bad_generation}/generation_config.json: "
            "Expected `float` > 0.0 - at `$.top_p`",
            True,
        ),
        "taken-tcp": (
            [],
            {"endpoint": taken_tcp},
            f"outrider serve: --listen: cannot listen on {taken_tcp}: {in_use}",
            True,
        ),
        "taken-abstract": (
            [],
            {"endpoint": f"ipc://@{taken_name}"},
            f"outrider serve: --listen: cannot listen on ipc://@{taken_name}: {in_use}",
            True,
        ),
        "no-client-keys": (
            ["--curve-secret-key-file", secret],
            {},
            "outrider serve: --curve-secret-key-file needs --curve-client-keys DIR (the client "
            "public certificates allowed in)",
            True,
        ),
        "open-secret-key": (
            ["--curve-secret-key-file", open_secret, "--curve-client-keys", str(open_clients)],
            {},
            f"outrider serve: --curve-secret-key-file {open_secret}: mode 0644 lets other users "
            "at the secret key; chmod 600 it",
            True,
        ),
    }
    if not torch.cuda.is_available():
        cases["cuda"] = (
            ["--device", "cuda"],
            {},
            "outrider serve: --device cuda: no CUDA device is available",
            False,
        )
    try:
        daemons = {  # all at once
            name: spawn(name, *args, **options) for name, (args, options, _, _) in cases.items()
        }
        for name, daemon in daemons.items():
            assert daemon.wait_exit(90) == EXIT_CONFIG, (name, daemon.log())
            log = daemon.log()
            _, _, line, before_children = cases[name]
            assert line + "\n" in log, (name, log)
            assert "Traceback" not in log, (name, log)
            if before_children:  # no child ever logged: nothing was spawned, nor loaded
                assert "frontdoor[" not in log and "detokenizer[" not in log, (name, log)
            # Children spawned before the check were stopped, not orphaned.
            daemon.wait_group_gone()
    finally:
        holder.close()
        abstract.close()


def _model_copy(model_dir: Path, directory: Path, generation_config: str) -> Path:
    """A copy of ``model_dir`` at ``directory``, with this generation_config.json."""
    shutil.copytree(model_dir, directory)
    (directory / "generation_config.json").write_text(generation_config)
    return directory


@pytest.mark.e2e
def test_the_models_generation_config_gives_the_sampling_defaults(
    spawn: Callable[..., Daemon], model_dir: Path, tmp_path: Path
) -> None:
    qwen3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
    generation_config = json.dumps(qwen3 | {"repetition_penalty": 1.1})
    model = _model_copy(model_dir, tmp_path / "qwen3-like", generation_config)
    daemon = spawn("defaults", "--model", str(model))
    daemon.wait_serving()
    file = model / "generation_config.json"
    with Client(daemon.endpoint, timeout=60) as client:
        info = client.server_info()
        assert info.configuration["sampling_defaults"] == {
            "temperature": 0.6,
            "top_p": 0.95,
            "top_k": 20,
            "source": f"from {file}",
        }
        request: dict[str, Any] = {
            "input_ids": [5, 6, 7],
            "max_new_tokens": 16,
            "seed": 3,
            "ignore_eos": True,
        }
        left_out = client.generate(**request).output_ids
        given = client.generate(**request, temperature=0.6, top_p=0.95, top_k=20).output_ids
        outriders = client.generate(**request, temperature=1.0, top_p=1.0, top_k=0).output_ids
    assert left_out == given != outriders
    assert daemon.stop() == 0
    log = daemon.log()
    assert (
        f"sampling defaults: temperature 0.6, top_p 0.95, top_k 20 (from {file}; "
        "ignored, not implemented: repetition_penalty)\n"
    ) in log, log


@pytest.mark.e2e
def test_sigterm_while_loading_stops_cleanly(spawn: Callable[..., Daemon]) -> None:
    daemon = spawn("early")
    # The front door logs this once the daemon has spawned it: the daemon is loading now.
    poll_until(lambda: "waiting for the model" in daemon.log(), 60, "the front door starting")
    still_loading = "serving" not in daemon.log()
    daemon.send_signal(signal.SIGTERM)
    assert daemon.wait_exit(60) == 0, daemon.log()
    daemon.wait_group_gone()
    log = daemon.log()
    assert "Traceback" not in log, log
    if still_loading:
        assert "SIGTERM while starting: stopping" in log, log
    # The private runtime directory of the internal pipes is gone.
    assert not list(daemon.runtime.glob("outrider-*")), list(daemon.runtime.iterdir())


def _free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _wait_serving(daemon: Daemon, client: Client) -> None:
    """``wait_serving`` for a daemon that needs client options (CURVE keys)."""

    def serving() -> bool:
        if daemon.proc.poll() is not None:
            raise RuntimeError(daemon.log())
        try:
            return client.health(timeout=0.5).status == "serving"
        except Timeout:
            return False

    poll_until(serving, START_TIMEOUT_S, f"the daemon at {daemon.endpoint} serving")


@pytest.fixture(scope="module")
def curve(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Daemon, str, Path]]:
    """A daemon on TCP with CURVE keys, one client's listed, shared by the CURVE tests:
    ``(daemon, server secret certificate, the listed client's secret certificate)``."""
    directory = tmp_path_factory.mktemp("curve")
    secret_file, clients, client_secret_file = _curve_files(directory / "keys")
    endpoint = f"tcp://127.0.0.1:{_free_tcp_port()}"
    with daemons(model_dir, directory) as start:
        daemon = start(
            "curve",
            *("--curve-secret-key-file", secret_file, "--curve-client-keys", str(clients)),
            endpoint=endpoint,
        )
        yield daemon, secret_file, client_secret_file


@pytest.mark.e2e
def test_tcp_with_curve_keys(spawn: Callable[..., Daemon], curve: tuple[Daemon, str, Path]) -> None:
    daemon, secret_file, client_secret_file = curve
    server_public, _ = zmq.auth.load_certificate(secret_file)
    client_public, client_secret = zmq.auth.load_certificate(client_secret_file)
    assert client_secret is not None
    endpoint = daemon.endpoint
    # Beyond loopback without keys: refused before anything is bound.
    open_bind = spawn("open", endpoint="tcp://0.0.0.0:9")
    listed = (client_public, client_secret)
    with Client(endpoint, timeout=60, curve_server_key=server_public, curve_keypair=listed) as ok:
        _wait_serving(daemon, ok)
        result = ok.generate(input_ids=[5, 6, 7], max_new_tokens=4, temperature=0.0)
        assert result.finish_reason == "length" and len(result.output_ids) == 4
    # A client without the server's key fails the handshake: the server drops it.
    with Client(endpoint) as plain, pytest.raises(RequestError) as refused:
        plain.health(timeout=10.0)
    assert refused.value.code == "connection_lost"
    assert open_bind.wait_exit(90) == EXIT_CONFIG
    assert "tcp://0.0.0.0:9" in open_bind.log() and "--insecure-tcp" in open_bind.log()


@pytest.mark.e2e
def test_curve_refuses_an_unlisted_client_key(curve: tuple[Daemon, str, Path]) -> None:
    daemon, secret_file, _ = curve
    server_public, _ = zmq.auth.load_certificate(secret_file)
    poll_until(lambda: "serving on" in daemon.log(), START_TIMEOUT_S, "the daemon serving")
    logged = len(daemon.log())
    stranger = zmq.curve_keypair()
    with (
        Client(daemon.endpoint, curve_server_key=server_public, curve_keypair=stranger) as client,
        pytest.raises(RequestError) as refused,
    ):
        client.health(timeout=10.0)
    assert refused.value.code == "connection_lost"
    assert "authentication" in refused.value.message
    assert "refused a CURVE client: public key" in daemon.log()[logged:]


@pytest.mark.e2e
def test_a_port_taken_while_loading_is_refused_in_one_line(
    spawn: Callable[..., Daemon],
) -> None:
    endpoint = f"tcp://127.0.0.1:{_free_tcp_port()}"
    daemon = spawn("raced", endpoint=endpoint)
    poll_until(lambda: "waiting for the model" in daemon.log(), 60, "the front door starting")
    # The front door binds once the model is loaded; held stopped, it cannot bind before us.
    front_door = daemon.child_pid("frontdoor")
    os.kill(front_door, signal.SIGSTOP)
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        assert "serving on" not in daemon.log()
        holder.bind(("127.0.0.1", int(endpoint.rpartition(":")[2])))
        holder.listen()
    finally:
        os.kill(front_door, signal.SIGCONT)
    with holder:
        assert daemon.wait_exit(90) == EXIT_CONFIG, daemon.log()
    daemon.wait_group_gone()
    log = daemon.log()
    refusal = f"outrider serve: cannot listen on {endpoint}: Address already in use"
    assert [line for line in log.splitlines() if "outrider serve:" in line] == [refusal], log
    assert "Traceback" not in log, log


@pytest.mark.e2e
@pytest.mark.parametrize("child", ["frontdoor", "detokenizer"])
def test_a_dead_child_stops_the_daemon(spawn: Callable[..., Daemon], child: str) -> None:
    daemon = spawn(f"without-{child}")
    daemon.wait_serving()
    with Client(daemon.endpoint, timeout=60) as client:
        stream = client.stream(input_ids=[5, 6, 7], max_new_tokens=1500, ignore_eos=True)
        assert next(stream).token_ids
        os.kill(daemon.child_pid(child), signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(RequestError) as lost:
            list(stream)
        waited = time.monotonic() - killed
    assert lost.value.code == "connection_lost"
    # The client learns it at once, not after the internal pipes' linger.
    assert waited < 1.5, (waited, daemon.log())
    # Never serve half-alive: the daemon exits non-zero so that systemd restarts it.
    assert daemon.wait_exit(30) == 1, daemon.log()
    daemon.wait_group_gone()
    assert f"the {child} process exited with code -9" in daemon.log()
