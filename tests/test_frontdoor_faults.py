"""Faults at the front door: what a hostile or unlucky client can send, and connections that
come and go. The front door and the detokenizer run as real processes; the daemon's side is
scripted (frontdoor_harness.FakeDaemon)."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import stat
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
import pytest_asyncio
from frontdoor_harness import Stack, model_facts, start_stack, until

from outrider.daemon.frontdoor.clients import PROBE_FIRST_S
from outrider.daemon.frontdoor.validation import (
    INLINE_PROMPT_CHARS,
    MAX_WAITING_PROMPTS,
    prompt_char_limit,
)
from outrider.daemon.tokenizer import Tokenizer
from outrider.protocol import Client, RequestError
from outrider.protocol.frames import request_codec
from outrider.protocol.messages import Abort, Ack, Error, Finished, Generate, Health, HealthQuery

pytestmark = pytest.mark.asyncio(loop_scope="module")
T = TypeVar("T")

REPLY_IDS = [7, 8, 9]


async def serving_stack(
    tokenizer_dir: Path, tokenizer: Tokenizer, context_length: int, **options: Any
) -> Stack:
    s = start_stack(tokenizer_dir, REPLY_IDS, **options)
    await s.status("frontdoor")
    await s.status("detokenizer")
    facts = model_facts(tokenizer_dir, len(tokenizer) + 4)
    await s.daemon.start_serving(msgspec.structs.replace(facts, context_length=context_length))
    assert (await s.status("frontdoor")).state == "serving"
    return s


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tokenizer_dir: Path, tokenizer: Tokenizer) -> AsyncIterator[Stack]:
    s = await serving_stack(tokenizer_dir, tokenizer, 64)
    yield s
    assert await s.stop() == {"frontdoor": 0, "detokenizer": 0}


async def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return await asyncio.to_thread(fn, *args, **kwargs)


def ipc_file(stack: Stack) -> str:
    return stack.client_endpoint.removeprefix("ipc://")


async def test_pre_3_0_zmtp_peers_are_served(stack: Stack) -> None:
    """A ZMTP 1.0 peer's messages carry no source descriptor; it is answered like any other,
    and peers that speak no ZMTP at all are dropped by libzmq."""
    body = request_codec().encode(HealthQuery("zmtp-1.0"))
    old = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old.connect(ipc_file(stack))
    # An anonymous identity frame, then one message frame: [length incl. flags][flags][body].
    old.sendall(b"\x01\x00" + bytes([len(body) + 1, 0]) + body)
    garbage = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    garbage.connect(ipc_file(stack))
    garbage.sendall(b"\x00" * 64)
    old.settimeout(5.0)
    received = b""
    while b"serving" not in received:
        chunk = await asyncio.to_thread(old.recv, 4096)
        assert chunk, received
        received += chunk
    assert b"zmtp-1.0" in received
    old.close()
    garbage.close()
    with Client(stack.client_endpoint, timeout=5.0) as client:
        assert (await call(client.health)).status == "serving"
    assert stack.processes["frontdoor"].is_alive()


async def test_new_connections_lose_no_message(stack: Stack) -> None:
    """A new connection's first message is served, and no live client is taken for gone:
    the socket monitor's events reach the front door in no fixed order with the messages."""
    rounds, threads = 500, 3
    before = len(stack.daemon.aborts)

    def churn(worker: int) -> list[str]:
        failures = []
        for i in range(rounds):
            with Client(stack.client_endpoint) as client:
                client.health(timeout=5.0)
            with Client(stack.client_endpoint) as client:
                request_id = f"churn-{worker}-{i}"
                try:
                    result = client.generate(
                        input_ids=[5], max_new_tokens=2, request_id=request_id, timeout=5.0
                    )
                    assert result.output_ids == REPLY_IDS[:2]
                except RequestError as exc:
                    failures.append(f"{request_id}: {exc}")
        return failures

    failures = await asyncio.gather(*(call(churn, w) for w in range(threads)))
    assert [f for per_thread in failures for f in per_thread] == []
    assert stack.daemon.aborts[before:] == []


async def test_vanished_client_is_noticed_without_traffic(stack: Stack) -> None:
    """A non-streamed request of a client that went away is aborted at the next probe."""
    raw = stack.raw()
    await raw.send(Generate("quiet", input_ids=[5]))  # held by the fake daemon: no frames
    rid = (await stack.daemon.request("quiet")).rid
    await asyncio.sleep(2 * PROBE_FIRST_S)
    assert rid not in {a.rid for a in stack.daemon.aborts}  # probed, and still connected
    raw.close()
    started = time.monotonic()
    await until(lambda: rid in {a.rid for a in stack.daemon.aborts}, 5)
    assert time.monotonic() - started < 4 * PROBE_FIRST_S  # the next probe is due by then
    assert [a.reason for a in stack.daemon.aborts if a.rid == rid] == ["client disconnected"]


async def test_bad_bytes_get_typed_errors_and_the_front_door_lives(stack: Stack) -> None:
    header = request_codec().header
    nested = b"\x91" * 2000 + b"\xc0"  # 2,000 nested one-element arrays
    cases = {
        "utf8-type": header + b"\x82\xa4type\xa6health\xaarequest_id\xa1\xff",
        "utf8-id": header + b"\x82\xa4type\xa6health\xaarequest_id\xa2\xc3\x28",
        "utf8-prompt": header
        + b"\x84\xa4type\xa8generate\xaarequest_id\xa2p1\xa6prompt\xa1\xfe"
        + b"\xaeignore_eos\xc2",
        "nested-field": header + b"\x82\xa4type\xa6health\xa7unknown" + nested,
        "nested-version": bytes([header[0] + 1]) + b"\x81\xa7unknown" + nested,
        "nested-body": header + nested,
    }
    raw = stack.raw()
    try:
        for name, frame in cases.items():
            reply = await raw.call(frame)
            assert isinstance(reply, Error), (name, reply)
            assert reply.code in ("malformed", "invalid_request", "unsupported_version"), name
        # The same connection still works after all that.
        health = await raw.call(HealthQuery("after-bad-bytes"))
        assert isinstance(health, Health) and health.status == "serving"
    finally:
        raw.close()
    assert stack.processes["frontdoor"].is_alive()


