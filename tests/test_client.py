"""The client library and ``outrider generate`` against a scripted ROUTER peer.

The peer is a real ZeroMQ ROUTER over ``ipc://`` in a thread: it decodes requests with
``request_codec()`` and answers with ``reply_codec()`` frames, as the daemon's front door does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import io
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from outrider.daemon.cli import generate as generate_cmd
from outrider.daemon.cli.generate import add_generate_arguments, run_generate
from outrider.protocol import (
    CONNECT_TIMEOUT_S,
    AsyncClient,
    ChatMessage,
    Client,
    GenerateResult,
    Health,
    NotListening,
    RequestError,
    ServerInfo,
    Timeout,
    TokenChunk,
    Usage,
)
from outrider.protocol.client import LINGER_MS, SILENT_DROPS_LIMIT
from outrider.protocol.endpoints import (
    default_endpoint,
    ipc_path,
    lock_file_path,
    not_listening_reason,
)
from outrider.protocol.frames import reply_codec, request_codec
from outrider.protocol.messages import (
    Abort,
    Ack,
    Chunk,
    ClientReply,
    ClientRequest,
    Error,
    Finished,
    Generate,
    HealthQuery,
    ServerInfoQuery,
)

Handler = Callable[["Peer", bytes, ClientRequest], None]


class Peer:
    """A scripted daemon front door: ``handler(peer, identity, request)`` answers with
    ``peer.send``; every decoded request is kept in ``requests``."""

    def __init__(self, endpoint: str, handler: Handler, curve_secret: bytes | None = None) -> None:
        self.endpoint = endpoint
        self.handler = handler
        self.curve_secret = curve_secret
        self.requests: list[ClientRequest] = []
        self.port = 0  # the TCP port bound, once started (0 for other transports)
        self._replies = reply_codec()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, delay: float = 0.0) -> Peer:
        self._delay = delay
        self._thread.start()
        if delay == 0.0:
            self._bound.wait(5)
        return self

    def send(self, identity: bytes, reply: ClientReply) -> None:
        self.send_raw(identity, self._replies.encode(reply))

    def send_raw(self, identity: bytes, frame: bytes) -> None:
        self._sock.send_multipart([identity, frame])

    def close_now(self) -> None:
        """Vanish without answering (called from the handler, on the peer's thread)."""
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        time.sleep(self._delay)
        codec = request_codec()
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if self.curve_secret is not None:
            self._sock.setsockopt(zmq.CURVE_SERVER, 1)
            self._sock.setsockopt(zmq.CURVE_SECRETKEY, self.curve_secret)
        self._sock.bind(self.endpoint)
        if self.endpoint.startswith("tcp://"):
            self.port = int(self._sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        self._bound.set()
        try:
            while not self._stop.is_set():
                if not self._sock.poll(20):
                    continue
                identity, frame = self._sock.recv_multipart()
                request = codec.decode(frame)
                self.requests.append(request)
                self.handler(self, identity, request)
        finally:
            self._sock.close(linger=500)


def finished(req: Generate, text: str) -> Finished:
    ids = [ord(c) for c in text]
    return Finished(req.request_id, ids, text, "stop", None, Usage(3, len(ids)))


def echo(peer: Peer, identity: bytes, req: ClientRequest) -> None:
    """Generate: the prompt back (streamed one character a chunk); Health/ServerInfo: boot "b1";
    Abort: Ack."""
    if isinstance(req, Generate):
        text = req.prompt or ""
        if req.stream:
            for c in text:
                peer.send(identity, Chunk(req.request_id, [ord(c)], c))
        peer.send(identity, finished(req, text))
    elif isinstance(req, HealthQuery):
        peer.send(identity, Health(req.request_id, "serving", "b1", "0.1.0", 1))
    elif isinstance(req, ServerInfoQuery):
        peer.send(identity, server_info(req.request_id, "b1"))
    elif isinstance(req, Abort):
        peer.send(identity, Ack(req.request_id))


def server_info(request_id: str, boot_id: str) -> ServerInfo:
    return ServerInfo(request_id, boot_id, "tiny", {}, {}, 0, 0, 0, 100, 0, 0, {})


def silent(peer: Peer, identity: bytes, req: ClientRequest) -> None:
    """A daemon that is there but never answers."""


REPLY_HEADER = reply_codec().header


def garbled(peer: Peer, identity: bytes, req: ClientRequest) -> None:
    """``echo``, but every reply comes after the daemon's liveness probe (an ``Ack`` with an
    empty id); prompt "utf8" gets a ``Finished`` whose text is not UTF-8 (its request id still
    readable); prompt "deep" gets first a ``Chunk`` nested too deeply to read even its request
    id, then an ``Ack`` whose id is not UTF-8."""
    peer.send(identity, Ack(""))
    packed_id = msgspec.msgpack.encode(req.request_id)
    if isinstance(req, Generate) and req.prompt == "utf8":
        peer.send_raw(
            identity, REPLY_HEADER + b"\x95\x02" + packed_id + b"\x90\xa2\xc3\x28\xa4stop"
        )
        return
    if isinstance(req, Generate) and req.prompt == "deep":
        deep = b"\x91" * 5_000 + b"\x90"
        peer.send_raw(identity, REPLY_HEADER + b"\x94\x01" + packed_id + deep + b"\xa1x")
        peer.send_raw(identity, REPLY_HEADER + b"\x92\x04\xa2\xff\xfe")
    echo(peer, identity, req)


def leave_stale_socket_file(path: str) -> None:
    """What a daemon that exited leaves behind: a socket file nothing listens on."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(path)


@pytest.fixture
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    # NOTE: ipc paths must fit sockaddr_un (107 bytes); tmp_path can be longer.
    return f"ipc://{tmp_path_factory.mktemp('ipc')}/d.sock"


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    started: list[Peer] = []
    yield started
    for peer in started:
        peer.stop()


def run_peer(peers: list[Peer], endpoint: str, handler: Handler, delay: float = 0.0) -> Peer:
    peer = Peer(endpoint, handler)
    peers.append(peer)
    return peer.start(delay)


# --- endpoints ---------------------------------------------------------------------------


def test_default_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/outrider:/run/other")
    assert default_endpoint() == "ipc:///run/outrider/outrider.sock"
    monkeypatch.delenv("RUNTIME_DIRECTORY")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/7")
    assert default_endpoint() == "ipc:///run/user/7/outrider/outrider.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_endpoint().startswith("ipc:///tmp/outrider-")
    assert ipc_path("ipc:///run/x.sock") == "/run/x.sock"
    assert ipc_path("ipc://@abstract") is None
    assert ipc_path("tcp://127.0.0.1:5555") is None


# --- Client ------------------------------------------------------------------------------


def test_generate_exact_result(endpoint: str, peers: list[Peer]) -> None:
    def answer(peer: Peer, identity: bytes, req: ClientRequest) -> None:
        assert isinstance(req, Generate)
        peer.send(
            identity,
            Finished(req.request_id, [5, 6], "hi", "length", None, Usage(4, 2, 1, 3, 2), None),
        )

    peer = run_peer(peers, endpoint, answer)
    with Client(endpoint, timeout=5) as client:
        result = client.generate(
            "hello", max_new_tokens=2, temperature=0.0, seed=7, stop="\n", request_id="r1"
        )
    assert result == GenerateResult("r1", [5, 6], "hi", "length", None, Usage(4, 2, 1, 3, 2), None)
    [req] = peer.requests
    assert req == Generate(
        request_id="r1", prompt="hello", max_new_tokens=2, temperature=0.0, seed=7, stop=["\n"]
    )


def test_sampling_values_left_out_travel_as_none(endpoint: str, peers: list[Peer]) -> None:
    peer = run_peer(peers, endpoint, echo)
    with Client(endpoint, timeout=5) as client:
        client.generate("a")
        list(client.stream("b", temperature=0.7, top_p=0.9, top_k=5))

    async def from_async() -> None:
        async with AsyncClient(endpoint, timeout=5) as client:
            await client.generate("c", top_k=0)
            async for _ in client.stream("d", temperature=0.0):
                pass

    asyncio.run(from_async())
    sent = [(r.temperature, r.top_p, r.top_k) for r in peer.requests if isinstance(r, Generate)]
    assert sent == [(None, None, None), (0.7, 0.9, 5), (None, None, 0), (0.0, None, None)]


def test_messages_and_input_ids_travel(endpoint: str, peers: list[Peer]) -> None:
    peer = run_peer(peers, endpoint, echo)
    with Client(endpoint, timeout=5) as client:
        chat = [{"role": "user", "content": "hi"}, ChatMessage("assistant", "yo")]
        assert client.generate(messages=chat).finish_reason == "stop"
        client.generate(input_ids=[1, 2, 3], stop_token_ids=[9], logprobs=2, ignore_eos=True)
    first, second = peer.requests
    assert isinstance(first, Generate) and isinstance(second, Generate)
    assert first.messages == [ChatMessage("user", "hi"), ChatMessage("assistant", "yo")]
    assert (second.input_ids, second.stop_token_ids, second.logprobs) == ([1, 2, 3], [9], 2)
    assert second.ignore_eos and len(first.request_id) == len(second.request_id) == 32


def test_exactly_one_input_is_checked_locally(endpoint: str) -> None:
    with Client(endpoint, timeout=0.5) as client:
        with pytest.raises(RequestError) as err:
            client.generate()
        assert err.value.code == "invalid_request"
        with pytest.raises(RequestError, match="invalid_request"):
            client.generate("a", input_ids=[1])
        with pytest.raises(RequestError, match="invalid_request"):
            client.stream(messages=[{"role": "user"}])


def test_stream_chunks_add_up_to_the_result(endpoint: str, peers: list[Peer]) -> None:
    run_peer(peers, endpoint, echo)
    with Client(endpoint, timeout=5) as client:
        stream = client.stream("abcd", request_id="s1")
        assert stream.request_id == "s1" and stream.result is None
        chunks = list(stream)
    assert all(isinstance(c, TokenChunk) and c.request_id == "s1" for c in chunks)
    assert stream.result is not None and stream.result.finish_reason == "stop"
    assert [t for c in chunks for t in c.token_ids] == stream.result.output_ids
    assert "".join(c.text for c in chunks) == stream.result.text == "abcd"


def failing(peer: Peer, identity: bytes, req: ClientRequest) -> None:
    if isinstance(req, Abort):
        peer.send(identity, Error(req.request_id, "unknown_request", f"no {req.target_id}"))
    else:
        peer.send(identity, Error(req.request_id, "overloaded", "too busy"))


def test_error_frames_raise_request_error(endpoint: str, peers: list[Peer]) -> None:
    run_peer(peers, endpoint, failing)
    with Client(endpoint, timeout=5) as client:
        with pytest.raises(RequestError) as err:
            client.generate("x", request_id="g1")
        assert (err.value.code, err.value.message, err.value.request_id) == (
            "overloaded",
            "too busy",
            "g1",
        )
        stream = client.stream("x", request_id="s1")
        with pytest.raises(RequestError) as err:
            next(stream)
        assert (err.value.code, err.value.request_id) == ("overloaded", "s1")
        assert list(stream) == []
        with pytest.raises(RequestError) as err:
            client.abort("gone")
        assert err.value.code == "unknown_request" and err.value.message == "no gone"


def test_abort_and_abandoned_streams(endpoint: str, peers: list[Peer]) -> None:
    def hold(peer: Peer, identity: bytes, req: ClientRequest) -> None:
        if isinstance(req, Generate):
            peer.send(identity, Chunk(req.request_id, [1], "a"))
        else:
            echo(peer, identity, req)

    peer = run_peer(peers, endpoint, hold)
    with Client(endpoint, timeout=5) as client:
        client.abort("whatever")
        stream = client.stream("x")
        assert next(stream).text == "a"
        stream.close()
        assert list(stream) == []
        dropped = client.stream("y")
        dropped_id = dropped.request_id
        assert next(dropped).text == "a"
        del dropped
        gc.collect()
        client.health()
    aborts = [r for r in peer.requests if isinstance(r, Abort)]
    assert [a.target_id for a in aborts] == ["whatever", stream.request_id, dropped_id]


def test_duplicate_ids_pass_through(endpoint: str, peers: list[Peer]) -> None:
    seen: set[str] = set()

    def once(peer: Peer, identity: bytes, req: ClientRequest) -> None:
        if isinstance(req, Generate) and req.request_id in seen:
            peer.send(identity, Error(req.request_id, "duplicate_request_id", "live"))
        elif isinstance(req, Generate):
            seen.add(req.request_id)
            peer.send(identity, finished(req, "ok"))

    peer = run_peer(peers, endpoint, once)
    with Client(endpoint, timeout=5) as client:
        assert client.generate("a", request_id="dup").text == "ok"
        with pytest.raises(RequestError) as err:
            client.generate("a", request_id="dup")
        assert (err.value.code, err.value.request_id) == ("duplicate_request_id", "dup")
        # Two live calls with one id cannot be told apart: refused before sending.
        live = client.stream("b", request_id="live")
        with pytest.raises(RequestError, match="duplicate_request_id"):
            client.generate("c", request_id="live")
        assert list(live) == [] and live.result is not None and live.result.text == "ok"
    assert [r.request_id for r in peer.requests] == ["dup", "dup", "live"]


def test_health_times_out_when_nothing_is_bound(endpoint: str) -> None:
    with Client(endpoint) as client:
        started = time.monotonic()
        with pytest.raises(Timeout) as err:
            client.health(timeout=0.2)
        assert 0.2 <= time.monotonic() - started < 2
    assert err.value.code == "timeout" and err.value.request_id
    assert isinstance(err.value, RequestError) and isinstance(err.value, TimeoutError)


def test_generate_waits_for_a_late_bind(endpoint: str, peers: list[Peer]) -> None:
    run_peer(peers, endpoint, echo, delay=0.3)
    with Client(endpoint) as client:
        assert client.generate("late", timeout=5).text == "late"
        assert client.health().boot_id == client.boot_id == "b1"
        assert client.server_info().model == "tiny"


def test_peer_vanishing_mid_request_is_connection_lost(endpoint: str, peers: list[Peer]) -> None:
    def vanish(peer: Peer, identity: bytes, req: ClientRequest) -> None:
        if isinstance(req, Generate):
            peer.close_now()
        else:
            echo(peer, identity, req)

    first = run_peer(peers, endpoint, vanish)
    with Client(endpoint, timeout=5) as client:
        assert client.health().status == "serving"
        with pytest.raises(RequestError) as err:
            client.generate("x", request_id="lost")
        assert (err.value.code, err.value.request_id) == ("connection_lost", "lost")
        first.stop()
        run_peer(peers, endpoint, echo)
        assert client.generate("again").text == "again"


def test_replies_sent_before_a_disconnect_are_delivered(endpoint: str, peers: list[Peer]) -> None:
    def answer_and_vanish(peer: Peer, identity: bytes, req: ClientRequest) -> None:
        echo(peer, identity, req)
        peer.close_now()

    run_peer(peers, endpoint, answer_and_vanish)
    with Client(endpoint, timeout=5) as client:
        stream = client.stream("ab")
        time.sleep(0.3)  # the chunks, the final frame and the disconnect event are all queued
        assert "".join(c.text for c in stream) == "ab"
        assert stream.result is not None and stream.result.text == "ab"


def test_new_boot_id_fails_calls_in_flight(endpoint: str, peers: list[Peer]) -> None:
    boots = iter(["b1", "b2"])

    def restarting(peer: Peer, identity: bytes, req: ClientRequest) -> None:
        if isinstance(req, HealthQuery):
            peer.send(identity, Health(req.request_id, "serving", next(boots), "0.1.0", 1))

    run_peer(peers, endpoint, restarting)
    with Client(endpoint, timeout=5) as client:
        client.health()
        stream = client.stream("never answered")
        assert client.health().boot_id == "b2"
        with pytest.raises(RequestError, match="connection_lost"):
            next(stream)


def test_generate_timeout_aborts(endpoint: str, peers: list[Peer]) -> None:
    peer = run_peer(peers, endpoint, lambda peer, identity, req: None)
    with Client(endpoint, timeout=0.2) as client, pytest.raises(Timeout):
        client.generate("slow", request_id="t1")
    deadline = time.monotonic() + 2
    while len(peer.requests) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert isinstance(peer.requests[-1], Abort) and peer.requests[-1].target_id == "t1"


def test_curve(endpoint: str, peers: list[Peer]) -> None:
    server_public, server_secret = zmq.curve_keypair()
    peer = Peer(endpoint, echo, curve_secret=server_secret)
    peers.append(peer.start())
    with Client(endpoint, timeout=5, curve_server_key=server_public) as client:
        assert client.generate("sealed").text == "sealed"
    wrong_public, _ = zmq.curve_keypair()
    with Client(endpoint, timeout=5, curve_server_key=wrong_public) as client:
        with pytest.raises(RequestError) as err:
            client.generate("x")
        assert err.value.code == "connection_lost"
    with pytest.raises(ValueError):
        Client(endpoint, curve_keypair=zmq.curve_keypair())


def test_a_failed_curve_handshake_leaves_later_clients_working(
    tmp_path_factory: pytest.TempPathFactory, peers: list[Peer]
) -> None:
    ipc = tmp_path_factory.mktemp("ipc")
    _, server_secret = zmq.curve_keypair()
    peers.append(Peer(f"ipc://{ipc}/curve.sock", echo, curve_secret=server_secret).start())
    wrong_key, _ = zmq.curve_keypair()
    refused = Client(f"ipc://{ipc}/curve.sock", curve_server_key=wrong_key)
    with refused, pytest.raises(RequestError):
        refused.health(timeout=1)
    time.sleep(LINGER_MS / 1000)  # the closed DEALER lingers, retrying its handshake
    run_peer(peers, f"ipc://{ipc}/plain.sock", echo)
    with Client(f"ipc://{ipc}/plain.sock", timeout=2) as client:
        assert client.health().status == "serving"


def test_undecodable_replies_fail_only_their_request(endpoint: str, peers: list[Peer]) -> None:
    run_peer(peers, endpoint, garbled)
    with Client(endpoint, timeout=5) as client:
        started = time.monotonic()
        with pytest.raises(RequestError) as err:
            client.generate("utf8", request_id="u1")
        assert (err.value.code, err.value.request_id) == ("malformed", "u1")
        assert err.value.message.startswith(f"undecodable reply from {endpoint}: ")
        assert time.monotonic() - started < 2  # at once, not at the timeout
        assert client.generate("deep").text == "deep"
        assert client.health().status == "serving"


def test_timeout_tells_not_listening_from_slow(endpoint: str, peers: list[Peer]) -> None:
    path = ipc_path(endpoint)
    assert path is not None
    with Client(endpoint, timeout=0.3) as client:
        with pytest.raises(NotListening) as err:
            client.health(timeout=0.3)
        assert (err.value.code, err.value.message) == (
            "timeout",
            f"no daemon is listening at {endpoint} (no socket file)",
        )
        leave_stale_socket_file(path)
        with pytest.raises(NotListening) as err:
            client.generate("x")
        assert err.value.message == (
            f"no daemon is listening at {endpoint} (stale socket file: nothing accepts on it)"
        )
    os.unlink(path)
    run_peer(peers, endpoint, silent)
    with Client(endpoint, timeout=0.3) as client, pytest.raises(Timeout) as err:
        client.health(timeout=0.3)
    assert not isinstance(err.value, NotListening)
    assert err.value.message == f"the daemon at {endpoint} did not answer in time"


# --- AsyncClient -------------------------------------------------------------------------


async def test_async_client_serves_concurrent_tasks_out_of_order(
    endpoint: str, peers: list[Peer]
) -> None:
    held: list[tuple[bytes, Generate]] = []

    def batch(peer: Peer, identity: bytes, req: ClientRequest) -> None:
        assert isinstance(req, Generate)
        held.append((identity, req))
        if len(held) == 50:
            random.Random(0).shuffle(held)
            for ident, r in held:
                peer.send(ident, Chunk(r.request_id, [0], "ignored by generate"))
                peer.send(ident, finished(r, r.prompt or ""))

    run_peer(peers, endpoint, batch)
    async with AsyncClient(endpoint, timeout=10) as client:
        results = await asyncio.gather(*(client.generate(f"p{i}") for i in range(50)))
    assert [r.text for r in results] == [f"p{i}" for i in range(50)]
    assert len({r.request_id for r in results}) == 50


async def test_async_stream_and_errors(endpoint: str, peers: list[Peer]) -> None:
    def mixed(peer: Peer, identity: bytes, req: ClientRequest) -> None:
        if isinstance(req, Generate) and req.prompt == "fail":
            peer.send(identity, Error(req.request_id, "prompt_too_long", "way too long"))
        elif isinstance(req, Abort):
            failing(peer, identity, req)
        else:
            echo(peer, identity, req)

    run_peer(peers, endpoint, mixed)
    async with AsyncClient(endpoint, timeout=5) as client:
        stream = client.stream("xyz", request_id="as1")
        assert stream.request_id == "as1"
        chunks = [c async for c in stream]
        assert stream.result is not None
        assert "".join(c.text for c in chunks) == stream.result.text == "xyz"
        with pytest.raises(RequestError) as err:
            await client.generate("fail", request_id="f1")
        assert (err.value.code, err.value.message, err.value.request_id) == (
            "prompt_too_long",
            "way too long",
            "f1",
        )
        with pytest.raises(RequestError) as err:
            async for _ in client.stream("fail"):
                pass
        assert err.value.code == "prompt_too_long"
        with pytest.raises(RequestError, match="unknown_request"):
            await client.abort("nobody")
        assert (await client.health()).boot_id == "b1"
        assert (await client.server_info()).kv_total_tokens == 100


async def test_async_timeout_and_connection_lost(endpoint: str, peers: list[Peer]) -> None:
    async with AsyncClient(endpoint) as client:
        with pytest.raises(Timeout):
            await client.health(timeout=0.2)

        def vanish(peer: Peer, identity: bytes, req: ClientRequest) -> None:
            if isinstance(req, Generate) and req.prompt == "bye":
                peer.close_now()
            else:
                echo(peer, identity, req)

        run_peer(peers, endpoint, vanish)
        pending = [asyncio.create_task(client.generate("bye")) for _ in range(3)]
        for outcome in await asyncio.gather(*pending, return_exceptions=True):
            assert isinstance(outcome, RequestError) and outcome.code == "connection_lost"
        peers[-1].stop()
        run_peer(peers, endpoint, vanish)
        assert (await client.generate("back", timeout=5)).text == "back"


async def test_async_failed_curve_handshake_leaves_later_clients_working(
    tmp_path_factory: pytest.TempPathFactory, peers: list[Peer]
) -> None:
    ipc = tmp_path_factory.mktemp("ipc")
    _, server_secret = zmq.curve_keypair()
    peers.append(Peer(f"ipc://{ipc}/curve.sock", echo, curve_secret=server_secret).start())
    wrong_key, _ = zmq.curve_keypair()
    async with AsyncClient(f"ipc://{ipc}/curve.sock", curve_server_key=wrong_key) as refused:
        with pytest.raises(RequestError):
            await refused.health(timeout=1)
    await asyncio.sleep(LINGER_MS / 1000)
    run_peer(peers, f"ipc://{ipc}/plain.sock", echo)
    async with AsyncClient(f"ipc://{ipc}/plain.sock", timeout=2) as client:
        assert (await client.health()).status == "serving"


async def test_async_client_survives_undecodable_replies(endpoint: str, peers: list[Peer]) -> None:
    run_peer(peers, endpoint, garbled)
    async with AsyncClient(endpoint, timeout=5) as client:
        with pytest.raises(RequestError) as err:
            await client.generate("utf8", request_id="u1")
        assert (err.value.code, err.value.request_id) == ("malformed", "u1")
        assert (await client.generate("deep")).text == "deep"
        assert (await client.health()).status == "serving"


def test_without_a_daemon_a_call_without_deadline_ends_at_the_connect_timeout(
    endpoint: str,
) -> None:
    with Client(endpoint) as client:
        assert (client.timeout, client.connect_timeout) == (None, CONNECT_TIMEOUT_S)
    with Client(endpoint, connect_timeout=0.5) as client:
        started = time.monotonic()
        with pytest.raises(NotListening) as err:
            client.generate("x")
        assert 0.5 <= time.monotonic() - started < 5.0
    assert err.value.message == f"no daemon is listening at {endpoint} (no socket file)"


async def test_async_without_a_daemon_a_call_ends_at_the_connect_timeout(endpoint: str) -> None:
    async with AsyncClient(endpoint, connect_timeout=0.5) as client:
        started = time.monotonic()
        with pytest.raises(NotListening) as err:
            async for _ in client.stream("x"):
                pass
        assert 0.5 <= time.monotonic() - started < 5.0
    assert err.value.message == f"no daemon is listening at {endpoint} (no socket file)"


async def test_async_timeout_tells_not_listening_from_slow(
    endpoint: str, peers: list[Peer]
) -> None:
    path = ipc_path(endpoint)
    assert path is not None
    leave_stale_socket_file(path)
    async with AsyncClient(endpoint, timeout=0.3) as client:
        with pytest.raises(NotListening, match="stale socket file"):
            await client.health(timeout=0.3)
    os.unlink(path)
    run_peer(peers, endpoint, silent)
    async with AsyncClient(endpoint, timeout=0.3) as client:
        with pytest.raises(Timeout) as err:
            await client.generate("x")
    assert not isinstance(err.value, NotListening)


# --- outrider generate -------------------------------------------------------------------


def cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_generate_arguments(parser)
    return parser.parse_args(argv)


def test_cli_json(endpoint: str, peers: list[Peer], capsys: pytest.CaptureFixture[str]) -> None:
    peer = run_peer(peers, endpoint, echo)
    code = run_generate(
        cli("--connect", endpoint, "--json", "--stop", "a", "--stop", "b", "--seed", "3", "hey")
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == "hey" and out["finish_reason"] == "stop"
    assert out["usage"]["prompt_tokens"] == 3 and out["output_ids"] == [104, 101, 121]
    health, req = peer.requests  # a health check first: is a daemon listening at all?
    assert isinstance(health, HealthQuery)
    assert isinstance(req, Generate) and (req.stop, req.seed) == (["a", "b"], 3)
    # Sampling flags not given are left to the daemon's defaults.
    assert (req.temperature, req.top_p, req.top_k, req.max_new_tokens) == (None,) * 4
    assert run_generate(cli("--connect", endpoint, "--temperature", "0", "--top-k", "4", "x")) == 0
    req = peer.requests[-1]
    assert isinstance(req, Generate)
    assert (req.temperature, req.top_p, req.top_k) == (0.0, None, 4)


def test_cli_stdin_and_stream(
    endpoint: str,
    peers: list[Peer],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_peer(peers, endpoint, echo)
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin"))
    assert run_generate(cli("--connect", endpoint, "-")) == 0
    assert capsys.readouterr().out == "from stdin\n"
    assert run_generate(cli("--connect", endpoint, "--stream", "abc")) == 0
    assert capsys.readouterr().out == "abc\n"


def test_cli_error(endpoint: str, peers: list[Peer], capsys: pytest.CaptureFixture[str]) -> None:
    run_peer(peers, endpoint, failing)
    assert run_generate(cli("--connect", endpoint, "x")) == 1
    assert capsys.readouterr().err == "error: overloaded: too busy\n"
    assert run_generate(cli("--connect", endpoint, "--timeout", "0.1", "--stream", "x")) == 1
    assert run_generate(cli("--connect", "nonsense", "x")) == 2


def aborting(peer: Peer, identity: bytes, req: ClientRequest) -> None:
    """``echo``, but a Generate streams its first two characters and ends ``abort`` (as in a
    shutdown drain)."""
    if not isinstance(req, Generate):
        echo(peer, identity, req)
        return
    text = (req.prompt or "")[:2]
    if req.stream:
        for c in text:
            peer.send(identity, Chunk(req.request_id, [ord(c)], c))
    ids = [ord(c) for c in text]
    peer.send(identity, Finished(req.request_id, ids, text, "abort", None, Usage(3, len(ids))))


def test_cli_an_aborted_answer_is_said_and_fails(
    endpoint: str, peers: list[Peer], capsys: pytest.CaptureFixture[str]
) -> None:
    run_peer(peers, endpoint, aborting)
    said = (
        "error: aborted: the daemon ended the request after 2 tokens, before it was complete "
        "(a shutdown drain, or an abort)\n"
    )
    for mode in ([], ["--stream"]):
        assert run_generate(cli("--connect", endpoint, *mode, "abcdef")) == 1
        assert capsys.readouterr() == ("ab\n", said)
    assert run_generate(cli("--connect", endpoint, "--json", "abcdef")) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["finish_reason"] == "abort" and err == said


def run_cli_within(seconds: float, *argv: str) -> int:
    """``run_generate`` on ``argv``; fails the test if it has not returned after ``seconds``."""
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(run_generate(cli(*argv))), daemon=True)
    thread.start()
    thread.join(seconds)
    assert status, f"outrider generate {' '.join(argv)} still runs after {seconds} s"
    return status[0]


def test_cli_timeout_argument() -> None:
    assert cli("x").timeout == generate_cmd.DEFAULT_TIMEOUT_S == 300
    assert cli("--timeout", "2.5", "x").timeout == 2.5
    assert cli("--timeout", "0", "x").timeout is None
    assert cli("--timeout", "inf", "x").timeout is None
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(SystemExit):
            cli("--timeout", bad, "x")


def test_cli_says_why_nothing_answers(
    endpoint: str,
    peers: list[Peer],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = ipc_path(endpoint)
    assert path is not None
    # No socket file: said at once, not after the health check's deadline.
    assert run_cli_within(generate_cmd.HEALTH_DEADLINE_S / 2, "--connect", endpoint, "x") == 1
    err = capsys.readouterr().err
    assert err == f"error: no daemon is listening at {endpoint} (no socket file)\n"
    monkeypatch.setattr(generate_cmd, "HEALTH_DEADLINE_S", 0.3)
    leave_stale_socket_file(path)
    assert run_cli_within(5, "--connect", endpoint, "--stream", "x") == 1
    assert capsys.readouterr().err == (
        f"error: timeout: no daemon is listening at {endpoint} "
        "(stale socket file: nothing accepts on it)\n"
    )
    os.unlink(path)
    run_peer(peers, endpoint, silent)
    assert run_cli_within(5, "--connect", endpoint, "x") == 1
    assert capsys.readouterr().err == (
        f"error: timeout: the daemon at {endpoint} did not answer in time\n"
    )


def test_a_loading_daemon_is_told_from_none(
    endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A daemon holds ``PATH.lock`` with its pid from before it loads the model, and binds
    ``PATH`` only once loaded: a live pid there with no socket file is a daemon loading."""
    path = ipc_path(endpoint)
    assert path is not None
    lock = lock_file_path(path)
    loading = (
        f"the daemon at {endpoint} (pid {os.getpid()}) is loading the model; it listens once "
        "the model is loaded"
    )
    with open(lock, "w") as f:
        f.write(f"{os.getpid()}\n")
    assert not_listening_reason(endpoint) == loading
    with Client(endpoint, timeout=0.3) as client, pytest.raises(NotListening) as err:
        client.health(timeout=0.3)
    assert err.value.message == loading
    assert run_cli_within(generate_cmd.HEALTH_DEADLINE_S / 2, "--connect", endpoint, "x") == 1
    assert capsys.readouterr().err == f"error: {loading}\n"
    # A daemon that exited emptied the file; one that was killed left a pid nothing runs as.
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    for left in ("", f"{gone.pid}\n"):
        with open(lock, "w") as f:
            f.write(left)
        assert (
            not_listening_reason(endpoint)
            == f"no daemon is listening at {endpoint} (no socket file)"
        )


@pytest.mark.parametrize("failure", ["protocol", "authentication"])
def test_a_failed_handshake_fails_later_calls_at_once(failure: str) -> None:
    """libzmq never reconnects after a failed handshake (a plain client at a CURVE server, a
    client key the server refuses): a call made after it fails with ``connection_lost``
    instead of waiting for nothing. A plain client often sees the CURVE server close before it
    reads why (on a busy host, every time): it fails after ``SILENT_DROPS_LIMIT`` such drops."""
    ctx = zmq.Context()
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
    auth.configure_curve_callback(domain="*", credentials_provider=_RefuseAll())
    server = ctx.socket(zmq.ROUTER)
    server.curve_server = True
    server_public, server.curve_secretkey = zmq.curve_keypair()
    server.curve_publickey = server_public
    port = server.bind_to_random_port("tcp://127.0.0.1")
    server_key = server_public if failure == "authentication" else None
    try:
        with Client(f"tcp://127.0.0.1:{port}", curve_server_key=server_key) as client:
            time.sleep(0.5)  # the handshake fails before any call
            for _ in range(2):
                started = time.monotonic()
                with pytest.raises(RequestError) as err:
                    client.health(timeout=5.0)
                assert err.value.code == "connection_lost"
                told = err.value.message.removeprefix(f"connection to tcp://127.0.0.1:{port} lost")
                if failure == "authentication":
                    assert told == " (handshake failed: authentication)"
                else:
                    assert told in (" (handshake failed: protocol)", silent_drops_reason())
                assert time.monotonic() - started < 2.0
    finally:
        server.close(0)
        auth.stop()
        ctx.term()


class _HeldRefusal:
    """A CURVE credentials provider that refuses every client key, but only once ``answer`` is
    set: until then every handshake waits for it."""

    def __init__(self) -> None:
        self.answer = threading.Event()

    def callback(self, domain: str, key: bytes) -> bool:
        self.answer.wait(30.0)
        return False


@contextlib.contextmanager
def held_curve_server() -> Iterator[tuple[str, bytes, _HeldRefusal]]:
    """A CURVE ROUTER over TCP whose handshakes wait for ``answer`` and then fail (refused
    key): (endpoint, server public key, the provider)."""
    ctx = zmq.Context()
    held = _HeldRefusal()
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=held)
    server = ctx.socket(zmq.ROUTER)
    server.curve_server = True
    server_public, server.curve_secretkey = zmq.curve_keypair()
    server.curve_publickey = server_public
    port = server.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield f"tcp://127.0.0.1:{port}", server_public, held
    finally:
        held.answer.set()
        server.close(0)
        auth.stop()
        ctx.term()


def send_queue_full(client: Client | AsyncClient) -> bool:
    return not client._sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT


def test_a_handshake_failing_while_a_send_waits_fails_the_call_at_once() -> None:
    """Requests queue on the DEALER while its handshake waits; once the queue is full a send
    waits for room. The handshake then fails (the pipe, and the queue, are gone for good): the
    waiting call ends with ``connection_lost`` then, not at its deadline."""
    with (
        held_curve_server() as (endpoint, server_key, held),
        Client(endpoint, curve_server_key=server_key) as client,
    ):
        queued = [client.stream("q") for _ in range(client._sock.getsockopt(zmq.SNDHWM))]
        assert send_queue_full(client)
        threading.Timer(0.5, held.answer.set).start()
        started = time.monotonic()
        with pytest.raises(RequestError) as err:
            client.health(timeout=20.0)
        assert time.monotonic() - started < 5.0
        assert err.value.code == "connection_lost"
        assert (
            err.value.message == f"connection to {endpoint} lost (handshake failed: authentication)"
        )
        for stream in queued:
            with pytest.raises(RequestError) as err:
                next(stream)
            assert err.value.code == "connection_lost"


async def test_async_a_handshake_failing_while_a_send_waits_fails_the_call_at_once() -> None:
    """As for ``Client``: every call, those queued and the one waiting to send, ends with
    ``connection_lost`` once the handshake fails."""
    with held_curve_server() as (endpoint, server_key, held):
        async with AsyncClient(endpoint, curve_server_key=server_key) as client:
            hwm = client._sock.getsockopt(zmq.SNDHWM)
            calls = [asyncio.create_task(client.health(timeout=20.0)) for _ in range(hwm + 1)]
            while not send_queue_full(client):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            assert sum(not call.done() for call in calls) == hwm + 1
            started = time.monotonic()
            held.answer.set()
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            assert time.monotonic() - started < 5.0
            assert {(type(e), getattr(e, "code", None)) for e in outcomes} == {
                (RequestError, "connection_lost")
            }


class _Dropper:
    """A TCP listener that closes its first ``drops`` connections at once (mid-handshake, as a
    peer that is no daemon would) and forwards later ones to ``target`` (host, port)."""

    def __init__(self, drops: int, target: tuple[str, int] | None = None) -> None:
        self.drops = drops
        self.target = target
        self.accepted = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with self.listener:
            while True:
                try:
                    conn, _ = self.listener.accept()
                except OSError:
                    return
                self.accepted += 1
                if self.accepted <= self.drops or self.target is None:
                    conn.close()
                    continue
                upstream = socket.create_connection(self.target)
                for src, dst in ((conn, upstream), (upstream, conn)):
                    threading.Thread(target=_pipe, args=(src, dst), daemon=True).start()

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)
        self._thread.join(5.0)


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def test_one_connection_dropped_mid_handshake_does_not_fail_the_call(
    peers: list[Peer],
) -> None:
    """A connection dropped before its handshake ended carried no request: ZeroMQ keeps it
    queued and retries, and the call is answered over the next connection."""
    peer = run_peer(peers, "tcp://127.0.0.1:*", echo)
    dropper = _Dropper(drops=1, target=("127.0.0.1", peer.port))
    try:
        with Client(f"tcp://127.0.0.1:{dropper.port}", timeout=5.0) as client:
            assert client.generate("through").text == "through"
    finally:
        dropper.close()
    assert dropper.accepted == 2


