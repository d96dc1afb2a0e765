"""The fault soak's fault material (tests/soak_workers.py): malformed frames the front door
must answer with a typed Error, and a client process to SIGKILL mid-stream."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
from dataclasses import dataclass

import msgspec
from daemon_harness import daemon_env, poll_until
from e2e_workload import VOCAB, Spec

from outrider.protocol.frames import request_codec
from outrider.protocol.messages import ERROR_CODES, ClientReply, Error

# --- malformed frames -----------------------------------------------------------------------


@dataclass(frozen=True)
class BadFrame:
    """A frame (or multi-part message) the front door must answer with a typed Error."""

    name: str  # "<category>-<case>"; OUTRIDER_SOAK_SKIP names categories
    parts: tuple[bytes, ...]
    request_id: str | None = None  # the id the Error must echo (None: any id)
    codes: tuple[str, ...] = ()  # acceptable codes (empty: any wire code)

    @property
    def category(self) -> str:
        return self.name.split("-")[0]

    def problem(self, reply: ClientReply) -> str | None:
        """What is wrong with ``reply`` as the answer to this frame."""
        if not isinstance(reply, Error):
            return f"{self.name}: answered with {reply!r}"
        if reply.code not in ERROR_CODES or (self.codes and reply.code not in self.codes):
            return f"{self.name}: code {reply.code!r} ({reply.message}); expected {self.codes}"
        if self.request_id is not None and reply.request_id != self.request_id:
            return f"{self.name}: the Error names {reply.request_id!r}, not {self.request_id!r}"
        return None


def _body(**fields: object) -> bytes:
    return msgspec.msgpack.encode(fields)


# Deeper than any supported Python decodes: msgspec raises RecursionError past the interpreter's
# limit, 1,000 frames on 3.11 but the C recursion limit on 3.12 (a 1,000-deep value decodes there).
DEEP = 20_000  # the maps variant, 3 bytes a level, stays under the soak's 64 KiB frames


def _nested(depth: int, leaf: bytes = b"\xc0") -> bytes:
    return b"\x91" * depth + leaf


def bad_frames(rng: random.Random, serial: int) -> list[BadFrame]:
    """One round of malformed and out-of-range frames; ids carry ``serial``."""
    head = request_codec().header
    version = head[0] & 0x0F
    rid = f"raw{serial}"
    generate = {"type": "generate", "request_id": rid, "input_ids": [5, 6]}
    valid = head + _body(**generate)
    health = _body(type="health", request_id=rid)
    junk_field = b"\xa4junk"
    any_error = ("malformed", "invalid_request", "unsupported_version")
    frames = [
        BadFrame("garbage-empty", (b"",), "", ("malformed",)),
        BadFrame("garbage-zero", (b"\x00garbage",), "", ("malformed",)),
        BadFrame("garbage-random", (bytes([0x30]) + rng.randbytes(rng.randint(1, 48)),), "",
                 ("malformed",)),
        BadFrame("garbage-body", (head + b"\xc1" + rng.randbytes(rng.randint(0, 32)),), "",
                 ("malformed",)),
        BadFrame("version-newer", (bytes([head[0] + 1]) + _body(**generate),), rid,
                 ("unsupported_version",)),
        BadFrame("version-zero", (bytes([head[0] & 0xF0]) + b"\xc1",), "",
                 ("unsupported_version",)),
        BadFrame("kind-reply", (bytes([0x20 | version]) + _body(**generate),), "",
                 ("malformed",)),
        BadFrame("kind-seven", (bytes([0x70 | version]) + _body(**generate),), "",
                 ("malformed",)),
        BadFrame("utf8-id", (b"\x11\x82\xa4type\xa6health\xaarequest_id\xa1\xff",), "",
                 any_error),
        BadFrame("utf8-prompt",
                 (head + _body(type="generate", request_id=rid, prompt="@@").replace(
                     b"\xa2@@", b"\xa2\xc3\x28"),), None, any_error),
        BadFrame("utf8-key", (head + b"\x82\xa4type\xa6health\xa2\xfe\xfe\xa1x",), None,
                 any_error),
        BadFrame("nesting-body", (head + _nested(DEEP),), None, any_error),
        BadFrame("nesting-unknown", (head + b"\x83" + health[1:] + junk_field + _nested(DEEP),),
                 None, any_error),
        BadFrame("nesting-maps",
                 (head + b"\x83" + health[1:] + junk_field + b"\x81\xa1k" * DEEP + b"\xc0",),
                 None, any_error),
        BadFrame("nesting-ids", (head + _body(**generate | {"input_ids": []}).replace(
            b"\xa9input_ids\x90", b"\xa9input_ids" + _nested(DEEP, b"\x90")),), None,
                 any_error),
        BadFrame("multipart-two", (valid, b"extra"), "", ("malformed",)),
        BadFrame("multipart-three", (b"a", b"b", b"c"), "", ("malformed",)),
    ]  # fmt: skip
    out_of_range: list[dict[str, object]] = [
        {"temperature": 1000.0}, {"temperature": float("nan")}, {"top_p": 0.0},
        {"top_k": 2**31}, {"top_k": VOCAB + 1}, {"max_new_tokens": -1},
        {"max_new_tokens": 2**40}, {"seed": 2**64 - 1}, {"logprobs": 21},
        {"input_ids": [5, VOCAB]}, {"input_ids": [5, 2**31]}, {"input_ids": []},
        {"stop": [f"s{i}" for i in range(17)]}, {"stop": [""]}, {"stop": ["x" * 257]},
        {"stop_token_ids": [VOCAB]}, {"prompt": "hello"}, {"input_ids": [5] * 4096},
        {"messages": [{"role": "robot", "content": "hi"}], "input_ids": None},
    ]  # fmt: skip
    for i, fields in enumerate(out_of_range):
        frames.append(BadFrame(f"range-{i}", (head + _body(**generate | fields),), rid,
                               ("invalid_request", "prompt_too_long")))  # fmt: skip
    frames += [
        BadFrame("range-type", (head + _body(type="bogus", request_id=rid),), None,
                 ("invalid_request",)),
        BadFrame("range-longid", (head + _body(**generate | {"request_id": "x" * 300}),), None,
                 ("invalid_request",)),
        BadFrame("range-noid", (head + _body(type="health"),), "", ("invalid_request",)),
    ]  # fmt: skip
    return frames


# --- a client process to SIGKILL ------------------------------------------------------------

# Streams argv[3] long requests (ids argv[2]-0, -1, ...), then reads them round robin,
# printing "chunk <id>" for every chunk, until it is killed.
_STREAMING_CLIENT = """
import sys
from outrider.protocol import Client
endpoint, prefix, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = Client(endpoint, timeout=120)
streams = [
    client.stream(input_ids=[5, 6, 7, 8 + i], ignore_eos=True, temperature=0.7, seed=i,
                  request_id=f"{prefix}-{i}")
    for i in range(count)
]
print("sent", flush=True)
while streams:
    for stream in list(streams):
        chunk = next(stream, None)
        if chunk is None:
            streams.remove(stream)
        else:
            print("chunk", stream.request_id, flush=True)
