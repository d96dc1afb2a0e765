"""The HTTP fault soak: one ``outrider serve --http`` daemon on the embedded family, good
clients and hostile ones at once, for ``DURATION_S``.

Good clients (httpx): streamed and non-streamed completions and chat, a slow SSE reader (raw
socket). Hostile clients: a stalled SSE reader, oversized bodies (declared and chunked),
bodies at the limit whose prompts the daemon refuses, slowloris (dripped headers, dripped
body), hostile JSON (invalid UTF-8, deep nesting, huge integers, wrong types), too many ids
for /tokenize and /detokenize, a foreign Host or Origin. Inputs are drawn from ``SEED``.

Checked: every good request got exactly one complete answer (a stream ends with a
finish_reason and ``data: [DONE]``; a 200 body is a whole completion); every hostile one got
its 4xx or 408 or lost its connection, in bounded time; the stalled streams lost their
connections and no request was left in the daemon; the HTTP process's fds come back and its
RSS stays bounded; the log has no traceback.
"""

from __future__ import annotations

import contextlib
import json
import random
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from daemon_harness import poll_until
from http_harness import FAMILY, HttpDaemon

from outrider.daemon.http.config import body_limit
from outrider.protocol import Client

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(FAMILY is None, reason="the embedded family is not installed"),
]

SEED = 2027
DURATION_S = 10.0
MAX_MESSAGE_BYTES = 2**20
BODY_LIMIT = body_limit(MAX_MESSAGE_BYTES)
READ_TIMEOUT_S = 2.0
SEND_TIMEOUT_S = 2.0
MAX_TOKENIZE_TOKENS = 2048
# An answer (or a close) is due within this much past the deadline it waits on.
SLACK_S = 4.0
# A stalled reader's connection closes within this (its buffers fill, then the send timeout).
STALL_BOUND_S = 15
RSS_GROWTH_LIMIT_KB = 150 * 1024
FD_SLACK = 8
WORDS = [
    "the",
    "sea",
    "a",
    "ship",
    "sails",
    "far",
    "under",
    "grey",
    "skies",
    "while",
    "gulls",
    "cry",
    "over",
    "waves",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    http = HttpDaemon(
        tmp_path_factory.mktemp("http-soak"),
        "--max-message-bytes", str(MAX_MESSAGE_BYTES),
        "--http-read-timeout", str(READ_TIMEOUT_S),
        "--http-send-timeout", str(SEND_TIMEOUT_S),
        "--http-max-tokenize-tokens", str(MAX_TOKENIZE_TOKENS),
    )  # fmt: skip
    try:
        yield http
        assert http.daemon.stop() == 0, http.daemon.log()
    finally:
        http.daemon.kill_all()


class Soak:
    """What the workers saw: counts per kind and every broken promise."""

    def __init__(self, server: HttpDaemon) -> None:
        self.server = server
        self.port = server.port
        self.deadline = time.monotonic() + DURATION_S
        self.counts: Counter[str] = Counter()
        self.failures: list[str] = []
        self._lock = threading.Lock()

    def record(self, kind: str, failure: str | None = None) -> None:
        with self._lock:
            self.counts[kind] += 1
            if failure is not None:
                self.failures.append(f"{kind}: {failure}")

    def run(self, workers: list[tuple[str, Callable[[Soak, random.Random], None]]]) -> None:
        def loop(index: int, kind: str, work: Callable[[Soak, random.Random], None]) -> None:
            rng = random.Random(SEED * 1000 + index)
            while time.monotonic() < self.deadline:
                try:
                    work(self, rng)
                except Exception as exc:  # a worker's own failure is a soak failure
                    self.record(kind, f"{type(exc).__name__}: {exc}")

        threads = [
            threading.Thread(target=loop, args=(i, kind, work), daemon=True)
            for i, (kind, work) in enumerate(workers)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(DURATION_S + 60)
            assert not thread.is_alive(), "a soak worker hangs"


# --- good clients --------------------------------------------------------------------------


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))


def _generation(rng: random.Random, stream: bool) -> tuple[str, dict[str, object]]:
    body: dict[str, object] = {"max_tokens": rng.randint(1, 24), "stream": stream}
    body |= {"temperature": rng.choice((0.0, 0.8)), "ignore_eos": rng.random() < 0.5}
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        return "/v1/completions", body | {"prompt": _prompt(rng)}
    return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": _prompt(rng)}]}


