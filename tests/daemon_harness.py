"""The real daemon (``python -m outrider.daemon.cli serve``) as a subprocess, for end-to-end
tests: three processes, real ``ipc://`` sockets, a fake systemd notify socket.

Every daemon runs in its own session (process group), so ``Daemon.kill_all`` reaches its two
children and its multiprocessing resource tracker even after the daemon itself is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import zmq
import zmq.asyncio
from frontdoor_harness import build_tokenizer
from model_fixtures import save_tiny_model

from outrider.protocol import AsyncClient, Client, Health, Timeout
from outrider.protocol.frames import FrameError, reply_codec
from outrider.protocol.messages import Ack, ClientReply, is_final

T = TypeVar("T")

# The tiny model's context: long enough that a request can outlive a SIGTERM by seconds.
MODEL_CONTEXT = 2048
START_TIMEOUT_S = 90.0
EXIT_TIMEOUT_S = 30.0


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on (now)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def build_model_dir(directory: Path) -> Path:
    """A tiny random Qwen3 checkpoint (vocabulary 300) with the front door tests' tokenizer
    (320 ids: prompts whose tokens reach past 299 are refused) and chat template."""
    save_tiny_model("qwen3", directory)
    build_tokenizer(directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = MODEL_CONTEXT
    config_path.write_text(json.dumps(config, indent=1))
    return directory


# OUTRIDER_TEST_DEVICE=cuda runs every daemon of the end-to-end tests on CUDA.
TEST_DEVICE = os.environ.get("OUTRIDER_TEST_DEVICE", "cpu")


def daemon_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test's environment without systemd or OUTRIDER_* settings, plus one torch thread,
    the KV integrity check after every step and ``extra``."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("OUTRIDER_")
        and key not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
    }
    env.update(OMP_NUM_THREADS="1", OUTRIDER_DEBUG_KV_CHECK="1", PYTHONUNBUFFERED="1")
    if TEST_DEVICE == "cuda":
        # The whole suite against CUDA daemons, any host sync inside a step raising. The pool
        # is kept at the CPU size: sized from free GPU memory it holds max_running contexts,
        # and the per-step integrity check walks every page (about 0.1 s a step). float32, as
        # the references the tests hold the tokens to (auto would serve bf16 on CUDA).
        env.update(
            OUTRIDER_DEVICE="cuda",
            OUTRIDER_DTYPE="float32",
            OUTRIDER_DEBUG_SYNC_CHECK="1",
            OUTRIDER_KV_CACHE_TOKENS="16384",
        )
    env.update(extra or {})
    return env


def poll_until(
    condition: Callable[[], T | None], timeout: float, what: str, interval: float = 0.02
) -> T:
    """Call ``condition`` until it returns something other than None (or False)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(interval)


async def async_poll_until(
    condition: Callable[[], Awaitable[T | None]],
    timeout: float,
    what: str,
    interval: float = 0.02,
) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = await condition()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        await asyncio.sleep(interval)


class Daemon:
    """One ``outrider serve`` process; stdout and stderr go to ``log_path``."""

    def __init__(
        self,
        model: Path,
        workdir: Path,
        *args: str,
        endpoint: str | None = None,
        env: Mapping[str, str] | None = None,
        name: str = "daemon",
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        # Sockets (the client's unless ``endpoint`` names one, and the internal pipes' private
        # directory) go under a short path of our own, since sun_path holds 107 bytes;
        # kill_all() removes it even when the daemon could not clean up.
        self.runtime = Path(tempfile.mkdtemp(prefix="or-e2e-"))
        self.endpoint = endpoint or f"ipc://{self.runtime}/o.sock"
        self.log_path = workdir / f"{name}.log"
        command = [sys.executable, "-m", "outrider.daemon.cli", "serve", "--model", str(model)]
        command += ["--listen", self.endpoint, "--page-size", "4", *args]
        self.command = command
        environ = daemon_env({"XDG_RUNTIME_DIR": str(self.runtime), **(env or {})})
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=environ,
                start_new_session=True,
            )
        self.pid = self.proc.pid
        self.served = False  # wait_serving() saw it serve

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def child_pid(self, name: str) -> int:
        """The pid of child ``name`` ("frontdoor" or "detokenizer"), from its log lines."""
        found = re.search(rf"{name}\[(\d+)\]", self.log())
        assert found is not None, self.log()
        return int(found.group(1))

    def _describe(self) -> str:
        return f"{' '.join(self.command)}\n--- log ---\n{self.log()[-6000:]}"

    def wait_serving(self, timeout: float = START_TIMEOUT_S) -> Health:
        """Wait until ``health()`` says serving; raises if the daemon exits first."""
        deadline = time.monotonic() + timeout
        with Client(self.endpoint) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"the daemon exited with {self.proc.returncode}\n{self._describe()}"
                    )
                try:
                    health = client.health(timeout=0.25)
                except Timeout:
                    health = None
                if health is not None and health.status == "serving":
                    self.served = True
                    return health
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the daemon did not serve in {timeout} s\n{self._describe()}"
                    )

    def wait_exit(self, timeout: float = EXIT_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"the daemon did not exit in {timeout} s\n{self._describe()}"
            ) from None

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def group_alive(self) -> bool:
        """Whether any process of the daemon's session is left (the daemon, a child)."""
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def wait_group_gone(self, timeout: float = 10.0) -> None:
        """Wait until no process of the daemon's session is left (its children exited)."""
        poll_until(lambda: not self.group_alive(), timeout, "the daemon's processes exiting")

    def kill_all(self) -> None:
        """SIGKILL the daemon and everything it started, and reap the daemon."""
        # NOTE: the daemon leads its own process group, so this reaches only what it started;
        # a group id is never reused while any of its members lives.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait(10)
        shutil.rmtree(self.runtime, ignore_errors=True)

    def stop(self, timeout: float = EXIT_TIMEOUT_S) -> int | None:
        """SIGTERM and wait; SIGKILL everything if it does not exit in time. The exit code
        (None if it had to be killed)."""
        code: int | None = self.proc.poll()
        if code is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                code = None
        self.kill_all()
        return code


