"""The fault soak's traffic (tests/test_soak.py): every worker runs until ``Soak.going()``
turns False, notes each request in the ledger before sending it and checks what comes back.

| worker            | what it does                                                            |
|-------------------|-------------------------------------------------------------------------|
| async_worker      | AsyncClient, IN_FLIGHT requests from the pool at a time (waited)        |
| blocking_worker   | Client in a thread: pool requests; streams closed, dropped, timed out    |
| abort_worker      | abort() then read on (waited); cancel, close, drop, timeout (abandoned) |
| disconnect_worker | a client closed with long streams and generates in flight, reopened     |
| reconnect_worker  | Client(); health(); close(); Client(); generate(timeout=10), in a loop  |
| malformed_worker  | rounds of bad frames on a raw DEALER; a frame over the size limit       |
| killer_worker     | a client process streaming long requests, SIGKILLed, restarted          |
| watcher           | RSS samples; stops everything as soon as a daemon process is gone       |
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import random
import signal
import threading
import time
import traceback
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import zmq
import zmq.asyncio
from daemon_harness import Daemon, async_poll_until
from e2e_workload import VOCAB, Spec
from frontdoor_harness import RawClient
from soak_faults import StreamingClientProcess, bad_frames, killed_spec
from soak_harness import (
    FrameLog,
    Ledger,
    RecordingAsyncClient,
    RecordingClient,
    Tally,
    fixed_set,
    long_spec,
    process_alive,
    result_problem,
    rss_of,
    skipped_faults,
)

from outrider.protocol import AsyncClient, GenerateResult, RequestError, TokenChunk
from outrider.protocol.frames import FrameError
from outrider.protocol.messages import Health

WAIT_S = 120.0  # a waited request's timeout: 4x the longest (1,000 tokens) under the soak
RECONNECT_TIMEOUT_S = 10.0
STALLED_STREAMS = 4  # streams a stalled reader starts at once (the KV has room for them)
STALLED_TOKENS = 256
STALL_S = 3.0  # how long it then reads nothing: past the front door's 2 s for slow consumers
IN_FLIGHT = 4  # requests each async client keeps in flight


@dataclass
class Soak:
    """What every worker shares: the daemon, the request pool, the deadline, the records."""

    daemon: Daemon
    pool: list[Spec]
    context: int  # the daemon's --context-length
    max_message_bytes: int  # and its --max-message-bytes
    until: float = math.inf
    ledger: Ledger = field(default_factory=Ledger)
    frames: FrameLog = field(default_factory=FrameLog)
    tally: Tally = field(default_factory=Tally)
    skip: set[str] = field(default_factory=skipped_faults)
    stop: threading.Event = field(default_factory=threading.Event)
    died: str = ""  # set by the watcher: which daemon process is gone
    problems_before_death: int = 0
    bad_frame_in_flight: str = ""  # the malformed frame awaiting its answer (a death's suspect)
    rss: list[tuple[float, dict[str, int]]] = field(default_factory=list)  # (t, kB per process)

    def going(self) -> bool:
        return not self.stop.is_set() and time.monotonic() < self.until

    def async_client(self) -> RecordingAsyncClient:
        return RecordingAsyncClient(self.daemon.endpoint, self.frames, timeout=WAIT_S)

    def client(self) -> RecordingClient:
        return RecordingClient(self.daemon.endpoint, self.frames, timeout=WAIT_S)

    def check(
        self,
        request_id: str,
        spec: Spec,
        result: GenerateResult | None,
        chunks: list[TokenChunk] | None,
        aborted: bool = False,
    ) -> None:
        """Note a finished request and check it (an 'abort' only where we aborted)."""
        assert result is not None
        self.ledger.finished(request_id, result)
        problem = result_problem(spec, result, chunks, self.context)
        if problem is None and result.finish_reason == "abort" and not aborted:
            problem = "finished with 'abort' though nobody aborted it"
        if problem is not None:
            self.ledger.problem(f"{request_id} ({spec}): {problem}")

    def unexpected(self, request_id: str, exc: RequestError, allowed: tuple[str, ...]) -> None:
        if exc.code not in allowed:
            self.ledger.problem(f"{request_id}: {exc.code}: {exc.message}")


# --- waited requests ------------------------------------------------------------------------


async def send_async(
    soak: Soak, client: AsyncClient, source: str, spec: Spec, stream: bool
) -> GenerateResult | None:
    request_id = soak.ledger.add(source, spec, waited=True)
    chunks: list[TokenChunk] | None = None
    try:
        if stream:
            chunks = []
            tokens = client.stream(request_id=request_id, timeout=WAIT_S, **spec.kwargs())
            async for chunk in tokens:
                chunks.append(chunk)
            result = tokens.result
        else:
            result = await client.generate(request_id=request_id, timeout=WAIT_S, **spec.kwargs())
    except RequestError as exc:
        soak.ledger.failed(request_id, exc.code, exc.message)
        return None
    soak.check(request_id, spec, result, chunks)
    return result


def send_blocking(
    soak: Soak, client: RecordingClient, source: str, spec: Spec, stream: bool, timeout: float
) -> None:
    request_id = soak.ledger.add(source, spec, waited=True)
    chunks: list[TokenChunk] | None = None
    try:
        if stream:
            tokens = client.stream(request_id=request_id, timeout=timeout, **spec.kwargs())
            chunks = list(tokens)
            result = tokens.result
        else:
            result = client.generate(request_id=request_id, timeout=timeout, **spec.kwargs())
    except RequestError as exc:
        soak.ledger.failed(request_id, exc.code, exc.message)
        return
    soak.check(request_id, spec, result, chunks)


async def send_fixed(soak: Soak, client: AsyncClient, source: str) -> list[GenerateResult | None]:
    return await asyncio.gather(
        *(send_async(soak, client, source, spec, i % 2 == 0) for i, spec in enumerate(fixed_set()))
    )


# --- workers --------------------------------------------------------------------------------


async def async_worker(soak: Soak, index: int) -> None:
    """Keeps IN_FLIGHT requests from the pool (one in ten from the fixed set) in flight."""
    rng, fixed = random.Random(100 + index), fixed_set()
    async with soak.async_client() as client:
        tasks: set[asyncio.Task[GenerateResult | None]] = set()
        while soak.going():
            while len(tasks) < IN_FLIGHT:
                spec = rng.choice(fixed) if rng.random() < 0.1 else rng.choice(soak.pool)
                stream = rng.random() < 0.5
                tasks.add(asyncio.create_task(send_async(soak, client, "async", spec, stream)))
                soak.tally.add("async requests")
            _, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.gather(*tasks)


async def abort_worker(soak: Soak, index: int) -> None:
    """Long requests given up in every way a client can: each ends with at most one final."""
    rng = random.Random(200 + index)
    faults = (abort_then_read, cancel_call, close_stream, drop_stream, time_out)
    async with soak.async_client() as client:
        while soak.going():
            fault = rng.choice(faults)
            await fault(soak, client, long_spec(rng), rng)
            soak.tally.add(f"abort: {fault.__name__}")


async def _first_chunks(
    soak: Soak, tokens: Any, request_id: str, count: int
) -> list[TokenChunk] | None:
    chunks = []
    try:
        for _ in range(count):
            chunks.append(await anext(tokens))
    except RequestError as exc:
        soak.unexpected(request_id, exc, ())
        return None
    soak.ledger.reached(request_id)
    return chunks


async def abort_then_read(soak: Soak, client: AsyncClient, spec: Spec, rng: random.Random) -> None:
    """abort() a live stream, then read it to its final frame (waited)."""
    request_id = soak.ledger.add("abort", spec, waited=True)
    tokens = client.stream(request_id=request_id, timeout=WAIT_S, **spec.kwargs())
    chunks = await _first_chunks(soak, tokens, request_id, rng.randint(1, 3))
    if chunks is None:
        return
    try:
        await client.abort(request_id, timeout=WAIT_S)
        chunks += [chunk async for chunk in tokens]
    except RequestError as exc:
        soak.ledger.failed(request_id, exc.code, exc.message)
        return
    soak.check(request_id, spec, tokens.result, chunks, aborted=True)
    if tokens.result is not None and tokens.result.finish_reason != "abort":
        soak.ledger.problem(f"{request_id}: aborted, yet it ended {tokens.result.finish_reason!r}")


async def cancel_call(soak: Soak, client: AsyncClient, spec: Spec, rng: random.Random) -> None:
    request_id = soak.ledger.add("cancel", spec, waited=False)
    task = asyncio.create_task(client.generate(request_id=request_id, **spec.kwargs()))
    await asyncio.sleep(rng.uniform(0.0, 0.5))
    task.cancel()
    await asyncio.wait([task])
    error = None if task.cancelled() else task.exception()
    if isinstance(error, RequestError):
        soak.unexpected(request_id, error, ())


async def close_stream(soak: Soak, client: AsyncClient, spec: Spec, rng: random.Random) -> None:
    request_id = soak.ledger.add("close", spec, waited=False)
    tokens = client.stream(request_id=request_id, **spec.kwargs())
    await _first_chunks(soak, tokens, request_id, rng.randint(1, 3))
    tokens.close()


async def drop_stream(soak: Soak, client: AsyncClient, spec: Spec, rng: random.Random) -> None:
    """A stream collected unfinished: its client aborts it at its next wake-up."""
    request_id = soak.ledger.add("drop", spec, waited=False)
    tokens = client.stream(request_id=request_id, **spec.kwargs())
    await _first_chunks(soak, tokens, request_id, rng.randint(1, 3))
    del tokens


async def time_out(soak: Soak, client: AsyncClient, spec: Spec, rng: random.Random) -> None:
    request_id = soak.ledger.add("timeout", spec, waited=False)
    timeout = rng.uniform(0.05, 0.6)
    try:
        if rng.random() < 0.5:
            tokens = client.stream(request_id=request_id, timeout=timeout, **spec.kwargs())
            async for _ in tokens:
                soak.ledger.reached(request_id)
        else:
            await client.generate(request_id=request_id, timeout=timeout, **spec.kwargs())
    except RequestError as exc:
        soak.unexpected(request_id, exc, ("timeout",))


async def disconnect_worker(soak: Soak) -> None:
    """Clients closed with streams and generates in flight, a new one opened at once."""
    rng = random.Random(300)
    while soak.going():
        specs = [long_spec(rng) for _ in range(rng.randint(2, 5))]
        ids = [soak.ledger.add("gone", spec, waited=False) for spec in specs]
        async with soak.async_client() as client:
            tasks = [
                asyncio.create_task(_consume(soak, client, request_id, spec, stream=i % 2 == 1))
                for i, (request_id, spec) in enumerate(zip(ids, specs, strict=True))
            ]
            await _until(
                partial(_any_reached, soak, ids), 20.0, soak, "a chunk for a client to close"
            )
            await asyncio.sleep(rng.uniform(0.0, 0.2))
        await asyncio.gather(*tasks)  # the close ended them with connection_lost
        soak.tally.add("disconnect: closed clients")


def _any_reached(soak: Soak, request_ids: list[str]) -> bool:
    return any(soak.ledger.sent[request_id].reached for request_id in request_ids)


async def _consume(
    soak: Soak, client: AsyncClient, request_id: str, spec: Spec, stream: bool
) -> None:
    try:
        if stream:
            async for _ in client.stream(request_id=request_id, **spec.kwargs()):
                soak.ledger.reached(request_id)
        else:
            await client.generate(request_id=request_id, **spec.kwargs())
    except RequestError as exc:
        soak.unexpected(request_id, exc, ("connection_lost",))


async def _until(condition: Callable[[], bool], timeout: float, soak: Soak, what: str) -> None:
    async def check() -> bool:
        return condition() or not soak.going()

    try:
        await async_poll_until(check, timeout, what)
    except TimeoutError as exc:
        soak.ledger.problem(str(exc))


def blocking_worker(soak: Soak, index: int) -> None:
    """A blocking Client in a thread: requests from the pool, and now and then a stream
    closed, dropped or timed out, or the client closed mid-stream and replaced."""
    rng = random.Random(400 + index)
    client = soak.client()
    try:
        while soak.going():
            roll = rng.random()
            if roll < 0.8:
                stream = rng.random() < 0.5
                send_blocking(soak, client, "sync", rng.choice(soak.pool), stream, WAIT_S)
                soak.tally.add("blocking requests")
                continue
            spec = long_spec(rng)
            request_id = soak.ledger.add("sync-gone", spec, waited=False)
            try:
                tokens = client.stream(request_id=request_id, timeout=0.5, **spec.kwargs())
                next(tokens)
                soak.ledger.reached(request_id)
                if roll < 0.85:
                    tokens.close()
                elif roll < 0.9:
                    del tokens  # collected: aborted at the client's next call
                elif roll < 0.95:
                    list(tokens)  # times out
                else:
                    client.close()
                    client = soak.client()
            except RequestError as exc:
                soak.unexpected(request_id, exc, ("timeout",))
            soak.tally.add("blocking: given up")
    finally:
        client.close()


def stalled_reader_worker(soak: Soak) -> None:
    """A blocking Client that starts long streams, reads one chunk of each, stops reading for
    longer than the front door waits for a slow consumer, then reads on: each stream ends
    once, finished or answered ``slow_consumer``, and the client goes on being served."""
    rng = random.Random(700)
    client = soak.client()
    try:
        while soak.going():
            started = []
            for _ in range(STALLED_STREAMS):
                spec = dataclasses.replace(long_spec(rng), max_new_tokens=STALLED_TOKENS)
                request_id = soak.ledger.add("stalled", spec, waited=True)
                tokens = client.stream(request_id=request_id, timeout=WAIT_S, **spec.kwargs())
                started.append((request_id, spec, tokens))
            firsts = [next(tokens) for _, _, tokens in started]
            time.sleep(STALL_S)
            for (request_id, spec, tokens), first in zip(started, firsts, strict=True):
                try:
                    chunks = [first, *tokens]
                except RequestError as exc:
                    if exc.code != "slow_consumer":
                        soak.ledger.failed(request_id, exc.code, exc.message)
                    soak.ledger.sent[request_id].outcome = f"error:{exc.code}"
                    soak.tally.add(f"stalled reader: {exc.code}")
                    continue
                soak.check(request_id, spec, tokens.result, chunks)
                soak.tally.add("stalled reader: finished")
    finally:
        client.close()


def reconnect_worker(soak: Soak, index: int) -> None:
    """``Client(); health(); close(); Client(); generate(timeout=10)``, as fast as it goes."""
    rng = random.Random(500 + index)
    short = [
        Spec("input_ids", tuple(rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 12))),
             max_new_tokens=rng.randint(1, 8), ignore_eos=True)
        for _ in range(6)
    ]  # fmt: skip
    while soak.going():
        with soak.client() as probe:
            try:
                probe.health(timeout=RECONNECT_TIMEOUT_S)
            except RequestError as exc:
                soak.ledger.lost_call(f"health() on a new client: {exc}")
        with soak.client() as client:
            send_blocking(soak, client, "reconnect", rng.choice(short), False, RECONNECT_TIMEOUT_S)
        soak.tally.add("reconnect: rounds")


async def malformed_worker(soak: Soak) -> None:
    """Rounds of malformed frames on a raw DEALER (each answered with a typed Error, the
    connection still served after), then a frame over --max-message-bytes."""
    rng = random.Random(600)
    ctx = zmq.asyncio.Context()
    serial = 0
    try:
        while soak.going():
            serial += 1
            frames = [f for f in bad_frames(rng, serial) if f.category not in soak.skip]
            rng.shuffle(frames)
            raw = RawClient(ctx, soak.daemon.endpoint)
            try:
                for bad in frames:
                    if not soak.going():
                        break
                    soak.bad_frame_in_flight = f"{bad.name}: {bad.parts!r:.200}"
                    await raw.sock.send_multipart(list(bad.parts))
                    try:
                        problem = bad.problem(await raw.recv(timeout=10.0))
                    except (TimeoutError, FrameError) as exc:
                        problem = f"{bad.name}: no typed reply ({exc!r}) to {bad.parts!r:.300}"
                        raw.close()
                        raw = RawClient(ctx, soak.daemon.endpoint)
                    soak.bad_frame_in_flight = ""
                    if problem is not None:
                        soak.ledger.problem(f"malformed round {serial}: {problem}")
                    soak.tally.add(f"malformed: {bad.category}")
                    await asyncio.sleep(0.02)
                reply = await raw.call({"type": "health", "request_id": f"after{serial}"})
                if not isinstance(reply, Health):
                    soak.ledger.problem(f"malformed round {serial}: health after it: {reply!r}")
            except TimeoutError:
                soak.ledger.problem(f"malformed round {serial}: health after it: no reply")
            finally:
                raw.close()
            if "oversize" not in soak.skip:
                await oversize(soak, serial)
            await asyncio.sleep(0.3)
    finally:
        ctx.destroy(linger=0)


async def oversize(soak: Soak, serial: int) -> None:
    """A frame over --max-message-bytes: libzmq drops the connection, the client reconnects."""
    async with AsyncClient(soak.daemon.endpoint, timeout=20) as big:
        try:
            await big.generate(prompt="x" * 2 * soak.max_message_bytes, request_id=f"big{serial}")
            soak.ledger.problem(f"big{serial}: a frame over the limit was served")
        except RequestError as exc:
            soak.unexpected(f"big{serial}", exc, ("connection_lost",))
        try:
            await big.health(timeout=10)
        except RequestError as exc:
            soak.ledger.lost_call(f"health() after an oversize frame: {exc}")
    soak.tally.add("malformed: oversize")


def killer_worker(soak: Soak) -> None:
    """A client process streams a few long requests and is SIGKILLed, at once or after
    chunks of some of them; then the next one starts."""
    rng = random.Random(700)
    for round_ in range(1, 10_000):
        if not soak.going():
            return
        prefix, count = f"killed{round_}", rng.randint(2, 5)
        for i in range(count):
            soak.ledger.add("killed", killed_spec(i), waited=False, request_id=f"{prefix}-{i}")
        proc = StreamingClientProcess(soak.daemon.endpoint, prefix, count)
        try:
            if not proc.sent.wait(30):
                soak.ledger.problem(f"{prefix}: the client process sent nothing: {proc.output}")
            elif rng.random() < 0.3:
                time.sleep(rng.uniform(0.0, 0.05))
            elif not proc.wait_chunks(rng.randint(1, count), 30):
                soak.ledger.problem(f"{prefix}: no chunks in 30 s: {proc.output}")
            else:
                time.sleep(rng.uniform(0.0, 0.3))
        finally:
            code = proc.kill()
        for request_id in proc.chunked:
            soak.ledger.reached(request_id)
        if code != -signal.SIGKILL:
            soak.ledger.problem(f"{prefix}: exited with {code} before the kill: {proc.output}")
        soak.tally.add("kill: client processes")
        time.sleep(rng.uniform(0.1, 0.5))


async def watcher(soak: Soak, pids: dict[str, int], tasks: list[asyncio.Task[None]]) -> None:
    """Stops the soak as soon as a daemon process is gone (cancelling the tasks at once)."""
    while soak.going():
        dead = [name for name, pid in pids.items() if not process_alive(pid)]
        if not dead:
            with contextlib.suppress(FileNotFoundError):  # it died just now: seen next time
                soak.rss.append((time.monotonic(), rss_of(pids)))
        else:
            soak.died = f"the {' and '.join(dead)} process died during the soak"
            soak.problems_before_death = len(soak.ledger.problems)
            soak.stop.set()
            for task in tasks:
                task.cancel()
            return
        await asyncio.sleep(0.5)


async def run_soak(soak: Soak, pids: dict[str, int]) -> None:
    def guarded(target: Callable[..., None], *args: Any) -> threading.Thread:
        def run() -> None:
            try:
                target(soak, *args)
            except Exception:
                soak.ledger.problem(f"{target.__name__} failed:\n{traceback.format_exc()}")

        return threading.Thread(target=run, name=target.__name__)

    enabled = lambda name: name not in soak.skip  # noqa: E731
    threads = [guarded(blocking_worker, 0), guarded(blocking_worker, 1)]
    threads += [guarded(stalled_reader_worker)] if enabled("stall") else []
    threads += [guarded(reconnect_worker, i) for i in range(2)] if enabled("reconnect") else []
    threads += [guarded(killer_worker)] if enabled("kill") else []
    coros: list[Coroutine[Any, Any, None]] = [malformed_worker(soak)]
    coros += [async_worker(soak, i) for i in range(3)]
    coros += [abort_worker(soak, i) for i in range(2)] if enabled("abort") else []
    coros += [disconnect_worker(soak)] if enabled("disconnect") else []
    for thread in threads:
        thread.start()
    tasks = [asyncio.create_task(coro) for coro in coros]
    try:
        await watcher(soak, pids, tasks)
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        soak.stop.set()
        for thread in threads:
            await asyncio.to_thread(thread.join)
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not soak.died:
            trace = "".join(traceback.format_exception(outcome))
            soak.ledger.problem(f"a soak task failed:\n{trace}")
