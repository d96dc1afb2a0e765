"""The front door and the detokenizer as real spawned processes; the daemon's side of the
internal pipes is scripted by the test (frontdoor_harness.FakeDaemon).

The blocking ``Client`` runs in worker threads (``asyncio.to_thread``) while the fake daemon
runs on the event loop. NOTE: not ``AsyncClient``: its ``close()`` closes the asyncio shadows
of its sockets, so the garbage-collected originals later close whatever socket libzmq has
since allocated at the same address (seen here as spurious disconnects and ENOTSOCK).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import pytest_asyncio
import zmq
from frontdoor_harness import (
    CONTEXT_LENGTH,
    REPLY_TEXT,
    RawClient,
    Stack,
    finish,
    install_speculative_spec,
    model_facts,
    start_stack,
    until,
)

from outrider.daemon.frontdoor.clients import PROBE_FIRST_S
from outrider.daemon.frontdoor.config import BACKLOG_MESSAGES, FrontDoorConfig
from outrider.daemon.frontdoor.process import HEARTBEAT_FRESH_S, run_frontdoor
from outrider.daemon.internal import ErrorInfo, RequestUpdate, StateChange
from outrider.daemon.sampling_defaults import SamplingDefaults
from outrider.daemon.tokenizer import Tokenizer
from outrider.protocol import (
    REPLY_HWM,
    Client,
    GenerateResult,
    RequestError,
    Timeout,
    TokenChunk,
    TokenStream,
)
from outrider.protocol.frames import reply_codec
from outrider.protocol.messages import (
    Abort,
    Ack,
    Chunk,
    ClientReply,
    Error,
    Finished,
    Generate,
    Health,
    HealthQuery,
    is_final,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")
T = TypeVar("T")

SLOW_CONSUMER_S = 0.5
# The shared front door's sampling defaults (--generation-config auto on a Qwen3 model).
DEFAULTS = SamplingDefaults(0.6, 0.95, 20, source="from generation_config.json")


@pytest.fixture(scope="module")
def vocab_size(tokenizer: Tokenizer) -> int:
    return len(tokenizer) + 4  # the model's embedding table is a little larger


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tokenizer_dir: Path, tokenizer: Tokenizer, vocab_size: int) -> AsyncIterator[Stack]:
    reply_ids = tokenizer.encode_prompt(REPLY_TEXT)[1:]  # without BOS
    s = start_stack(
        tokenizer_dir,
        reply_ids,
        max_inflight_per_client=60,
        max_inflight=100,
        slow_consumer_timeout=SLOW_CONSUMER_S,
        client_hwm=4,
        sampling_defaults=DEFAULTS,
    )
    assert (await s.status("frontdoor")).state == "started"
    assert (await s.status("detokenizer")).state == "started"
    await s.daemon.start_serving(model_facts(tokenizer_dir, vocab_size))
    assert (await s.status("frontdoor")).state == "serving"
    yield s
    assert await s.stop() == {"frontdoor": 0, "detokenizer": 0}


@pytest.fixture
def client(stack: Stack) -> Iterator[Client]:
    with Client(stack.client_endpoint, timeout=5.0) as c:
        yield c


async def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """A blocking client call, off the event loop that runs the fake daemon."""
    return await asyncio.to_thread(fn, *args, **kwargs)


def drain(stream: TokenStream) -> tuple[list[TokenChunk], GenerateResult]:
    chunks = list(stream)
    result = stream.result
    assert result is not None
    return chunks, result


async def test_children_report_their_state_and_never_import_torch(stack: Stack) -> None:
    frontdoor, detokenizer = stack.statuses["frontdoor"], stack.statuses["detokenizer"]
    assert [s.state for s in frontdoor] == ["started", "serving"]
    assert frontdoor[1].endpoint == stack.client_endpoint
    assert [s.state for s in detokenizer] == ["started"]
    assert not any(s.torch_imported for s in frontdoor + detokenizer)
    assert {s.pid for s in frontdoor} == {stack.processes["frontdoor"].pid}
    for proc in stack.processes.values():  # the daemon stops them, not signals
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGINT)
        os.kill(proc.pid, signal.SIGTERM)
    with Client(stack.client_endpoint, timeout=5.0) as c:
        result = await call(c.generate, input_ids=[5], max_new_tokens=2)
    assert result.output_ids == stack.daemon.reply_ids[:2]
    assert all(proc.is_alive() for proc in stack.processes.values())


async def test_lifecycle_curve_token_ids_only_plugin_check_and_draining(tmp_path: Path) -> None:
    spec_path = install_speculative_spec(tmp_path / "site", "test-spec")
    public, secret = zmq.curve_keypair()
    allowed = zmq.curve_keypair()
    s = start_stack(
        None,
        list(range(10, 30)),
        extra_sys_path=spec_path,
        curve_server_keys=(public, secret),
        curve_client_keys=(allowed[0],),
    )
    try:
        await s.status("frontdoor")
        # Not ready: no client socket at all, so health() times out.
        early = Client(s.client_endpoint, curve_server_key=public, curve_keypair=allowed)
        with early, pytest.raises(Timeout):
            await call(early.health, timeout=0.5)
        assert not os.path.exists(s.client_endpoint.removeprefix("ipc://"))

        await s.daemon.start_serving(model_facts(None, 100, speculative_algorithm="test-spec"))
        assert (await s.status("frontdoor")).state == "serving"
        plaintext = s.raw()  # not CURVE: never gets through the handshake
        # NOTE: once its handshake has failed the DEALER has no pipe and its send waits for
        # good; before that the send leaves and no reply comes. Either way: nothing in time.
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await plaintext.send(HealthQuery("plain"))
                await plaintext.recv(timeout=5.0)
        plaintext.close()
        stranger = Client(s.client_endpoint, timeout=5.0, curve_server_key=public)
        with stranger, pytest.raises(RequestError) as refused:  # a keypair not listed
            await call(stranger.health)
        assert refused.value.code == "connection_lost"
        with Client(
            s.client_endpoint, timeout=5.0, curve_server_key=public, curve_keypair=allowed
        ) as c:
            health = await call(c.health)
            assert (health.status, health.boot_id, health.version) == (
                "serving",
                "boot-test",
                "0.1.0-test",
            )
            for kwargs, field in (
                ({"prompt": "hi"}, "prompt"),
                ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),
                ({"input_ids": [1], "stop": ["x"]}, "stop"),
            ):
                with pytest.raises(RequestError) as err:
                    await call(c.generate, **kwargs, max_new_tokens=2)
                assert err.value.code == "unsupported" and field in err.value.message
            with pytest.raises(RequestError) as err:
                await call(c.generate, input_ids=[5, 6], logprobs=2, max_new_tokens=2)
            assert err.value.code == "unsupported"
            assert err.value.message == "test-spec cannot return logprobs"

            result = await call(c.generate, input_ids=[5, 6], max_new_tokens=4)
            assert (result.output_ids, result.text) == ([10, 11, 12, 13], "")
            last = c.stream(input_ids=[5], request_id="last")  # held until the very end
            rid = (await s.daemon.request("last")).rid

            await s.daemon.send_control(StateChange("draining"))
            while (await call(c.health)).status != "draining":
                await asyncio.sleep(0.02)
            with pytest.raises(RequestError) as err:
                await call(c.generate, input_ids=[5], max_new_tokens=2)
            assert err.value.code == "shutting_down"

            # The daemon's last final, then it stops the children at once (detokenizer
            # first): the final still reaches the client.
            await s.daemon.send(RequestUpdate(rid, [7, 8], finish=finish("abort")))
            assert await s.stop() == {"detokenizer": 0, "frontdoor": 0}
            chunks, result = await call(drain, last)
            assert (result.output_ids, result.finish_reason) == ([7, 8], "abort")
            assert [t for chunk in chunks for t in chunk.token_ids] == [7, 8]
    finally:
        await s.stop()


async def test_a_child_that_cannot_start_exits_non_zero(tmp_path: Path) -> None:
    cfg = FrontDoorConfig(
        client_endpoint=f"ipc://{tmp_path}/client.sock",
        daemon_endpoint=f"ipc://{tmp_path}/to-daemon.sock",
        outputs_endpoint=f"ipc://{tmp_path}/missing-directory/outputs.sock",  # cannot bind
        control_endpoint=f"ipc://{tmp_path}/control.sock",
        boot_id="b",
        version="v",
    )
    spawn = multiprocessing.get_context("spawn")
    parent_end, child_end = spawn.Pipe()
    proc = spawn.Process(target=run_frontdoor, args=(cfg, child_end), daemon=True)
    proc.start()
    child_end.close()
    await asyncio.to_thread(proc.join, 20)
    parent_end.close()
    assert proc.exitcode == 1


def _validation_cases(vocab: int) -> list[tuple[str, Any, str, str]]:
    """(case id, request body or raw frame, code, text the message must contain)."""
    ok: dict[str, Any] = {"type": "generate", "request_id": "v", "input_ids": [5]}
    cases: list[tuple[str, Any, str, str]] = [
        ("garbage body", b"\x11\xc1", "malformed", "undecodable"),
        ("unknown frame kind", b"\x71\x80", "malformed", "frame kind"),
        ("other version", b"\x1f" + b"\x81\xaarequest_id\xa1v", "unsupported_version", "version"),
        ("unknown type", {**ok, "type": "bogus"}, "invalid_request", "type"),
        ("empty request_id", {**ok, "request_id": ""}, "invalid_request", "request_id"),
        ("no prompt", {"type": "generate", "request_id": "v"}, "invalid_request", "exactly one"),
        ("two prompts", {**ok, "prompt": "hi"}, "invalid_request", "prompt and input_ids"),
        ("empty input_ids", {**ok, "input_ids": []}, "invalid_request", "input_ids is empty"),
        ("id >= vocab", {**ok, "input_ids": [5, vocab]}, "invalid_request", "input_ids[1]"),
        ("negative id", {**ok, "input_ids": [-1]}, "invalid_request", "input_ids"),
        ("bias id >= vocab", {**ok, "logit_bias": {vocab: 1.0}}, "invalid_request", "logit_bias"),
        ("bias past 100", {**ok, "logit_bias": {5: 101.0}}, "invalid_request", "logit_bias"),
        ("presence past 2", {**ok, "presence_penalty": 2.5}, "invalid_request", "presence"),
        ("repetition 0", {**ok, "repetition_penalty": 0.0}, "invalid_request", "repetition"),
        ("min_p past 1", {**ok, "min_p": 1.5}, "invalid_request", "min_p"),
        ("max_drafts below 0", {**ok, "max_drafts": -1}, "invalid_request", "max_drafts"),
        ("max_drafts past 1024", {**ok, "max_drafts": 1025}, "invalid_request", "max_drafts"),
        ("too long", {**ok, "input_ids": [5] * CONTEXT_LENGTH}, "prompt_too_long", "input_ids"),
        (
            "long prompt",
            {**ok, "input_ids": None, "prompt": "fox " * 80},
            "prompt_too_long",
            "prompt",
        ),
        (
            "empty messages",
            {**ok, "input_ids": None, "messages": []},
            "invalid_request",
            "messages",
        ),
        (
            "template error",
            {**ok, "input_ids": None, "messages": [{"role": "robot", "content": "x"}]},
            "invalid_request",
            "messages: chat template failed: TemplateError: unknown role robot",
        ),
        ("tiny temperature", {**ok, "temperature": 1e-7}, "invalid_request", "temperature"),
        ("hot temperature", {**ok, "temperature": 100.5}, "invalid_request", "temperature"),
        ("nan temperature", {**ok, "temperature": float("nan")}, "invalid_request", "temperature"),
        ("inf temperature", {**ok, "temperature": float("inf")}, "invalid_request", "temperature"),
        ("zero top_p", {**ok, "top_p": 0.0}, "invalid_request", "top_p"),
        ("big top_p", {**ok, "top_p": 1.01}, "invalid_request", "top_p"),
        ("nan top_p", {**ok, "top_p": float("nan")}, "invalid_request", "top_p"),
        ("top_k > vocab", {**ok, "top_k": vocab + 1}, "invalid_request", "top_k"),
        ("negative top_k", {**ok, "top_k": -1}, "invalid_request", "top_k"),
        ("logprobs > 20", {**ok, "logprobs": 21}, "invalid_request", "logprobs"),
        ("seed 2**63", {**ok, "seed": 2**63}, "invalid_request", "seed"),
        ("negative seed", {**ok, "seed": -1}, "invalid_request", "seed"),
        ("negative max", {**ok, "max_new_tokens": -1}, "invalid_request", "max_new_tokens"),
        (
            "max past the context",
            {**ok, "input_ids": [5] * 4, "max_new_tokens": CONTEXT_LENGTH - 3},
            "invalid_request",
            f"{CONTEXT_LENGTH - 3} new tokens after a prompt of 4 tokens pass the context length "
            f"of {CONTEXT_LENGTH}: at most {CONTEXT_LENGTH - 4} new tokens fit "
            "- at `$.max_new_tokens`",
        ),
        ("17 stops", {**ok, "stop": ["x"] * 17}, "invalid_request", "stop"),
        ("empty stop", {**ok, "stop": ["a", ""]}, "invalid_request", "stop[1]"),
        ("long stop", {**ok, "stop": ["x" * 257]}, "invalid_request", "stop[0]"),
        ("stop id", {**ok, "stop_token_ids": [vocab]}, "invalid_request", "stop_token_ids[0]"),
    ]
    return cases


_CASE_NAMES = [case[0] for case in _validation_cases(0)]


@pytest.mark.parametrize("index", range(len(_CASE_NAMES)), ids=_CASE_NAMES)
async def test_validation_errors_name_the_field(stack: Stack, vocab_size: int, index: int) -> None:
    name, body, code, text = _validation_cases(vocab_size)[index]
    raw = stack.raw()
    try:
        reply = await raw.call(body)
        assert isinstance(reply, Error), name
        assert reply.code == code, (name, reply)
        assert text in reply.message, (name, reply.message)
        if code != "malformed" and name != "empty request_id":
            assert reply.request_id == "v"  # still named, even when the body is refused
        # The same client is still served.
        assert isinstance(await raw.call(HealthQuery("h")), Health)
    finally:
        raw.close()


async def test_extra_frames_are_malformed(stack: Stack) -> None:
    raw = stack.raw()
    try:
        await raw.sock.send_multipart([b"\x11\x80", b"buffer"])
        reply = await raw.recv()
        assert isinstance(reply, Error) and reply.code == "malformed"
    finally:
        raw.close()


async def test_tokenization_seed_and_chat_template(
    stack: Stack, client: Client, tokenizer: Tokenizer
) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    await call(client.generate, messages=messages, max_new_tokens=1, request_id="chat")
    chat = await stack.daemon.request("chat")
    assert chat.input_ids == tokenizer.apply_chat_template(messages)
    assert 0 <= chat.sampling.seed < 2**63

    await call(client.generate, "hello world", max_new_tokens=1, seed=7, request_id="plain")
    plain = await stack.daemon.request("plain")
    assert plain.input_ids == tokenizer.encode_prompt("hello world")
    assert plain.input_ids[0] == tokenizer.backend.token_to_id("<s>")  # the default BOS
    assert plain.sampling.seed == 7


async def test_left_out_sampling_values_get_the_defaults(stack: Stack, client: Client) -> None:
    async def sampled(request_id: str, **given: float) -> tuple[float, float, int]:
        await call(client.generate, input_ids=[5], max_new_tokens=1, request_id=request_id, **given)
        s = (await stack.daemon.request(request_id)).sampling
        return (s.temperature, s.top_p, s.top_k)

    assert await sampled("defaults") == (0.6, 0.95, 20)
    assert await sampled("given", temperature=1.0, top_p=1.0, top_k=0) == (1.0, 1.0, 0)
    assert await sampled("greedy", temperature=0.0) == (0.0, 0.95, 20)
    # A frame without the keys at all (not even nil) is the same.
    raw = stack.raw()
    try:
        body = {"type": "generate", "request_id": "absent", "input_ids": [5], "max_new_tokens": 1}
        assert isinstance(await raw.call(body), Finished)
    finally:
        raw.close()
    absent = (await stack.daemon.request("absent")).sampling
    assert (absent.temperature, absent.top_p, absent.top_k) == (0.6, 0.95, 20)


async def test_max_new_tokens_zero_is_answered_without_the_daemon(
    stack: Stack, client: Client
) -> None:
    result = await call(client.generate, input_ids=[5, 6, 7], max_new_tokens=0, request_id="zero")
    assert (result.finish_reason, result.output_ids, result.text) == ("length", [], "")
    assert result.usage.prompt_tokens == 3
    assert "zero" not in stack.daemon.requests


async def test_max_new_tokens_up_to_the_context_is_forwarded(stack: Stack, client: Client) -> None:
    exact = CONTEXT_LENGTH - 4
    await call(client.generate, input_ids=[5] * 4, max_new_tokens=exact, request_id="exact")
    assert (await stack.daemon.request("exact")).max_new_tokens == exact
    raw = stack.raw()
    try:
        await raw.send(Generate("open", input_ids=[5] * 4))
        assert (await stack.daemon.request("open")).max_new_tokens is None  # to the context
    finally:
        raw.close()


async def test_a_draft_cap_is_forwarded_and_none_leaves_the_daemons(
    stack: Stack, client: Client
) -> None:
    for request_id, cap in (("capped", 2), ("off", 0), ("open", None)):
        await call(client.generate, input_ids=[5], max_new_tokens=3, max_drafts=cap,
                   request_id=request_id)  # fmt: skip
        assert (await stack.daemon.request(request_id)).max_drafts == cap, request_id


async def test_stream_chunks_concatenate_to_the_final(
    stack: Stack, client: Client, tokenizer: Tokenizer
) -> None:
    chunks, result = await call(drain, client.stream(input_ids=[5], max_new_tokens=13, logprobs=1))
    assert len(chunks) == 5  # 3 + 3 + 3 + 3 + 1 tokens
    assert [t for c in chunks for t in c.token_ids] == result.output_ids
    assert "".join(c.text for c in chunks) == result.text
    assert [lp for c in chunks for lp in c.logprobs or []] == result.logprobs
    assert result.output_ids == stack.daemon.reply_ids[:13]
    assert result.text == tokenizer.backend.decode(result.output_ids)
    assert REPLY_TEXT.startswith(result.text)


async def test_stop_string_cuts_the_text(
    stack: Stack, client: Client, tokenizer: Tokenizer
) -> None:
    ids = stack.daemon.reply_ids
    decoder = tokenizer.decoder()
    n = next(i + 1 for i, t in enumerate(ids) if "fox" in decoder.text + decoder.step(t))
    cut = decoder.text.index("fox")
    stream = client.stream(input_ids=[5], stop=["fox"], request_id="stop")
    rid = (await stack.daemon.request("stop")).rid
    # The daemon streams only tokens that cannot begin "fox"; the final update carries the
    # rest of the tokens and the cut.
    await stack.daemon.send(RequestUpdate(rid, ids[:2]))
    await stack.daemon.send(RequestUpdate(rid, ids[2:n], finish=finish("stop", cut, "fox")))
    chunks, result = await call(drain, stream)
    assert result.text == REPLY_TEXT[:cut] == "".join(c.text for c in chunks)
    assert result.output_ids == ids[:n] == [t for c in chunks for t in c.token_ids]
    assert (result.finish_reason, result.matched_stop) == ("stop", "fox")

    task = asyncio.ensure_future(
        call(client.generate, input_ids=[5], stop=["fox"], request_id="st2")
    )
    rid = (await stack.daemon.request("st2")).rid
    await stack.daemon.send(RequestUpdate(rid, ids[:n], finish=finish("stop", cut, "fox")))
    assert (await task).text == REPLY_TEXT[:cut]


async def test_error_update_becomes_an_error_frame(stack: Stack, client: Client) -> None:
    task = asyncio.ensure_future(call(client.generate, input_ids=[5], request_id="boom"))
    rid = (await stack.daemon.request("boom")).rid
    await stack.daemon.send(RequestUpdate(rid, [], error=ErrorInfo("internal", "kaboom")))
    with pytest.raises(RequestError) as err:
        await task
    assert (err.value.code, err.value.message) == ("internal", "kaboom")


async def test_request_ids_are_each_clients_own(stack: Stack, client: Client) -> None:
    stream = client.stream(input_ids=[5], request_id="dup")
    rid = (await stack.daemon.request("dup")).rid
    raw = stack.raw()
    try:
        with Client(stack.client_endpoint, timeout=5.0) as other:
            with pytest.raises(RequestError) as err:  # another client sees no request "dup"
                await call(other.abort, "dup")
            assert err.value.code == "unknown_request"
        # Another client's id is no secret to reveal and no obstacle: "dup" runs for it too.
        await raw.send(Generate("dup", input_ids=[5], max_new_tokens=2))
        await until(lambda: stack.daemon.requests["dup"].rid != rid)
        reply = await raw.recv()
        assert isinstance(reply, Finished) and reply.request_id == "dup"
        # Within one client an id in flight is taken.
        await raw.send(Generate("dup2", input_ids=[5], stream=True))
        await stack.daemon.request("dup2")
        reply = await raw.call(Generate("dup2", input_ids=[5]))
        assert isinstance(reply, Error) and reply.code == "duplicate_request_id"
        assert "dup2" in reply.message
        reply = await raw.call(Abort("ab", "dup2"))
        assert reply == Ack("ab")
    finally:
        raw.close()
    await call(client.abort, "dup")
    chunks, result = await call(drain, stream)
    assert (chunks, result.finish_reason) == ([], "abort")
    assert [a.rid for a in stack.daemon.aborts if a.rid == rid] == [rid]
    with pytest.raises(RequestError) as err:
        await call(client.abort, "dup")
    assert err.value.code == "unknown_request" and "target_id" in err.value.message


async def test_client_disconnect_aborts_its_requests(stack: Stack) -> None:
    raw = stack.raw()
    for rid in ("gone-1", "gone-2"):
        await raw.send(Generate(rid, input_ids=[5], stream=True))
    rids = {(await stack.daemon.request(r)).rid for r in ("gone-1", "gone-2")}
    raw.close()
    await until(lambda: rids <= {a.rid for a in stack.daemon.aborts})
    assert {a.reason for a in stack.daemon.aborts if a.rid in rids} == {"client disconnected"}

    # Sent, then gone before the front door read it: run, and aborted at the next probe.
    hasty = stack.raw()
    await hasty.send(Generate("hasty", input_ids=[5]))
    hasty.sock.close(linger=1000)  # the request does leave
    hasty_rid = (await stack.daemon.request("hasty")).rid
    await until(lambda: hasty_rid in {a.rid for a in stack.daemon.aborts}, 3 * PROBE_FIRST_S)


async def read_finals(raw: RawClient, wanted: int, timeout: float = 10.0) -> list[ClientReply]:
    """Every final frame ``raw`` reads until it has ``wanted`` of them (chunks skipped)."""
    finals: list[ClientReply] = []
    while len(finals) < wanted:
        reply = await raw.recv(timeout)
        if is_final(reply):
            finals.append(reply)
    return finals


async def test_a_slow_consumer_gets_one_final_per_request(stack: Stack) -> None:
    raw = stack.raw(rcvhwm=1)  # and it reads nothing until the end
    for i in range(3):
        await raw.send(Generate(f"slow{i}", input_ids=[5], stream=True))
    rids = [(await stack.daemon.request(f"slow{i}")).rid for i in range(3)]
    ids = stack.daemon.reply_ids
    flood = [RequestUpdate(rid, ids * 4) for rid in rids]
    for _ in range(100):  # far more than the socket buffers hold
        await stack.daemon.send(*flood)
    # Finished while its client is behind: its final waits in the backlog and must survive.
    await raw.send(Generate("late", input_ids=[5], max_new_tokens=2))
    while not set(rids) <= {a.rid for a in stack.daemon.aborts}:
        await stack.daemon.send(*flood)
        await asyncio.sleep(0.01)
    assert {a.reason for a in stack.daemon.aborts if a.rid in rids} == {"slow consumer"}
    for rid in rids:  # the daemon's own finals for them, dropped by the front door
        await stack.daemon.send(RequestUpdate(rid, [], finish=finish("abort")))
    finals = await read_finals(raw, 4)
    assert sorted(f.request_id for f in finals) == ["late", "slow0", "slow1", "slow2"]
    late = next(f for f in finals if f.request_id == "late")
    assert isinstance(late, Finished) and late.output_ids == ids[:2]
    for final in finals:
        if final.request_id != "late":
            assert isinstance(final, Error) and final.code == "slow_consumer"
            assert "read its replies too slowly" in final.message
    with pytest.raises(TimeoutError):  # nothing more: exactly one final each
        await raw.recv(1.0)
    # The client is still a client: its ids are free again and it is served.
    reply = await raw.call(Generate("slow0", input_ids=[5], max_new_tokens=2))
    assert isinstance(reply, Finished) and reply.request_id == "slow0"
    raw.close()


async def test_a_client_without_a_reply_limit_is_never_behind(
    tokenizer_dir: Path, tokenizer: Tokenizer, vocab_size: int
) -> None:
    # Its ZeroMQ I/O thread takes every reply in, whatever the client's own thread does: the
    # HTTP front's connection, whose event loop may stall, is such a client. The front door
    # keeps its default slow-consumer timeout here: the shared stack's 0.5 s is shorter than
    # a busy host may leave that thread unscheduled.
    timeout = FrontDoorConfig.slow_consumer_timeout
    s = start_stack(tokenizer_dir, tokenizer.encode_prompt(REPLY_TEXT)[1:], client_hwm=4)
    try:
        assert (await s.status("frontdoor")).state == "started"
        await s.daemon.start_serving(model_facts(tokenizer_dir, vocab_size))
        assert (await s.status("frontdoor")).state == "serving"
        with Client(s.client_endpoint, timeout=60.0, reply_hwm=0) as client:
            streams = [client.stream(input_ids=[5], request_id=f"unbounded{i}") for i in range(3)]
            rids = [(await s.daemon.request(f"unbounded{i}")).rid for i in range(3)]
            ids = s.daemon.reply_ids
            # Twice what the client's reply limit and the socket buffers of a client with the
            # default limit hold: that one is a slow consumer.
            for _ in range(2 * REPLY_HWM // len(rids)):
                await s.daemon.send(*(RequestUpdate(rid, ids * 20) for rid in rids))
            await asyncio.sleep(1.5 * timeout)  # and it still reads nothing
            await s.daemon.send(*(RequestUpdate(rid, [], finish=finish("length")) for rid in rids))
            for stream in streams:
                _, result = await call(drain, stream)
                assert result.output_ids == ids * 20 * (2 * REPLY_HWM // len(rids))
                assert result.finish_reason == "length"
        assert not {a.rid for a in s.daemon.aborts} & set(rids)
    finally:
        assert await s.stop() == {"frontdoor": 0, "detokenizer": 0}


async def test_a_client_that_floods_without_reading_is_cut_off(tokenizer_dir: Path) -> None:
    # Cut off once the finals queued for it are over BACKLOG_MESSAGES x 4096 bytes: it sends
    # twice as many requests as the smallest finals take to pass that.
    limit = BACKLOG_MESSAGES * 4096
    smallest_final = len(reply_codec().encode(Finished("f0", [], "", "length")))
    s = start_stack(
        tokenizer_dir, [7] * 40, slow_consumer_timeout=0.2, max_message_bytes=4096, client_hwm=4
    )
    try:
        assert (await s.status("frontdoor")).state == "started"
        await s.daemon.start_serving(model_facts(tokenizer_dir, 1000))
        assert (await s.status("frontdoor")).state == "serving"
        flooder = s.raw(rcvhwm=1)  # it sends and never reads
        for i in range(2 * limit // smallest_final):
            await flooder.send(Generate(f"f{i}", input_ids=[5], max_new_tokens=40, stream=True))
        seen = -1
        while seen != len(s.daemon.requests):  # until no more of them reach the daemon
            seen = len(s.daemon.requests)
            await asyncio.sleep(0.5)
        # From now on the flooder is not heard: its next request never reaches the daemon.
        await flooder.send(Generate("after-the-cut", input_ids=[5], max_new_tokens=2))
        with Client(s.client_endpoint, timeout=5.0) as other:  # while others are served
            result = await call(other.generate, input_ids=[5], max_new_tokens=2)
        assert result.output_ids == [7, 7]
        await asyncio.sleep(0.5)
        assert "after-the-cut" not in s.daemon.requests
        flooder.close()
    finally:
        assert await s.stop() == {"frontdoor": 0, "detokenizer": 0}


async def test_health_needs_the_detokenizer_running(stack: Stack, client: Client) -> None:
    assert (await call(client.health)).status == "serving"
    pid = stack.processes["detokenizer"].pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        await until(lambda: client.health().status == "not_serving", 2 * HEARTBEAT_FRESH_S)
    finally:
        os.kill(pid, signal.SIGCONT)
    await until(lambda: client.health().status == "serving", 5.0)


async def test_inflight_limits_answer_overloaded(stack: Stack) -> None:
    a, b = stack.raw(), stack.raw()
    try:
        for i in range(60):
            await a.send(Generate(f"lim-a{i}", input_ids=[5]))
        reply = await a.call(Generate("lim-a60", input_ids=[5]))
        assert isinstance(reply, Error) and reply.code == "overloaded"
        assert "per-client" in reply.message
        await until(lambda: all(f"lim-a{i}" in stack.daemon.requests for i in range(60)))
        for i in range(40):
            await b.send(Generate(f"lim-b{i}", input_ids=[5]))
        reply = await b.call(Generate("lim-b40", input_ids=[5]))
        assert isinstance(reply, Error) and reply.code == "overloaded"
        assert "global" in reply.message
        # Each final reaches its client after the front door let its request go, so the
        # next test on this stack starts with all 100 places free.
        for raw, prefix, count in ((a, "lim-a", 60), (b, "lim-b", 40)):
            for i in range(count):
                await raw.send(Abort(f"abort-{prefix}{i}", f"{prefix}{i}"))
            replies = [await raw.recv() for _ in range(2 * count)]  # an Ack and a final each
            finals = [r for r in replies if isinstance(r, Finished)]
            assert sorted(f.request_id for f in finals) == sorted(
                f"{prefix}{i}" for i in range(count)
            )
            assert {f.finish_reason for f in finals} == {"abort"}
    finally:
        a.close()
        b.close()
    assert stack.daemon.held == set()


async def test_fifty_concurrent_requests_get_exactly_one_final(stack: Stack) -> None:
    raw = stack.raw()
    ids = [f"c{i}" for i in range(50)]
    expected: dict[str, str] = {}
    for i, request_id in enumerate(ids):
        body: dict[str, Any] = {"input_ids": [5, 6], "stream": i % 2 == 0}
        if i % 10 == 3:
            body["top_p"] = 0.0  # rejected: an Error final
            expected[request_id] = "error"
        elif i % 10 == 7:
            body["max_new_tokens"] = 0
            expected[request_id] = "length"
        elif i % 10 == 9:
            expected[request_id] = "abort"  # held, then aborted
        else:
            body["max_new_tokens"] = 1 + i % 8
            expected[request_id] = "length"
        await raw.send({"type": "generate", "request_id": request_id, **body})
    held = [r for r in ids if expected[r] == "abort"]
    # Generous: 50 requests pass the front door first, slower on a loaded 2-core host.
    await until(lambda: all(r in stack.daemon.requests for r in held), timeout=20.0)
    for request_id in held:
        await raw.send(Abort(f"abort-{request_id}", request_id))

    finals: Counter[str] = Counter()
    seen_after_final: list[Any] = []
    outcome: dict[str, str] = {}
    while len(finals) < len(ids):
        reply = await raw.recv()
        if isinstance(reply, Ack):
            continue
        if reply.request_id in finals:
            seen_after_final.append(reply)
        if is_final(reply):
            finals[reply.request_id] += 1
            outcome[reply.request_id] = (
                reply.finish_reason if isinstance(reply, Finished) else "error"
            )
        else:
            assert isinstance(reply, Chunk)
    # Stale updates for finished rids are dropped, and nothing else trails a final.
    done = [stack.daemon.requests[r].rid for r in ids if r in stack.daemon.requests]
    await stack.daemon.send(*(RequestUpdate(rid, [7], finish=finish("stop")) for rid in done))
    with pytest.raises(asyncio.TimeoutError):
        extra = await raw.recv(timeout=0.3)
        seen_after_final.append(extra)
    raw.close()
    assert seen_after_final == []
    assert set(finals.values()) == {1}
    assert outcome == expected


async def test_server_info_counts_every_finished_request(stack: Stack, client: Client) -> None:
    before = (await call(client.server_info)).requests_finished
    for max_new_tokens in (2, 2, 2, 0):  # the last one is answered by the front door alone
        await call(client.generate, input_ids=[5], max_new_tokens=max_new_tokens)
    stream = client.stream(input_ids=[5], request_id="info-abort")
    await stack.daemon.request("info-abort")
    await call(client.abort, "info-abort")
    assert (await call(drain, stream))[1].finish_reason == "abort"
    vanishing = stack.raw()  # its request is aborted by the daemon when it goes
    await vanishing.send(Generate("info-vanish", input_ids=[5]))
    rid = (await stack.daemon.request("info-vanish")).rid
    vanishing.close()
    await until(lambda: rid in {a.rid for a in stack.daemon.aborts})
    info = await call(client.server_info)
    after = info.requests_finished
    assert after["length"] - before["length"] == 4
    assert after["abort"] - before["abort"] == 2
    assert after["stop"] == before["stop"]
    assert (info.boot_id, info.model, info.running, info.waiting) == (
        "boot-test",
        "tiny-test",
        3,
        1,
    )
    sampling_defaults = {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "source": "from generation_config.json",
    }
    assert (info.configuration, info.plugins) == (
        {"page_size": 16, "sampling_defaults": sampling_defaults},
        {"attention": "torch"},
    )


async def test_health_is_serving_with_fresh_heartbeats(client: Client) -> None:
    health = await call(client.health)
    assert (health.status, health.boot_id, health.protocol_version) == ("serving", "boot-test", 1)