def _stream_problem(events: list[str]) -> str | None:
    """What is wrong with a streamed answer's ``data:`` events, if anything."""
    if not events or events[-1] != "[DONE]" or events.count("[DONE]") != 1:
        return f"does not end with one [DONE]: {events[-3:]}"
    chunks = [json.loads(event) for event in events[:-1]]
    if any("error" in chunk for chunk in chunks):
        return f"an error event: {chunks[-1]}"
    reasons = [c["finish_reason"] for chunk in chunks for c in chunk["choices"]]
    if not reasons or reasons[-1] not in ("stop", "length") or any(reasons[:-1]):
        return f"finish reasons {reasons}"
    return None


def good_stream(soak: Soak, rng: random.Random) -> None:
    path, body = _generation(rng, stream=True)
    with httpx.stream("POST", soak.server.base + path, json=body, timeout=30) as response:
        if response.status_code != 200:
            soak.record("good_stream", f"status {response.status_code}: {response.read()!r}")
            return
        events = [ln[6:] for ln in response.iter_lines() if ln.startswith("data: ")]
    soak.record("good_stream", _stream_problem(events))


def good_plain(soak: Soak, rng: random.Random) -> None:
    path, body = _generation(rng, stream=False)
    response = httpx.post(soak.server.base + path, json=body, timeout=30)
    answer = response.json()
    complete = (
        response.status_code == 200
        and answer["choices"][0]["finish_reason"] in ("stop", "length")
        and answer["usage"]["completion_tokens"] >= 1
    )
    soak.record("good_plain", None if complete else f"{response.status_code}: {answer}")


