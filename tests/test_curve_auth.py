"""daemon/frontdoor/curve_auth.py in process: the key files' checks, and the ZAP handler on a
real CURVE ROUTER (listed client keys get answers, others fail the handshake)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
import zmq.auth
from zmq.utils.monitor import parse_monitor_message

from outrider.daemon.frontdoor.curve_auth import (
    CurveKeyError,
    load_client_keys,
    load_server_keys,
    start_client_auth,
)


@pytest.fixture
def server_secret(tmp_path: Path) -> Path:
    _, secret = zmq.auth.create_certificates(tmp_path, "server")
    os.chmod(secret, 0o600)
    return Path(secret)


@pytest.fixture
def clients_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "clients"
    directory.mkdir(mode=0o755)
    for name in ("alice", "bob"):
        _, secret = zmq.auth.create_certificates(directory, name)
        os.rename(secret, tmp_path / Path(secret).name)  # client secrets stay with clients
    return directory


def test_server_keys_load_from_a_private_secret_certificate(server_secret: Path) -> None:
    public, secret = load_server_keys(server_secret)
    assert (public, secret) == zmq.auth.load_certificate(server_secret)
    assert zmq.curve_public(secret) == public


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_secret_key_others_may_read_is_refused(server_secret: Path, mode: int) -> None:
    os.chmod(server_secret, mode)
    with pytest.raises(CurveKeyError) as refused:
        load_server_keys(server_secret)
    assert str(refused.value) == (
        f"--curve-secret-key-file {server_secret}: mode {mode:04o} lets other users at the "
        "secret key; chmod 600 it"
    )


def test_secret_key_file_refusals(server_secret: Path, tmp_path: Path) -> None:
    public_file = server_secret.with_name("server.key")
    os.chmod(public_file, 0o600)
    cases = {
        tmp_path / "missing": "no such file or directory",
        tmp_path: "not a regular file",
        public_file: "no secret-key in it (a public certificate?)",
    }
    garbage = tmp_path / "garbage.key_secret"
    garbage.write_text("not a certificate\n")
    os.chmod(garbage, 0o600)
    cases[garbage] = "no public-key in it (not a zmq.auth certificate)"
    forged = tmp_path / "forged.key_secret"
    other_public, _ = zmq.curve_keypair()
    _, secret = zmq.auth.load_certificate(server_secret)
    assert secret is not None
    forged.write_text(
        f'curve\n    public-key = "{other_public.decode()}"\n    secret-key = "{secret.decode()}"\n'
    )
    os.chmod(forged, 0o600)
    cases[forged] = "not a valid CURVE keypair"
    for path, reason in cases.items():
        with pytest.raises(CurveKeyError) as refused:
            load_server_keys(path)
        assert str(refused.value) == f"--curve-secret-key-file {path}: {reason}"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file away")
def test_a_secret_key_of_another_user_is_refused(server_secret: Path) -> None:
    os.chown(server_secret, 54321, 54321)
    with pytest.raises(CurveKeyError, match="owned by uid 54321"):
        load_server_keys(server_secret)


def test_client_keys_are_every_public_certificate(clients_dir: Path) -> None:
    keys = load_client_keys(clients_dir)
    expected = {zmq.auth.load_certificate(clients_dir / f"{n}.key")[0] for n in ("alice", "bob")}
    assert set(keys) == expected and len(keys) == 2


def test_client_key_directory_refusals(clients_dir: Path, tmp_path: Path) -> None:
    where = f"--curve-client-keys {clients_dir}"
    os.chmod(clients_dir, 0o775)
    with pytest.raises(CurveKeyError) as refused:
        load_client_keys(clients_dir)
    assert str(refused.value) == (
        f"{where}: mode 0775 lets other users change the allowed keys; chmod go-w it"
    )
    os.chmod(clients_dir, 0o755)
    os.chmod(clients_dir / "bob.key", 0o666)
    with pytest.raises(CurveKeyError, match=r"bob\.key: mode 0666 lets other users change"):
        load_client_keys(clients_dir)
    os.chmod(clients_dir / "bob.key", 0o644)
    (clients_dir / "broken.key").write_text("curve\n")
    with pytest.raises(CurveKeyError, match=r"broken\.key: no public-key in it"):
        load_client_keys(clients_dir)
    (clients_dir / "broken.key").write_text('curve\n    public-key = "short"\n')
    with pytest.raises(CurveKeyError, match=r"broken\.key: public-key is not a Z85-encoded"):
        load_client_keys(clients_dir)
    (clients_dir / "broken.key").unlink()
    _, secret_file = zmq.auth.create_certificates(tmp_path, "leaked")
    os.rename(secret_file, clients_dir / "leaked.key")
    with pytest.raises(CurveKeyError, match=r"leaked\.key: holds a secret key"):
        load_client_keys(clients_dir)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CurveKeyError, match=r"empty: no \*\.key public certificates"):
        load_client_keys(empty)
    with pytest.raises(CurveKeyError, match="not a directory"):
        load_client_keys(clients_dir / "alice.key")


# --- the ZAP handler on a real CURVE ROUTER ------------------------------------------------

Ctx = zmq.Context[zmq.Socket[bytes]]


class _Server:
    """A CURVE ROUTER on ``ctx`` that echoes every message, in a thread."""

    def __init__(self, ctx: Ctx, keys: tuple[bytes, bytes]) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.curve_server = True
        self.sock.curve_publickey, self.sock.curve_secretkey = keys
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._echo)
        self._thread.start()

    def _echo(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(20):
                self.sock.send_multipart(self.sock.recv_multipart())

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def _ask(
    ctx: Ctx,
    endpoint: str,
    server_public: bytes,
    keypair: tuple[bytes, bytes],
    timeout_ms: int,
) -> tuple[bytes | None, list[int]]:
    """Send b"ping" from a CURVE DEALER with ``keypair``: (the answer or None, the
    handshake events its monitor saw)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.curve_serverkey = server_public
    dealer.curve_publickey, dealer.curve_secretkey = keypair
    monitor = dealer.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    )
    dealer.connect(endpoint)
    dealer.send(b"ping")
    answer = dealer.recv() if dealer.poll(timeout_ms) else None
    events = []
    while monitor.poll(100):
        events.append(parse_monitor_message(monitor.recv_multipart())["event"])
    dealer.disable_monitor()
    monitor.close()
    dealer.close()
    return answer, events