def test_handshakes_dropped_again_and_again_fail_the_call() -> None:
    """A peer that drops every handshake without a reason (no daemon, or one with another CURVE
    key) fails the call after ``SILENT_DROPS_LIMIT`` drops, not at its timeout."""
    dropper = _Dropper(drops=1_000)
    try:
        with Client(f"tcp://127.0.0.1:{dropper.port}") as client:
            started = time.monotonic()
            with pytest.raises(RequestError) as err:
                client.health(timeout=10.0)
            assert time.monotonic() - started < 5.0
    finally:
        dropper.close()
    assert err.value.code == "connection_lost"
    assert err.value.message == f"connection to tcp://127.0.0.1:{dropper.port} lost" + (
        silent_drops_reason()
    )
    assert dropper.accepted >= SILENT_DROPS_LIMIT


def silent_drops_reason() -> str:
    return (
        f" ({SILENT_DROPS_LIMIT} handshakes in a row failed without a reason:"
        " no daemon, or one with another CURVE setting)"
    )


class _RefuseAll:
    """A CURVE credentials provider that refuses every client key."""

    def callback(self, domain: str, key: bytes) -> bool:
        return False


# --- deadlines by default and the size check ------------------------------------------------


def probing(peer: Peer, identity: bytes, req: ClientRequest) -> None:
    """A daemon that holds every request and probes its client every 0.1 s (from the
    handler's thread, for 1.5 s), as the front door probes clients with calls in flight."""
    if not isinstance(req, Generate):
        return
    for _ in range(15):
        peer.send(identity, Ack(""))
        time.sleep(0.1)


