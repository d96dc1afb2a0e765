"""What the fault soak (tests/test_soak.py) keeps and checks: a ledger of every request it sent
and how it ended, clients that record every reply frame on the wire, the request pool and the
checks of a result, and readers of the daemon's log and ``/proc``.

A request is *waited* when its caller reads until the final frame (it must get exactly one)
or *abandoned* when the caller lets go on purpose (abort-and-forget, cancel, dropped stream,
timeout, closed client, killed process): at most one final frame may reach it, and the
daemon finishes it at most once (exactly once when a reply proved it arrived).
"""

from __future__ import annotations

import os
import random
import re
import threading
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from e2e_workload import VOCAB, Spec
from tokenizers import Tokenizer as BackendTokenizer

from outrider.protocol import AsyncClient, Client, GenerateResult, TokenChunk
from outrider.protocol.frames import FrameCodec, FrameError, reply_codec
from outrider.protocol.messages import ClientReply, is_final

# --- the ledger -----------------------------------------------------------------------------


@dataclass
class Sent:
    """One generate/stream request the soak sent."""

    request_id: str
    source: str  # the worker (and fault) that sent it
    spec: Spec
    waited: bool
    outcome: str = "pending"  # "finished:<reason>", "error:<code>", "lost", "abandoned"
    reached: bool = False  # a reply proved that the daemon has it
    result: GenerateResult | None = None


class Ledger:
    """Every request sent, every problem seen; shared by tasks and threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self.sent: dict[str, Sent] = {}
        self.problems: list[str] = []
        self.lost_calls: list[str] = []  # health() calls that timed out (no request id)

    def add(self, source: str, spec: Spec, waited: bool, request_id: str = "") -> str:
        """Register a request before it is sent; its id is ``<source>-<n>`` unless given."""
        with self._lock:
            self._next += 1
            request_id = request_id or f"{source}-{self._next}"
            assert request_id not in self.sent, request_id
            outcome = "pending" if waited else "abandoned"
            self.sent[request_id] = Sent(request_id, source, spec, waited, outcome)
        return request_id

    def problem(self, message: str) -> None:
        with self._lock:
            self.problems.append(message)

    def reached(self, request_id: str) -> None:
        self.sent[request_id].reached = True

    def finished(self, request_id: str, result: GenerateResult) -> None:
        entry = self.sent[request_id]
        entry.outcome = f"finished:{result.finish_reason}"
        entry.result, entry.reached = result, True
        if result.request_id != request_id:
            self.problem(f"{request_id}: the result names {result.request_id!r}")

    def failed(self, request_id: str, code: str, message: str) -> None:
        """A waited request ended with an error (a timeout: it is lost)."""
        entry = self.sent[request_id]
        assert entry.waited, request_id
        entry.outcome = "lost" if code == "timeout" else f"error:{code}"
        if code != "timeout":
            self.problem(f"{request_id} ({entry.spec}): {code}: {message}")

    def lost_call(self, what: str) -> None:
        with self._lock:
            self.lost_calls.append(what)

    def lost(self) -> list[Sent]:
        return [s for s in self.sent.values() if s.waited and s.outcome == "lost"]


# --- recording clients ----------------------------------------------------------------------


class FrameLog:
    """Every reply frame any recording client received, per request id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.frames: dict[str, list[ClientReply]] = defaultdict(list)
        self.undecodable = 0

    def record(self, reply: ClientReply | None) -> None:
        with self._lock:
            if reply is None:
                self.undecodable += 1
            else:
                self.frames[reply.request_id].append(reply)

    def sequence_problem(self, request_id: str, waited: bool) -> str | None:
        """Why the frames of ``request_id`` break "one final frame, and it comes last"."""
        frames = self.frames.get(request_id, [])
        finals = [i for i, reply in enumerate(frames) if is_final(reply)]
        if waited and len(finals) != 1:
            return f"{request_id}: {len(finals)} final frames, waited for one"
        if len(finals) > 1:
            return f"{request_id}: {len(finals)} final frames"
        if finals and finals[0] != len(frames) - 1:
            kinds = [type(reply).__name__ for reply in frames]
            return f"{request_id}: a frame after the final one: {kinds}"
        return None


def _decode_or_none(codec: FrameCodec[ClientReply], frame: bytes) -> ClientReply | None:
    try:
        return codec.decode(frame)
    except FrameError:
        return None


class RecordingAsyncClient(AsyncClient):
    def __init__(self, endpoint: str, log: FrameLog, **options: float) -> None:
        super().__init__(endpoint, **options)
        self._log, self._codec = log, reply_codec()

    def _dispatch(self, frame: bytes) -> None:
        self._log.record(_decode_or_none(self._codec, frame))
        super()._dispatch(frame)


class RecordingClient(Client):
    def __init__(self, endpoint: str, log: FrameLog, **options: float) -> None:
        super().__init__(endpoint, **options)
        self._log, self._codec = log, reply_codec()

    def _dispatch(self, frame: bytes) -> None:
        self._log.record(_decode_or_none(self._codec, frame))
        super()._dispatch(frame)