@pytest.fixture
def ctx() -> Iterator[Ctx]:
    context: Ctx = zmq.Context()
    yield context
    context.term()


def test_only_listed_client_keys_get_in(ctx: Ctx, server_secret: Path) -> None:
    keys = load_server_keys(server_secret)
    allowed, stranger = zmq.curve_keypair(), zmq.curve_keypair()
    auth = start_client_auth(ctx, [allowed[0]])
    server = _Server(ctx, keys)  # bound after the handler started, as the front door does
    try:
        answer, events = _ask(ctx, server.endpoint, keys[0], allowed, 5000)
        assert answer == b"ping"
        assert events == [zmq.EVENT_HANDSHAKE_SUCCEEDED]
        answer, events = _ask(ctx, server.endpoint, keys[0], stranger, 500)
        assert answer is None
        assert zmq.EVENT_HANDSHAKE_FAILED_AUTH in events
    finally:
        server.close()
        auth.stop()


def test_without_the_handler_any_keypair_gets_in(ctx: Ctx, server_secret: Path) -> None:
    """What the handler is for: libzmq alone authenticates the server only."""
    keys = load_server_keys(server_secret)
    server = _Server(ctx, keys)
    try:
        answer, _ = _ask(ctx, server.endpoint, keys[0], zmq.curve_keypair(), 5000)
        assert answer == b"ping"
    finally:
        server.close()


def test_the_handler_runs_on_an_asyncio_context_and_stops_before_term() -> None:
    context = zmq.asyncio.Context()
    auth = start_client_auth(context, [zmq.curve_keypair()[0]])
    assert auth.is_alive()
    auth.stop()
    started = time.monotonic()
    context.term()  # nothing of the handler is left to keep it waiting
    assert time.monotonic() - started < 1.0
