"""The front door and detokenizer as spawned processes, with the daemon's side of the pipes
played by the test (``FakeDaemon``), and a tiny BPE tokenizer built with ``tokenizers``."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from outrider.daemon.detokenizer import DetokenizerConfig, run_detokenizer
from outrider.daemon.frontdoor.config import FrontDoorConfig
from outrider.daemon.frontdoor.process import run_frontdoor
from outrider.daemon.internal import (
    AbortRid,
    ChildStatus,
    Counters,
    FinishInfo,
    Heartbeat,
    InfoQuery,
    InfoReply,
    ModelFacts,
    Outputs,
    RequestUpdate,
    StateChange,
    TokenizedRequest,
    child_status_codec,
    control_codec,
    outputs_codec,
    to_daemon_codec,
)
from outrider.protocol.frames import reply_codec, request_codec
from outrider.protocol.messages import Ack, ClientReply, ClientRequest, TokenLogprob, Usage

SENTENCES = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "héllo wörld: ünïcode text and 日本語 too",
    "a tiny tokenizer for the front door tests",
]
REPLY_TEXT = "the quick brown fox jumps over the lazy dog, héllo 日本語"
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CONTEXT_LENGTH = 64
BOOT_ID = "boot-test"


def build_tokenizer(directory: Path) -> None:
    """A byte-level BPE (BOS added to every prompt) with a chat template, as HF files."""
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SENTENCES, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def model_facts(
    tokenizer_dir: Path | None, vocab_size: int, speculative_algorithm: str = "none"
) -> ModelFacts:
    return ModelFacts(
        model="tiny-test",
        vocab_size=vocab_size,
        context_length=CONTEXT_LENGTH,
        kv_total_tokens=4096,
        eos_token_ids=[1],
        tokenizer_dir=str(tokenizer_dir) if tokenizer_dir is not None else None,
        max_new_tokens_default=None,
        configuration={"page_size": 16},
        plugins={"attention": "torch"},
        speculative_algorithm=speculative_algorithm,
    )


class FakeDaemon:
    """The daemon's ends of the internal pipes, with a scripted daemon behind them.

    A request with ``max_new_tokens`` set is answered at once with the first tokens of
    ``reply_ids`` (streamed three per update); one without is held until an ``AbortRid``
    (answered with a final ``abort`` update) or until the test answers it itself.
    """

    def __init__(self, ctx: zmq.asyncio.Context, eps: dict[str, str], reply_ids: list[int]):
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.bind(eps["to_daemon"])
        self.to_detokenizer = ctx.socket(zmq.PUSH)
        self.to_detokenizer.connect(eps["to_detokenizer"])
        self.control = ctx.socket(zmq.PUSH)
        self.control.connect(eps["control"])
        for sock in (self.inbox, self.to_detokenizer, self.control):
            sock.linger = 0
        self.reply_ids = reply_ids
        self.requests: dict[str, TokenizedRequest] = {}  # by client request id
        self.held: set[int] = set()
        self.aborts: list[AbortRid] = []
        self.counters = Counters(running=3, waiting=1, kv_total_tokens=4096)
        self.finished: Counter[str] = Counter()
        self._outputs = outputs_codec()
        self._control = control_codec()
        self._tasks = [asyncio.create_task(self._pump()), asyncio.create_task(self._beat())]

    async def send_control(self, msg: Any) -> None:
        await self.control.send(self._control.encode(msg))

    async def start_serving(self, facts: ModelFacts) -> None:
        await self.send_control(facts)
        await self.send_control(Heartbeat(self.counters))
        await self.send_control(StateChange("ready"))

    async def send(self, *updates: RequestUpdate) -> None:
        """Updates to the detokenizer; finals are counted by reason, as the daemon does."""
        self.held -= {u.rid for u in updates if u.is_final}
        self.finished.update(u.finish.reason for u in updates if u.finish is not None)
        await self.to_detokenizer.send(self._outputs.encode(Outputs(list(updates))))

    async def request(self, request_id: str, timeout: float = 5.0) -> TokenizedRequest:
        await until(lambda: request_id in self.requests, timeout)
        return self.requests[request_id]

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def _pump(self) -> None:
        codec = to_daemon_codec()
        while True:
            msg = codec.decode(await self.inbox.recv())
            if isinstance(msg, TokenizedRequest):
                self.requests[msg.request_id] = msg
                if msg.max_new_tokens is None:
                    self.held.add(msg.rid)
                else:
                    await self._answer(msg)
            elif isinstance(msg, AbortRid):
                self.aborts.append(msg)
                if msg.rid in self.held:
                    await self.send(RequestUpdate(msg.rid, [], finish=finish("abort")))
            elif isinstance(msg, InfoQuery):
                finished = dict(self.finished)
                counters = msgspec.structs.replace(self.counters, requests_finished=finished)
                await self.send_control(InfoReply(msg.query_id, counters))

    async def _answer(self, req: TokenizedRequest) -> None:
        assert req.max_new_tokens is not None
        ids = self.reply_ids[: req.max_new_tokens]
        usage = Usage(prompt_tokens=len(req.input_ids), completion_tokens=len(ids))
        pieces = [ids[i : i + 3] for i in range(0, len(ids), 3)] if req.stream else [ids]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            logprobs = [TokenLogprob(t, -0.5) for t in piece] if req.want_logprobs else None
            info = FinishInfo("length", None, usage) if last else None
            await self.send(RequestUpdate(req.rid, piece, logprobs=logprobs, finish=info))

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            await self.send_control(Heartbeat(self.counters))


def finish(reason: Any, text_cut: int | None = None, matched: str | None = None) -> FinishInfo:
    return FinishInfo(reason, matched, Usage(), text_cut)


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.01)


class RawClient:
    """A bare DEALER speaking the wire codec, for what the client library will not send."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, rcvhwm: int = 1000) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.rcvhwm = rcvhwm
        self.sock.connect(endpoint)
        self._requests = request_codec()
        self._replies = reply_codec()

    async def send(self, msg: ClientRequest | dict[str, Any] | bytes) -> None:
        if isinstance(msg, dict):
            msg = self._requests.header + msgspec.msgpack.encode(msg)
        elif not isinstance(msg, bytes):
            msg = self._requests.encode(msg)
        await self.sock.send(msg)

    async def recv(self, timeout: float = 5.0) -> ClientReply:
        """The next reply; liveness probes (``Ack("")``) are skipped."""
        async with asyncio.timeout(timeout):
            while True:
                reply = self._replies.decode(await self.sock.recv())
                if reply != Ack(""):
                    return reply

    async def call(self, msg: ClientRequest | dict[str, Any] | bytes) -> ClientReply:
        await self.send(msg)
        return await self.recv()

    def close(self) -> None:
        self.sock.close()