# --- requests -------------------------------------------------------------------------------

_WORDS = ("hello", "world,", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog",
          "a", "tiny", "tokenizer", "for", "front", "door", "tests")  # fmt: skip
STOP_STRINGS = ("e", "th", "o ", " ", "zq", ", ")


def deterministic(spec: Spec) -> bool:
    """Whether the same request always gives the same tokens (greedy, or a fixed seed)."""
    return spec.temperature == 0 or spec.seed is not None


def safe_prompts(model: Path, rng: random.Random, count: int) -> list[str]:
    """Prompts of the tiny tokenizer's words whose ids all fit the model's 300 (it knows 320)."""
    tokenizer = BackendTokenizer.from_file(str(model / "tokenizer.json"))
    prompts: list[str] = []
    while len(prompts) < count:
        text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 14)))
        if max(tokenizer.encode(text).ids) < VOCAB:
            prompts.append(text)
    return prompts


def _ids(rng: random.Random, low: int, high: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, VOCAB) for _ in range(rng.randint(low, high)))


def build_pool(model: Path, seed: int) -> list[Spec]:
    """The soak's requests: greedy and seeded sampling (checked for equal tokens whenever
    repeated), unseeded sampling, stop strings and tokens, logprobs, a few long outputs and
    ``max_new_tokens=0``."""
    rng = random.Random(seed)
    pool: list[Spec] = []
    for i in range(24):  # greedy token ids
        budget = rng.choice((1, 4, 16, 32, 64, 200))
        pool.append(
            Spec("input_ids", _ids(rng, 2, 60), max_new_tokens=budget, ignore_eos=i % 3 != 0,
                 stop_token_ids=(rng.randrange(3, VOCAB),) if i % 5 == 0 else (),
                 logprobs=3 if i % 7 == 0 else 0)
        )  # fmt: skip
    for i in range(12):  # sampling, seeded (8) and not (4)
        pool.append(
            Spec("input_ids", _ids(rng, 3, 30), max_new_tokens=rng.choice((8, 24, 96)),
                 temperature=rng.choice((0.6, 1.0, 1.7)), top_k=rng.choice((0, 20)),
                 top_p=rng.choice((1.0, 0.8)), seed=1000 + i if i < 8 else None,
                 ignore_eos=True)
        )  # fmt: skip
    for i, prompt in enumerate(safe_prompts(model, rng, 12)):  # text, some with stop strings
        stops = tuple(rng.sample(STOP_STRINGS, rng.randint(1, 2))) if i % 2 == 0 else ()
        pool.append(Spec("prompt", prompt, max_new_tokens=rng.choice((8, 40)), stop=stops,
                         ignore_eos=True, logprobs=2 if i == 3 else 0))  # fmt: skip
    for i in range(4):  # long: to the context limit, or 600 tokens
        pool.append(
            Spec("input_ids", _ids(rng, 3, 20), max_new_tokens=None if i < 2 else 600,
                 ignore_eos=True)
        )  # fmt: skip
    pool.append(Spec("input_ids", (5, 6, 7), max_new_tokens=0))
    pool.append(Spec("prompt", "hello world", max_new_tokens=0))
    return pool


def long_spec(rng: random.Random) -> Spec:
    """A request that runs for seconds (to the context limit): the target of the aborts."""
    return Spec("input_ids", _ids(rng, 3, 12), max_new_tokens=None, ignore_eos=True,
                temperature=rng.choice((0.0, 1.0)), seed=rng.randrange(100))  # fmt: skip


def fixed_set() -> list[Spec]:
    """Sent before, during and after the soak: the same tokens every time."""
    rng = random.Random(7)
    specs = [
        Spec("input_ids", _ids(rng, 4, 40), max_new_tokens=n, ignore_eos=True)
        for n in (8, 24, 64, 150, 300)
    ]
    specs += [
        # (prompts whose ids all fit the model's 300: see e2e_workload's)
        Spec("prompt", "the dog", max_new_tokens=30, stop=("e",), ignore_eos=True),
        Spec("prompt", "hello world", max_new_tokens=40, stop=("zq", " t")),
        Spec("input_ids", (9, 8, 7, 6, 5, 4), max_new_tokens=50, logprobs=2, ignore_eos=True),
        Spec("input_ids", _ids(rng, 10, 30), max_new_tokens=40, temperature=1.3, seed=77,
             ignore_eos=True),
        Spec("input_ids", _ids(rng, 10, 30), max_new_tokens=40, temperature=0.8, top_k=10,
             top_p=0.9, seed=78, ignore_eos=True),
    ]  # fmt: skip
    return specs