def _raw(port: int, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    sock.settimeout(READ_TIMEOUT_S + SEND_TIMEOUT_S + SLACK_S)
    return sock


def _request(path: str, body: bytes, extra: bytes = b"") -> bytes:
    head = b"POST %s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n" % (
        path.encode()
    )
    return head + extra + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body


def _dechunk(raw: bytes) -> bytes:
    _head, _, rest = raw.partition(b"\r\n\r\n")
    body = b""
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        body, rest = body + rest[:size], rest[size + 2 :]
    return body


def _sse_body(path: str, rng: random.Random, max_tokens: int, logprobs: bool) -> bytes:
    body: dict[str, object] = {"max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    if path == "/v1/completions":
        body |= {"prompt": _prompt(rng)} | ({"logprobs": 20} if logprobs else {})
    else:
        body |= {"messages": [{"role": "user", "content": _prompt(rng)}]}
        body |= {"logprobs": True, "top_logprobs": 20} if logprobs else {}
    return json.dumps(body).encode()


def slow_reader(soak: Soak, rng: random.Random) -> None:
    """Reads its stream a little at a time, never stalling past the send timeout."""
    path = rng.choice(("/v1/completions", "/v1/chat/completions"))
    with _raw(soak.port, rcvbuf=4096) as sock:
        logprobs = rng.random() < 0.5
        sock.sendall(_request(path, _sse_body(path, rng, rng.randint(4, 24), logprobs)))
        raw = b""
        while chunk := sock.recv(rng.randint(512, 4096)):
            raw += chunk
            time.sleep(rng.uniform(0.0, SEND_TIMEOUT_S / 8))
    events = [ln[6:].decode() for ln in _dechunk(raw).split(b"\n") if ln.startswith(b"data: ")]
    soak.record("slow_reader", _stream_problem(events))


# --- hostile clients -----------------------------------------------------------------------


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    with contextlib.suppress(ConnectionError, TimeoutError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def _status(answer: bytes) -> int | None:
    """The status of a raw answer; None when the connection closed without one."""
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None


def stalled_reader(soak: Soak, rng: random.Random) -> None:
    """Asks for a long stream of large events and reads nothing: once the buffers are full,
    the send timeout must end the connection (and abort the request) long before the stream
    would have ended."""
    path = "/v1/chat/completions"
    with _raw(soak.port, rcvbuf=4096) as sock:
        sock.sendall(_request(path, _sse_body(path, rng, 400, logprobs=True)))
        poller = select.poll()  # wakes on the server's close, not on its data
        poller.register(sock, select.POLLERR | select.POLLHUP | select.POLLRDHUP)
        closed = poller.poll(STALL_BOUND_S * 1000)
        raw = _read_all(sock)
    failure = None
    if b"data: [DONE]" in raw:
        failure = "a stalled reader's stream ran to its end"
    elif not closed:
        failure = f"the stalled connection was open after {STALL_BOUND_S} s"
    soak.record("stalled_reader", failure)


def _expect_refusal(soak: Soak, kind: str, answer: bytes, allowed: set[int | None]) -> None:
    status = _status(answer)
    soak.record(kind, None if status in allowed else f"answered {status}: {answer[:300]!r}")


def oversized(soak: Soak, rng: random.Random) -> None:
    declared = rng.random() < 0.5
    size = rng.randint(BODY_LIMIT + 1, 4 * BODY_LIMIT)
    path = rng.choice(("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"))
    head = b"POST %s HTTP/1.1\r\nhost: localhost\r\n" % path.encode()
    with _raw(soak.port) as sock:
        with contextlib.suppress(ConnectionError):
            if declared:
                sock.sendall(head + b"content-length: %d\r\n\r\n" % size)
                sock.sendall(b'{"prompt": "' + b"a" * rng.randint(0, BODY_LIMIT // 2))
            else:
                sock.sendall(head + b"transfer-encoding: chunked\r\n\r\n")
                sent = 0
                while sent < size:
                    piece = rng.randint(1, 256 * 1024)
                    sock.sendall(b"%x\r\n" % piece + b"b" * piece + b"\r\n")
                    sent += piece
        answer = _read_all(sock)
    _expect_refusal(soak, "oversized", answer, {413, None})
    time.sleep(0.05)


def at_limit(soak: Soak, rng: random.Random) -> None:
    """A body just within the limit goes to the daemon (which refuses its prompt as too long)
    without costing the shared connection anything."""
    filler = BODY_LIMIT - rng.randint(20, 4096)
    body = b'{"prompt": "' + b"x " * (filler // 2) + b'", "max_tokens": 1}'
    response = httpx.post(soak.server.base + "/v1/completions", content=body, timeout=30)
    ok = response.status_code == 413 and response.json()["error"]["code"] == "prompt_too_long"
    soak.record("at_limit", None if ok else f"{response.status_code}: {response.text[:300]}")
    time.sleep(1.0)


def slowloris(soak: Soak, rng: random.Random) -> None:
    """Drips headers, or a body, one byte at a time: 408 or closed by the read timeout."""
    body = _sse_body("/v1/completions", rng, 4, logprobs=False)
    request = _request("/v1/completions", body)
    split = rng.randint(1, len(request) - 2)
    if rng.random() < 0.5:
        split = min(split, request.index(b"\r\n\r\n"))
    started = time.monotonic()
    with _raw(soak.port) as sock:
        sock.sendall(request[:split])
        with contextlib.suppress(ConnectionError):
            for byte in request[split : split + 200]:
                if time.monotonic() - started > READ_TIMEOUT_S + SLACK_S:
                    break
                time.sleep(rng.uniform(0.2, 0.6))
                sock.send(bytes([byte]))
        answer = _read_all(sock)
    late = time.monotonic() - started > READ_TIMEOUT_S + 2 * SLACK_S
    _expect_refusal(soak, "slowloris", b"late" if late else answer, {408, None})


_BAD_UTF8 = (b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"a\x80b")
_WRONG_TYPES = {
    "prompt": ({}, 5, True, [[["a"]]], [1.5]),
    "max_tokens": ("8", 1.5, [], {}, -1),
    "temperature": ("hot", [], {}),
    "stream": ("yes", 1, []),
    "n": ("1", [], 0, 17),
    "presence_penalty": ("x", [], 2.5),
    "logit_bias": ([], {"x": 1}, {"5": "big"}, {"5": 101}),
    "seed": ("x", 1.5, -3),
    "logprobs": ("x", [], 21),
    "stop": (5, [1], {}),
}


def _hostile_body(rng: random.Random) -> tuple[str, bytes]:
    kind = rng.choice(("utf8", "nesting", "huge_int", "wrong_type", "too_many_ids", "tokens"))
    if kind == "utf8":
        path, field = rng.choice(
            (("/v1/completions", "prompt"), ("/v1/completions", "model"),
             ("/v1/chat/completions", "content"), ("/tokenize", "prompt"))
        )  # fmt: skip
        bad = rng.choice(_BAD_UTF8)
        if field == "content":
            return path, b'{"messages": [{"role": "user", "content": "hi' + bad + b'"}]}'
        return path, b'{"prompt": "a", "%s": "x%sy"}' % (field.encode(), bad)
    if kind == "nesting":
        depth = rng.randint(1000, 20000)
        field = rng.choice((b"prompt", b"unknown", b"stop", b"messages"))
        nested = b"[" * depth + b"]" * depth
        return rng.choice(("/v1/completions", "/tokenize")), b'{"%s": %s}' % (field, nested)
    if kind == "huge_int":
        value = rng.randint(2**64, 2**90) * rng.choice((1, -1))
        path, template = rng.choice(
            (("/v1/completions", b'{"prompt": "a", "seed": %d}'),
             ("/v1/completions", b'{"prompt": "a", "max_tokens": %d}'),
             ("/v1/completions", b'{"prompt": [1, %d]}'),
             ("/v1/chat/completions", b'{"messages": [], "top_k": %d}'),
             ("/detokenize", b'{"tokens": [5, %d]}'))
        )  # fmt: skip
        return path, template % value
    if kind == "wrong_type":
        field = rng.choice(list(_WRONG_TYPES))
        value = rng.choice(_WRONG_TYPES[field])
        body = {"prompt": "a", field: value}
        return "/v1/completions", json.dumps(body).encode()
    if kind == "too_many_ids":
        count = MAX_TOKENIZE_TOKENS + rng.randint(1, 50_000)
        return "/detokenize", json.dumps(
            {"tokens": [rng.randrange(300) for _ in range(count)]}
        ).encode()
    text = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(100_000, 500_000)))
    return "/tokenize", json.dumps({"prompt": text}).encode()


def hostile_json(soak: Soak, rng: random.Random) -> None:
    path, body = _hostile_body(rng)
    response = httpx.post(soak.server.base + path, content=body, timeout=30)
    error = response.json().get("error", {}) if response.status_code >= 400 else {}
    shaped = set(error) == {"message", "type", "param", "code"}
    ok = response.status_code == 400 and shaped and "ipc://" not in str(error["message"])
    soak.record("hostile_json", None if ok else f"{path} {body[:80]!r}: {response.status_code}")


def foreign_caller(soak: Soak, rng: random.Random) -> None:
    headers = rng.choice(
        ({"Host": f"evil{rng.randrange(100)}.example:{soak.port}"},
         {"Origin": f"http://page{rng.randrange(100)}.example", "Content-Type": "text/plain"})
    )  # fmt: skip
    path = rng.choice(("/v1/completions", "/tokenize", "/health", "/metrics"))
    response = httpx.post(soak.server.base + path, content=b'{"prompt": "a"}', headers=headers)
    soak.record("foreign_caller", None if response.status_code == 403 else f"{response}")
    time.sleep(0.1)


# --- the soak ------------------------------------------------------------------------------


def _proc_status(pid: int) -> tuple[int, int]:
    """(VmRSS in kB, open fds) of ``pid``."""
    rss = next(
        int(line.split()[1])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("VmRSS:")
    )
    return rss, len(list(Path(f"/proc/{pid}/fd").iterdir()))


def _idle(endpoint: str) -> bool:
    """Whether the daemon holds no request (none running, none waiting)."""
    with Client(endpoint) as client:
        info = client.server_info()
    return info.running == 0 and info.waiting == 0


def test_http_fault_soak(server: HttpDaemon) -> None:
    pid = server.daemon.child_pid("http")
    rss_before, fds_before = _proc_status(pid)
    soak = Soak(server)
    workers: list[tuple[str, Callable[[Soak, random.Random], None]]] = [
            ("good_stream", good_stream), ("good_stream", good_stream),
            ("good_plain", good_plain), ("slow_reader", slow_reader),
            ("stalled_reader", stalled_reader), ("oversized", oversized),
            ("at_limit", at_limit), ("slowloris", slowloris), ("slowloris", slowloris),
            ("hostile_json", hostile_json), ("hostile_json", hostile_json),
            ("foreign_caller", foreign_caller),
    ]  # fmt: skip
    soak.run(workers)
    assert not soak.failures, "\n".join(soak.failures[:20]) + f"\ncounts: {soak.counts}"
    assert set(soak.counts) == {kind for kind, _ in workers}, soak.counts
    # Every request ended: a stalled reader's is aborted once the front sees the stall, or has
    # finished before it where the model outruns the buffers (a GPU serves its 400 tokens long
    # before the stall bound); none is left holding a slot.
    poll_until(lambda: _idle(server.daemon.endpoint), 10.0, "every request ended", interval=0.2)
    # Every connection is closed once the clients are gone; memory stayed bounded.
    poll_until(lambda: _proc_status(pid)[1] <= fds_before + FD_SLACK, 10.0, "the HTTP fds closing")
    rss_after, _ = _proc_status(pid)
    assert rss_after - rss_before < RSS_GROWTH_LIMIT_KB, (rss_before, rss_after)
    # The shared client connection survived: a request after the soak is served.
    good_stream(soak, random.Random(SEED))
    assert not soak.failures, soak.failures
    log = server.daemon.log()
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-4000:]
    assert log.count("HTTP access: any local user without a key") == 1
