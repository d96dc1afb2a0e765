"""The detokenizer process: daemon --Outputs (token ids)--> here --Outputs (+ text)--> front door.

Each request's output is decoded incrementally with the same ``IncrementalDecoder`` the
daemon's stop-string matcher uses, so ``FinishInfo.text_cut`` (a character offset into the
request's whole output text) means the same text here. A request's decoder lives from its
first update to its final one. Without a tokenizer (token ids only) frames pass through and
``text`` stays "". Every ``BEAT_S`` it also sends the front door an empty batch: the front
door's ``health`` says ``serving`` only while these keep coming.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from multiprocessing.connection import Connection

import zmq
import zmq.asyncio

from outrider.daemon.internal import Outputs, RequestUpdate, outputs_codec
from outrider.daemon.processes.child_runtime import (
    ChildTasks,
    ParentPipe,
    child_setup,
    internal_receiver,
    internal_sender,
    run_child,
)
from outrider.daemon.tokenizer import IncrementalDecoder, Tokenizer, load_tokenizer

log = logging.getLogger("outrider.detokenizer")

BEAT_S = 1.0  # the empty batch that tells the front door this process runs


@dataclass(frozen=True)
class DetokenizerConfig:
    """What the daemon hands the detokenizer at spawn. It loads the tokenizer, binds its
    input pipe, connects to the front door's, then reports ``ChildStatus("started")``."""

    inputs_endpoint: str  # PULL bind: Outputs from the daemon (InternalEndpoints.to_detokenizer)
    frontdoor_endpoint: str  # PUSH connect: Outputs to the front door (.to_front_door)
    tokenizer_dir: str | None  # None: token ids only
    log_level: str = "info"


def run_detokenizer(cfg: DetokenizerConfig, parent_conn: Connection) -> None:
    """Entry point of the detokenizer process (``multiprocessing`` spawn target)."""
    child_setup("detokenizer", cfg.log_level)
    run_child(lambda ctx: _main(cfg, parent_conn, ctx))


async def _main(cfg: DetokenizerConfig, parent_conn: Connection, ctx: zmq.asyncio.Context) -> None:
    parent = ParentPipe(parent_conn, "detokenizer")
    tokenizer = load_tokenizer(cfg.tokenizer_dir) if cfg.tokenizer_dir else None
    texts = OutputTexts(tokenizer) if tokenizer is not None else None
    inputs = internal_receiver(ctx, cfg.inputs_endpoint)
    outputs = internal_sender(ctx, cfg.frontdoor_endpoint)
    tasks = ChildTasks(parent)
    tasks.spawn(_forward(inputs, outputs, texts, tasks))
    tasks.spawn(_beat(outputs))
    parent.report("started")
    log.info("detokenizer started (%s)", "text" if texts is not None else "token ids only")
    await tasks.run()


async def _forward(
    inputs: zmq.asyncio.Socket,
    outputs: zmq.Socket[bytes],
    texts: OutputTexts | None,
    tasks: ChildTasks,
) -> None:
    codec = outputs_codec()
    while True:
        frame = await inputs.recv(copy=False)
        tasks.touch()
        if texts is None:
            outputs.send(frame, zmq.DONTWAIT)  # unbounded: never waits
            continue
        batch = codec.decode(frame.buffer)
        for update in batch.updates:
            texts.fill(update)
        outputs.send(codec.encode(batch), zmq.DONTWAIT)


async def _beat(outputs: zmq.Socket[bytes]) -> None:
    empty = outputs_codec().encode(Outputs([]))
    while True:
        outputs.send(empty, zmq.DONTWAIT)
        await asyncio.sleep(BEAT_S)


class OutputTexts:
    """Per-request incremental decoding of output tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoders: dict[int, IncrementalDecoder] = {}

    @property
    def active(self) -> int:
        """Requests whose final update has not been seen yet."""
        return len(self._decoders)

    def fill(self, update: RequestUpdate) -> None:
        """Set ``update.text`` to the text its tokens add; on a final update, cut the
        request's text at ``finish.text_cut`` and forget the request."""
        decoder = self._decoders.get(update.rid)
        if decoder is None:
            decoder = self._decoders[update.rid] = self._tokenizer.decoder()
        text = decoder.extend(update.token_ids)
        if not update.is_final:
            update.text = text
            return
        del self._decoders[update.rid]
        cut = update.finish.text_cut if update.finish is not None else None
        if cut is not None:
            sent = decoder.length - len(text)  # characters already in earlier updates
            if cut < sent:
                # The daemon withholds tokens that could begin a stop string; text past the
                # cut having been streamed already means that invariant broke.
                log.error(
                    "rid %d: text_cut %d is before %d streamed characters", update.rid, cut, sent
                )
            text = text[: max(0, cut - sent)]
        update.text = text
