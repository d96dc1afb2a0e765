"""The endpoints a configuration binds, checked alike by ``outrider serve`` and ``outrider
plugins --check``: a live daemon on the socket, a taken ``--listen`` port or ``--http`` port
is refused by its flag; a stale socket file passes and stays."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from outrider.daemon.cli import main as cli
from outrider.daemon.cli import plugins as plugins_cmd
from outrider.daemon.config import EXIT_CONFIG, ServeConfig
from outrider.daemon.family import embedded_family
from outrider.daemon.processes.endpoint_checks import endpoint_problems
from outrider.daemon.processes.runtime import lock_client_endpoint
from outrider.plugins.api import PHASES, CheckContext, Phase
from outrider.plugins.attention import fa4_backend
from outrider.plugins.checks import attention_option

IN_USE = "address already in use (another process holds it)"


@pytest.fixture(autouse=True)
def own_runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default socket under ``tmp_path``, away from any daemon serving this user."""
    for name in [name for name in os.environ if name.startswith("OUTRIDER_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.fixture
def live_daemon(tmp_path: Path) -> Iterator[str]:
    """A daemon's client socket as serve holds it: locked, bound and listening."""
    endpoint = f"ipc://{tmp_path / 'live' / 'outrider.sock'}"
    lock = lock_client_endpoint(endpoint)
    assert lock is not None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(lock.socket_path))
        listener.listen()
        yield endpoint
    lock.release()


def _config(listen: str = "", http: str = "", node_rank: int = 0) -> ServeConfig:
    nnodes = node_rank + 1
    return ServeConfig("unused", listen=listen, http=http, nnodes=nnodes, node_rank=node_rank)


def test_a_live_daemon_on_the_socket_is_refused_and_keeps_serving(live_daemon: str) -> None:
    assert endpoint_problems(_config(listen=live_daemon)) == [
        f"--listen: another daemon (pid {os.getpid()}) serves {live_daemon}"
    ]
    socket_path = live_daemon.removeprefix("ipc://")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(socket_path)  # still there, still accepting


def test_a_stale_socket_file_passes_and_is_left_to_the_daemon(tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
        gone.bind(str(stale))
    assert endpoint_problems(_config(listen=f"ipc://{stale}")) == []
    assert stale.is_socket()


def test_a_file_in_the_way_of_the_socket_is_refused(tmp_path: Path) -> None:
    (tmp_path / "outrider").mkdir()
    (tmp_path / "outrider" / "outrider.sock").write_text("not a socket")
    assert endpoint_problems(_config()) == [
        f"--listen: {tmp_path}/outrider/outrider.sock exists and is not a socket; not removing it"
    ]


def test_taken_tcp_and_http_ports_are_refused_by_their_flags(taken_port: int) -> None:
    listen, http = f"tcp://127.0.0.1:{taken_port}", f"127.0.0.1:{taken_port}"
    assert endpoint_problems(_config(listen=listen, http=http)) == [
        f"--listen: cannot listen on {listen}: {IN_USE}",
        f"--http: cannot listen on {http}: Address already in use",
    ]


def test_a_follower_host_binds_nothing(taken_port: int) -> None:
    config = _config(listen=f"tcp://127.0.0.1:{taken_port}", node_rank=1)
    assert endpoint_problems(config) == []


def test_plugins_check_refuses_each_taken_endpoint(
    live_daemon: str, taken_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    if embedded_family() is None:
        pytest.skip("the outrider-family distribution is not installed")
    taken = {"--listen": live_daemon, "--http": f"127.0.0.1:{taken_port}"}
    assert cli.main(["plugins", "--check", *(x for kv in taken.items() for x in kv)]) == (
        EXIT_CONFIG
    )
    assert capsys.readouterr().err.splitlines() == [
        f"outrider plugins --check: --listen: another daemon (pid {os.getpid()}) serves "
        f"{live_daemon}",
        f"outrider plugins --check: --http: cannot listen on 127.0.0.1:{taken_port}: "
        "Address already in use",
    ]
    tcp = f"tcp://127.0.0.1:{taken_port}"
    assert plugins_cmd.run_serve_check(["--listen", tcp]) == EXIT_CONFIG
    assert capsys.readouterr().err == (
        f"outrider plugins --check: --listen: cannot listen on {tcp}: {IN_USE}\n"
    )


def test_a_backend_is_named_by_the_flag_that_routed_it() -> None:
    every: dict[Phase, str] = dict.fromkeys(PHASES, "fa4")
    verify: dict[Phase, str] = dict.fromkeys(PHASES, "torch") | {"verify": "fa4"}
    drafts = dict.fromkeys(PHASES, "torch") | {"draft_decode": "fa4", "draft_extend": "fa4"}

    def option(routes: dict[Phase, str]) -> str:
        return attention_option(CheckContext("cpu", "float32", 16, True, routes, "ngram"), "fa4")

    assert option(every) == "--attention-backend"
    assert option(verify) == "--verify-attention-backend"
    assert option(drafts) == "--draft-attention-backend"


@pytest.mark.parametrize(
    ("flag", "named"),
    [
        ("--verify-attention-backend", "--verify-attention-backend"),
        ("--attention-backend", "--attention-backend"),
    ],
)
def test_a_missing_backend_is_refused_by_the_flag_given(
    flag: str, named: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if embedded_family() is None:
        pytest.skip("the outrider-family distribution is not installed")
    monkeypatch.setattr(fa4_backend, "_installed", lambda: False)
    assert plugins_cmd.run_serve_check([flag, "fa4", "--speculative-algorithm", "ngram"]) == (
        EXIT_CONFIG
    )
    out = capsys.readouterr().out.splitlines()
    assert f"  {named} fa4: FlashAttention-4 is not installed (pip install 'outrider[fa4]')" in out