"""


def killed_spec(index: int) -> Spec:
    """The request ``_STREAMING_CLIENT`` sends as its stream ``index``."""
    return Spec("input_ids", (5, 6, 7, 8 + index), max_new_tokens=None, temperature=0.7,
                seed=index, ignore_eos=True)  # fmt: skip


class StreamingClientProcess:
    """``_STREAMING_CLIENT`` as a child process; ``chunked`` holds the ids it got chunks of."""

    def __init__(self, endpoint: str, prefix: str, count: int) -> None:
        self.chunked: set[str] = set()
        self.sent = threading.Event()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _STREAMING_CLIENT, endpoint, prefix, str(count)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=daemon_env(),
        )
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line == "sent\n":
                self.sent.set()
            elif line.startswith("chunk ") and line.endswith("\n"):  # a kill may cut a line
                self.chunked.add(line.split()[1])
            else:
                self.output.append(line)

    def wait_chunks(self, count: int, timeout: float) -> bool:
        """Wait until chunks of ``count`` streams have arrived; False on timeout."""
        try:
            poll_until(lambda: len(self.chunked) >= count, timeout, "chunks")
        except TimeoutError:
            return False
        return True

    def kill(self) -> int:
        self.proc.kill()
        code = self.proc.wait(10)
        self._reader.join(10)
        return code