async def test_prompt_longer_than_the_context_can_hold_is_refused_untokenized(
    stack: Stack, tokenizer: Tokenizer
) -> None:
    limit = prompt_char_limit(tokenizer, 64)
    assert limit == 63 * tokenizer.longest_token_chars  # the test tokenizer has no normalizer
    with Client(stack.client_endpoint, timeout=10.0) as client:
        # The second one is just under the frame limit.
        for letter, chars in (("é", limit + 1), ("x", 7 * 2**20)):
            started = time.monotonic()
            with pytest.raises(RequestError) as err:
                await call(client.generate, letter * chars, max_new_tokens=1)
            assert time.monotonic() - started < 1.0
            assert err.value.code == "prompt_too_long"
            assert err.value.message == (
                f"prompt has {chars} characters; at most {limit} can fit in the context "
                "length of 64 tokens"
            )
        messages = [{"role": "user", "content": "x" * limit}]
        with pytest.raises(RequestError) as err:
            await call(client.generate, messages=messages, max_new_tokens=1)
        assert err.value.code == "prompt_too_long"
        assert err.value.message.startswith(f"messages has {limit + 4} characters")
        # At the limit: tokenized, and then too long in tokens.
        with pytest.raises(RequestError) as err:
            await call(client.generate, "x" * limit, max_new_tokens=1)
        assert err.value.code == "prompt_too_long" and "tokens" in err.value.message


def long_prompt(chars: int, seed: int) -> str:
    """Text that tokenizes slowly: random letters of many scripts, one token per byte."""
    rng = random.Random(seed)
    return "".join(chr(rng.randrange(0x100, 0x3000)) for _ in range(chars))


async def test_long_prompts_are_tokenized_off_the_event_loop(
    tokenizer_dir: Path, tokenizer: Tokenizer
) -> None:
    s = await serving_stack(tokenizer_dir, tokenizer, 10**7)
    try:
        prompt = long_prompt(300_000, 0)
        raw = s.raw()
        started = time.monotonic()
        await raw.send(Generate("long-0", prompt=prompt, max_new_tokens=2))
        await raw.send(Generate("long-1", prompt=prompt[:200_000], max_new_tokens=2))
        await raw.send(Generate("long-2", prompt=prompt[:100_000]))  # aborted while waiting
        abort = await raw.call(Abort("abort-long-2", "long-2"))
        assert isinstance(abort, Ack)
        # Short prompts and health() do not wait for the long ones.
        with Client(s.client_endpoint, timeout=5.0) as client:
            for _ in range(5):
                asked = time.monotonic()
                assert (await call(client.health)).status == "serving"
                assert time.monotonic() - asked < 1.0
                short = await call(client.generate, "hello world", max_new_tokens=1)
                assert short.output_ids == REPLY_IDS[:1]
        assert "long-0" not in s.daemon.requests, "tokenizing took too little time to matter"
        finals = {}
        while len(finals) < 3:
            reply = await raw.recv(timeout=60.0)
            assert isinstance(reply, Finished), reply
            finals[reply.request_id] = reply
        assert time.monotonic() - started > 0.5
        assert [finals[f"long-{i}"].finish_reason for i in range(3)] == [
            "length",
            "length",
            "abort",
        ]
        assert s.daemon.requests["long-0"].input_ids == tokenizer.encode_prompt(prompt)
        assert "long-2" not in s.daemon.requests  # the daemon never saw it
        raw.close()
    finally:
        assert await s.stop() == {"frontdoor": 0, "detokenizer": 0}


async def test_waiting_long_prompts_are_bounded(tokenizer_dir: Path, tokenizer: Tokenizer) -> None:
    s = await serving_stack(tokenizer_dir, tokenizer, 10**7)
    try:
        raw = s.raw()
        prompt = long_prompt(INLINE_PROMPT_CHARS + 1, 1)
        for i in range(MAX_WAITING_PROMPTS):  # the first one keeps the thread busy
            chars = 400_000 if i == 0 else INLINE_PROMPT_CHARS + 1
            await raw.send(Generate(f"wait-{i}", prompt=long_prompt(chars, i), max_new_tokens=1))
        refused = await raw.call(Generate("one-too-many", prompt=prompt, max_new_tokens=1))
        assert isinstance(refused, Error) and refused.code == "overloaded"
        assert refused.message == (
            f"{MAX_WAITING_PROMPTS} long prompts are waiting to be tokenized (the limit)"
        )
        seen: set[str] = set()
        while len(seen) < MAX_WAITING_PROMPTS:
            reply = await raw.recv(timeout=60.0)
            assert isinstance(reply, Finished), reply
            seen.add(reply.request_id)
        raw.close()
    finally:
        assert await s.stop() == {"frontdoor": 0, "detokenizer": 0}


@pytest.mark.parametrize("socket_mode", [0o600, 0o660])
async def test_socket_mode_does_not_follow_the_umask(
    tokenizer_dir: Path, tokenizer: Tokenizer, socket_mode: int
) -> None:
    old = os.umask(0)  # the children inherit it
    try:
        s = await serving_stack(tokenizer_dir, tokenizer, 64, socket_mode=socket_mode)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(ipc_file(s)).st_mode) == socket_mode
    finally:
        assert await s.stop() == {"frontdoor": 0, "detokenizer": 0}