@dataclass
class Stack:
    """One front door + one detokenizer, their spawn pipes, and the fake daemon."""

    eps: dict[str, str]
    ctx: zmq.asyncio.Context
    daemon: FakeDaemon
    processes: dict[str, BaseProcess]
    pipes: dict[str, Connection]
    statuses: dict[str, list[ChildStatus]] = field(default_factory=dict)

    @property
    def client_endpoint(self) -> str:
        return self.eps["client"]

    async def status(self, child: str, timeout: float = 20.0) -> ChildStatus:
        """The next ``ChildStatus`` the child reports over its spawn pipe, heartbeats
        (``alive``) skipped."""
        conn = self.pipes[child]
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await asyncio.to_thread(conn.poll, left):
                raise TimeoutError(f"{child} reported nothing in {timeout} s")
            status = child_status_codec().decode(conn.recv_bytes())
            if status.state != "alive":
                self.statuses.setdefault(child, []).append(status)
                return status

    def raw(self, rcvhwm: int = 1000) -> RawClient:
        return RawClient(self.ctx, self.client_endpoint, rcvhwm)

    async def stop(self) -> dict[str, int | None]:
        """As the daemon does: close each spawn pipe, detokenizer first, and wait for the
        child to exit on its own; returns the exit codes. Idempotent."""
        codes = {}
        for name in ("detokenizer", "frontdoor"):
            self.pipes[name].close()
            proc = self.processes[name]
            await asyncio.to_thread(proc.join, 10)
            if proc.exitcode is None:
                proc.kill()
            codes[name] = proc.exitcode
        self.daemon.close()
        self.ctx.destroy(linger=0)
        return codes


def start_stack(
    tokenizer_dir: Path | None,
    reply_ids: list[int],
    extra_sys_path: str | None = None,
    **frontdoor_options: Any,
) -> Stack:
    """Spawn both children (``extra_sys_path`` is visible to them only) and the fake daemon."""
    sockets = Path(tempfile.mkdtemp(prefix="or-fd-"))
    names = ("client", "to_daemon", "to_detokenizer", "to_front_door", "control")
    eps = {name: f"ipc://{sockets / name}.sock" for name in names}
    spawn = multiprocessing.get_context("spawn")
    frontdoor_cfg = FrontDoorConfig(
        client_endpoint=eps["client"],
        daemon_endpoint=eps["to_daemon"],
        outputs_endpoint=eps["to_front_door"],
        control_endpoint=eps["control"],
        boot_id=BOOT_ID,
        version="0.1.0-test",
        **frontdoor_options,
    )
    detok_cfg = DetokenizerConfig(
        inputs_endpoint=eps["to_detokenizer"],
        frontdoor_endpoint=eps["to_front_door"],
        tokenizer_dir=str(tokenizer_dir) if tokenizer_dir is not None else None,
    )
    processes: dict[str, BaseProcess] = {}
    pipes: dict[str, Connection] = {}
    if extra_sys_path is not None:
        sys.path.insert(0, extra_sys_path)  # spawn hands the parent's sys.path to the child
    try:
        for name, target, cfg in (
            ("frontdoor", run_frontdoor, frontdoor_cfg),
            ("detokenizer", run_detokenizer, detok_cfg),
        ):
            parent_end, child_end = spawn.Pipe()
            proc = spawn.Process(target=target, args=(cfg, child_end), name=name, daemon=True)
            proc.start()
            child_end.close()
            processes[name], pipes[name] = proc, parent_end
    finally:
        if extra_sys_path is not None:
            sys.path.remove(extra_sys_path)
    ctx = zmq.asyncio.Context()
    return Stack(eps, ctx, FakeDaemon(ctx, eps, reply_ids), processes, pipes)


def install_speculative_spec(root: Path, name: str) -> str:
    """A speculative plugin distribution (entry point + spec module) under ``root``, whose
    ``check_request`` refuses logprobs; returns the directory to put on ``sys.path``."""
    root.mkdir(parents=True, exist_ok=True)
    refusal = f"{name} cannot return logprobs"
    dist = root / "outrider_test_spec-0.1.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: outrider-test-spec\nVersion: 0.1\n"
    )
    (dist / "entry_points.txt").write_text(
        f"[outrider.speculative]\n{name} = outrider_test_spec:SPEC\n"
    )
    (root / "outrider_test_spec.py").write_text(
        "from outrider.plugins.api import PluginSpec\n"
        "SPEC = PluginSpec(\n"
        f"    name={name!r}, kind='speculative', summary='test', implementation='x:y',\n"
        f"    check_request=lambda f: {refusal!r} if f.logprobs else None,\n"
        ")\n"
    )
    return str(root)