def test_a_silent_daemon_fails_calls_after_the_idle_timeout(
    endpoint: str, peers: list[Peer]
) -> None:
    run_peer(peers, endpoint, silent)
    with Client(endpoint, idle_timeout=0.5) as client:
        start = time.monotonic()
        with pytest.raises(Timeout) as err:
            client.generate("held")
        assert 0.5 <= time.monotonic() - start < 3.0
        assert "sent nothing for 0.5 s" in err.value.message and not isinstance(
            err.value, NotListening
        )
        stream = client.stream("held too")
        with pytest.raises(Timeout):
            next(stream)

    def aborted() -> list[str]:
        return sorted(r.target_id for r in peers[0].requests if isinstance(r, Abort))

    deadline = time.monotonic() + 2
    while len(aborted()) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert aborted() == sorted(r.request_id for r in peers[0].requests if isinstance(r, Generate))


def test_probes_keep_a_call_alive_past_the_idle_timeout(endpoint: str, peers: list[Peer]) -> None:
    run_peer(peers, endpoint, probing)
    with Client(endpoint, idle_timeout=0.5) as client:
        start = time.monotonic()
        with pytest.raises(Timeout):  # probed for 1.5 s, then silent
            client.generate("held")
        assert time.monotonic() - start >= 1.5