@contextlib.contextmanager
def daemons(model: Path, workdir: Path) -> Iterator[Callable[..., Daemon]]:
    """``start(name, *flags, endpoint=..., env=...)`` starts a daemon on ``model`` under
    ``workdir / name``; each is killed, with everything it started, on leaving."""
    started: list[Daemon] = []

    def start(name: str, *args: str, **options: Any) -> Daemon:
        started.append(Daemon(model, workdir / name, *args, name=name, **options))
        return started[-1]

    try:
        yield start
    finally:
        for daemon in started:
            daemon.kill_all()


# A client process that sends streams and reads nothing until told to (a line on stdin),
# then waits past a ZMTP heartbeat interval and reads: it must end with connection_lost, not
# with libzmq aborting the process. Prints "<chunks read> <error code>" for each stream.
_UNREAD_CLIENT = """
import sys, time
from outrider.protocol import Client, RequestError
client = Client(sys.argv[1])
streams = [
    client.stream(input_ids=[5, 6, 7, 20 + i], ignore_eos=True, max_new_tokens=1500, logprobs=20)
    for i in range(int(sys.argv[2]))
]
print("sent", flush=True)
sys.stdin.readline()
time.sleep(3.0)
for stream in streams:
    chunks, code = 0, "none"
    try:
        for _ in stream:
            chunks += 1
    except RequestError as exc:
        code = exc.code
    print(chunks, code, flush=True)
"""


class UnreadClient:
    """``_UNREAD_CLIENT`` in its own process (a libzmq abort must not take pytest down)."""

    def __init__(self, endpoint: str, streams: int) -> None:
        self.streams = streams
        self.output = ""
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _UNREAD_CLIENT, endpoint, str(streams)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=daemon_env(),
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "sent\n"

    def read_now(self, timeout: float = 30.0) -> tuple[int, list[tuple[int, str]]]:
        """Tell it to read; its exit code and (chunks, error code) per stream. Everything
        it printed is left in ``output``."""
        self.output, _ = self.proc.communicate("go\n", timeout=timeout)
        results = [
            (int(parts[0]), parts[1])
            for parts in map(str.split, self.output.splitlines())
            if len(parts) == 2 and parts[0].isdigit()
        ]
        return self.proc.returncode, results

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class NotifySocket:
    """A fake ``$NOTIFY_SOCKET``: a datagram socket that keeps every assignment it receives,
    in order (one datagram may carry several, one per line)."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="or-e2e-"))  # short: sun_path is 108 bytes
        self.path = self._dir / "notify.sock"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(self.path))
        self.assignments: list[str] = []

    def env(self, watchdog_usec: int) -> dict[str, str]:
        return {"NOTIFY_SOCKET": str(self.path), "WATCHDOG_USEC": str(watchdog_usec)}

    def wait_for(self, assignment: str, timeout: float, after: int = 0) -> int:
        """Index of the first ``assignment`` (e.g. "READY=1") at or after index ``after``."""
        deadline = time.monotonic() + timeout
        while True:
            for i in range(after, len(self.assignments)):
                if self.assignments[i] == assignment:
                    return i
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {assignment} in {timeout} s; got {self.assignments}")
            self._sock.settimeout(left)
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            self.assignments += data.decode().split("\n")

    def drain(self) -> list[str]:
        """Take what has arrived without waiting; all assignments so far."""
        self._sock.setblocking(False)
        try:
            while True:
                self.assignments += self._sock.recv(4096).decode().split("\n")
        except BlockingIOError:
            return self.assignments
        finally:
            self._sock.setblocking(True)

    def close(self) -> None:
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class RawDealer:
    """A bare DEALER for frames the client library never sends."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(endpoint)
        self._replies = reply_codec()

    async def call(self, *parts: bytes) -> ClientReply:
        """Send one message; its reply (liveness probes, ``Ack("")``, skipped)."""
        await self.sock.send_multipart(list(parts))
        while True:
            reply = self._replies.decode(await asyncio.wait_for(self.sock.recv(), 10.0))
            if reply != Ack(""):
                return reply


class RecordingClient(AsyncClient):
    """An ``AsyncClient`` that also keeps every reply frame it receives, per request id, so
    that a test can count final frames on the wire (the library drops anything after one)."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint)
        self.frames: dict[str, list[ClientReply]] = defaultdict(list)
        self.undecodable = 0
        self._record_codec = reply_codec()

    def _dispatch(self, frame: bytes) -> None:
        try:
            reply = self._record_codec.decode(frame)
        except FrameError:
            self.undecodable += 1
        else:
            self.frames[reply.request_id].append(reply)
        super()._dispatch(frame)

    def finals(self, request_id: str) -> int:
        return sum(1 for reply in self.frames[request_id] if is_final(reply))
