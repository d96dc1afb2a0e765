"""End to end: a real daemon on loopback TCP against peers that break the rules."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest
import zmq.asyncio
from daemon_harness import Daemon, RawDealer, build_model_dir, free_port
from soak_faults import DEEP

from outrider.protocol import AsyncClient, Client, RequestError
from outrider.protocol.frames import request_codec
from outrider.protocol.messages import Error, HealthQuery

pytestmark = pytest.mark.e2e

FORGED = "2026-01-01 00:00:00,000 INFO outrider.daemon: forged"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    model = build_model_dir(tmp_path_factory.mktemp("model"))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    # --log-level debug: a line per finished request, where client text must stay escaped.
    started = Daemon(
        model, tmp_path_factory.mktemp("faults"), "--log-level", "debug", endpoint=endpoint
    )
    try:
        started.wait_serving()
        yield started
        assert started.stop() == 0, started.log()[-4000:]
    finally:
        started.kill_all()
    assert "Traceback" not in started.log()


def test_client_text_cannot_forge_log_lines(daemon: Daemon) -> None:
    request_id = f"inject\n{FORGED}\r\u2028"
    with Client(daemon.endpoint, timeout=60.0) as client:
        result = client.generate(input_ids=[5, 6], max_new_tokens=3, request_id=request_id)
    assert result.request_id == request_id
    lines = daemon.log().splitlines()
    assert not [line for line in lines if line.startswith(FORGED)]
    finished = [line for line in lines if "finished id=inject" in line]
    assert len(finished) == 1 and "\\x0a" + FORGED + "\\x0d\\u2028 rid=" in finished[0]


def test_zmtp_1_0_peer_over_tcp_is_answered(daemon: Daemon) -> None:
    host, _, port = daemon.endpoint.removeprefix("tcp://").rpartition(":")
    body = request_codec().encode(HealthQuery("zmtp-1.0-tcp"))
    with socket.create_connection((host, int(port)), timeout=10.0) as old:
        old.sendall(b"\x01\x00" + bytes([len(body) + 1, 0]) + body)
        received = b""
        while b"serving" not in received:
            chunk = old.recv(4096)
            assert chunk, received
            received += chunk
    assert b"zmtp-1.0-tcp" in received
    with Client(daemon.endpoint, timeout=10.0) as client:
        assert client.health().status == "serving"


async def test_health_answers_within_a_second_under_hostile_frames(daemon: Daemon) -> None:
    header = request_codec().header
    ctx = zmq.asyncio.Context()
    try:
        raw = RawDealer(ctx, daemon.endpoint)
        bad = {
            "utf8": header + b"\x82\xa4type\xa6health\xaarequest_id\xa1\xff",
            "nested": header + b"\x82\xa4type\xa6health\xa7unknown" + b"\x91" * DEEP + b"\xc0",
        }
        for name, frame in bad.items():
            reply = await raw.call(frame)
            assert isinstance(reply, Error) and reply.code == "malformed", (name, reply)
        async with (
            AsyncClient(daemon.endpoint, timeout=30.0) as hostile,
            AsyncClient(daemon.endpoint, timeout=10.0) as other,
        ):
            huge = [
                asyncio.create_task(hostile.generate("x" * (7 * 2**20), max_new_tokens=1))
                for _ in range(2)
            ]
            for _ in range(5):
                asked = time.monotonic()
                assert (await other.health()).status == "serving"
                assert time.monotonic() - asked < 1.0
            for task in huge:
                with pytest.raises(RequestError) as err:
                    await task
                assert err.value.code == "prompt_too_long"
    finally:
        ctx.destroy(linger=0)