async def test_async_idle_timeout_and_probes(endpoint: str, peers: list[Peer]) -> None:
    run_peer(peers, endpoint, probing)
    async with AsyncClient(endpoint, idle_timeout=0.5) as client:
        start = time.monotonic()
        with pytest.raises(Timeout) as err:
            await client.generate("held")
        assert time.monotonic() - start >= 1.5
        assert "idle_timeout" in err.value.message


def test_idle_timeout_none_waits_for_the_caller_deadline(endpoint: str, peers: list[Peer]) -> None:
    run_peer(peers, endpoint, silent)
    with Client(endpoint, idle_timeout=None) as client:
        start = time.monotonic()
        with pytest.raises(Timeout) as err:
            client.generate("held", timeout=1.0)
        assert time.monotonic() - start >= 1.0 and "did not answer in time" in err.value.message


async def test_an_oversized_request_is_refused_unsent(endpoint: str, peers: list[Peer]) -> None:
    run_peer(peers, endpoint, echo)
    with Client(endpoint, timeout=5.0, max_message_bytes=1024) as client:
        with pytest.raises(RequestError) as err:
            client.generate("x" * 1024)
        assert err.value.code == "invalid_request"
        assert "over the daemon's limit of 1024 (--max-message-bytes)" in err.value.message
        assert client.generate("small").text == "small"  # the connection is unharmed
    async with AsyncClient(endpoint, timeout=5.0, max_message_bytes=1024) as aclient:
        with pytest.raises(RequestError) as err:
            await aclient.generate(input_ids=[7] * 1024)
        assert err.value.code == "invalid_request"
        assert (await aclient.generate("again")).text == "again"
    sent = [r.prompt for r in peers[0].requests if isinstance(r, Generate)]
    assert sent == ["small", "again"]