def result_problem(
    spec: Spec, result: GenerateResult, chunks: list[TokenChunk] | None, context: int
) -> str | None:
    """What is wrong with one finished request, whatever its tokens."""
    out, usage = result.output_ids, result.usage
    if usage.completion_tokens != len(out):
        return f"completion_tokens {usage.completion_tokens} for {len(out)} ids"
    if spec.source == "input_ids" and usage.prompt_tokens != len(spec.value):
        return f"prompt_tokens {usage.prompt_tokens} for {len(spec.value)} ids"
    if spec.max_new_tokens is not None and len(out) > spec.max_new_tokens:
        return f"{len(out)} tokens for max_new_tokens={spec.max_new_tokens}"
    if result.finish_reason == "length":
        full = len(out) == spec.max_new_tokens or usage.prompt_tokens + len(out) == context
        if not full:
            return f"'length' after {len(out)} tokens (max_new_tokens={spec.max_new_tokens})"
    stop = result.matched_stop if result.finish_reason == "stop" else None
    if isinstance(stop, str) and (stop not in spec.stop or stop in result.text):
        return f"stop {result.matched_stop!r} matched, text {result.text!r}"
    if (result.logprobs is not None) != bool(spec.logprobs):
        return f"logprobs {result.logprobs is not None} for logprobs={spec.logprobs}"
    if result.logprobs is not None and [lp.token_id for lp in result.logprobs] != out:
        return "logprobs do not follow output_ids"
    if chunks is not None:
        if [t for chunk in chunks for t in chunk.token_ids] != out:
            return "the chunks' tokens differ from output_ids"
        if "".join(chunk.text for chunk in chunks) != result.text:
            return "the chunks' text differs from text"
    return None


def output_key(result: GenerateResult) -> tuple[object, ...]:
    return (tuple(result.output_ids), result.text, result.finish_reason, result.matched_stop)


def determinism_problems(ledger: Ledger) -> list[str]:
    """Every finished deterministic request agrees with the others of its spec; an aborted
    one is a prefix of them."""
    by_spec: dict[str, list[Sent]] = defaultdict(list)
    for entry in ledger.sent.values():
        if entry.result is not None and deterministic(entry.spec):
            by_spec[repr(entry.spec)].append(entry)
    problems = []
    for entries in by_spec.values():
        complete = [e for e in entries if e.result and e.result.finish_reason != "abort"]
        keys = Counter(output_key(e.result) for e in complete if e.result)
        if len(keys) > 1:
            ids = [(e.request_id, len(e.result.output_ids)) for e in complete if e.result]
            problems.append(f"{len(keys)} different outputs for {entries[0].spec}: {ids}")
        if not complete:
            continue
        assert complete[0].result is not None
        full = complete[0].result.output_ids
        for entry in entries:
            assert entry.result is not None
            got = entry.result.output_ids
            if entry.result.finish_reason == "abort" and got != full[: len(got)]:
                problems.append(f"{entry.request_id}: aborted output is not a prefix of {full}")
    return problems


# --- the daemon's log and processes ---------------------------------------------------------

_FINISHED = re.compile(
    r"DEBUG outrider\.scheduler: finished id=(\S+) rid=(\d+) .* reason=(\w+)$", re.MULTILINE
)
_RETRACTED = re.compile(r"INFO outrider\.scheduler: retract rid=(\d+) ")


def finished_lines(log: str) -> Iterator[tuple[str, str]]:
    """(request id, reason) of every request the daemon logged as finished, in order."""
    for line in log.splitlines():
        found = _FINISHED.search(line)
        if found is not None:
            yield found.group(1), found.group(3)


def retracted_ids(log: str) -> set[str]:
    """The request ids of the finished requests the daemon retracted at least once."""
    rids = set(_RETRACTED.findall(log))
    return {found.group(1) for found in _FINISHED.finditer(log) if found.group(2) in rids}


def error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if " ERROR " in line or "Traceback" in line]


def tracebacks(log: str) -> list[str]:
    """Each distinct Traceback in the log, up to the next timestamped line."""
    blocks: list[str] = []
    current: list[str] | None = None
    for line in log.splitlines():
        if line.startswith("Traceback"):
            current = [line]
        elif current is not None and re.match(r"\d{4}-\d\d-\d\d ", line):
            if "\n".join(current) not in blocks:
                blocks.append("\n".join(current))
            current = None
        elif current is not None:
            current.append(line)
    if current is not None and "\n".join(current) not in blocks:
        blocks.append("\n".join(current))
    return blocks


def rss_kb(pid: int) -> int:
    """Resident set size of ``pid`` (VmRSS, kB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def rss_of(pids: dict[str, int]) -> dict[str, int]:
    return {name: rss_kb(pid) for name, pid in pids.items()}


def process_alive(pid: int) -> bool:
    """Running, not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def skipped_faults() -> set[str]:
    """OUTRIDER_SOAK_SKIP: fault categories to leave out (to chase one failure at a time)."""
    return {name for name in os.environ.get("OUTRIDER_SOAK_SKIP", "").split(",") if name}


@dataclass
class Tally:
    """What each fault did, for the summary the test prints."""

    counts: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, name: str, count: int = 1) -> None:
        with self._lock:
            self.counts[name] += count
