"""``CompileChild``: grammars compiled in a process of their own, so that a grammar that
compiles for long or takes gigabytes (a JSON schema's ``pattern`` such as ``^(ab|a){0,5000}$``
took 13.8 s against a 128k vocabulary, a 50,000-string ``enum`` 92 s and 0.9 GB:
BENCHMARKS.md) is refused instead of holding every constrained request behind it, or the
daemon's memory. The child reads the vocabulary once, compiles one grammar at a time and
returns it serialized (xgrammar's ``serialize_json``; the daemon reads it against its own
vocabulary). A compile past ``timeout`` seconds kills the child, and the next compile starts
a new one; a start, the vocabulary's read included, is waited for apart, up to
``START_TIMEOUT``. The child's data segment is capped at ``memory_bytes`` (``RLIMIT_DATA``): a
compile that needs more fails there, and the daemon goes on.

Invariant: one compile at a time (``GrammarQueue``'s one thread calls ``compile``); the child
ignores SIGINT and SIGTERM and exits when the daemon's end of its pipe closes.
"""

from __future__ import annotations

import multiprocessing
import resource
import signal
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from outrider.daemon.internal import FinalMessage, ToolUse
from outrider.protocol.messages import Grammar

# What the child answers: ("ok", the compiled grammar as xgrammar's JSON) or ("refused", why);
# once started, ("ready", "").
Answer = tuple[str, str]
START_TIMEOUT = 120.0  # seconds a child may take to start and read the vocabulary
ENDED = "compiling the grammar ended its process (over --grammar-compile-memory-mb?)"


class CompileRefused(ValueError):
    """The child refused the grammar, ran out of time or memory; the message says which."""


class CompileChild:
    def __init__(
        self,
        tokenizer_dir: str,
        vocab_size: int,
        stop_ids: Sequence[int],
        timeout: float,
        memory_bytes: int,
    ) -> None:
        """The child's ``Grammars(tokenizer_dir, vocab_size, stop_ids)``; ``timeout``: the
        seconds a compile may take; ``memory_bytes``: its data segment's cap (0: none).
        Nothing starts until the first compile."""
        self._args = (tokenizer_dir, vocab_size, list(stop_ids), memory_bytes)
        self.timeout = timeout
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None

    def compile(self, what: Grammar | FinalMessage | ToolUse) -> str:
        """``what`` compiled (a grammar, one held to a harmony output's final message, or a
        chat request's tools), as xgrammar's JSON;
        raises ``CompileRefused`` with the compiler's reason, or where the compile took
        longer than ``timeout`` or ended the child."""
        conn = self._started()
        conn.send(what)
        late = f"the grammar did not compile within {self.timeout:g} s (--grammar-compile-timeout)"
        status, text = self._answer(conn, self.timeout, late)
        if status != "ok":
            raise CompileRefused(text)
        return text

    def close(self) -> None:
        """Stop the child, if one runs (a compile in progress is lost)."""
        if self._conn is not None:
            self._conn.close()
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
        self._proc, self._conn = None, None

    def _started(self) -> Connection:
        """The pipe to a child that has read the vocabulary (started now if none runs)."""
        if self._conn is None:
            ctx = multiprocessing.get_context("spawn")
            child_end, self._conn = ctx.Pipe(duplex=True)
            self._proc = ctx.Process(
                target=_serve, args=(child_end, *self._args), name="outrider-grammar", daemon=True
            )
            self._proc.start()
            child_end.close()
            late = f"the grammar compiler did not start within {START_TIMEOUT:g} s"
            status, text = self._answer(self._conn, START_TIMEOUT, late)
            if status != "ready":
                self.close()
                raise CompileRefused(text)
        return self._conn

    def _answer(self, conn: Connection, timeout: float, late: str) -> Answer:
        """The child's next answer within ``timeout`` seconds; else, or where the child died,
        it is stopped and ``CompileRefused`` raised (``late`` saying why for a timeout)."""
        if not conn.poll(timeout):
            self.close()
            raise CompileRefused(late)
        try:
            answer: Answer = conn.recv()
        except EOFError:  # the child died: out of memory, most likely
            self.close()
            raise CompileRefused(ENDED) from None
        return answer


def _serve(
    conn: Connection, tokenizer_dir: str, vocab_size: int, stop_ids: list[int], memory_bytes: int
) -> None:
    """The child: read the vocabulary, say so, then compile what comes until the pipe
    closes."""
    from outrider.daemon.grammar.compiler import GrammarRefused, Grammars

    # As the daemon's other children: a signal to the process group is the daemon's to act on
    # (it drains, then closes the pipe).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if memory_bytes:
        resource.setrlimit(resource.RLIMIT_DATA, (memory_bytes, memory_bytes))
    grammars = Grammars(tokenizer_dir, vocab_size, stop_ids)
    try:
        grammars.warm()
    except GrammarRefused as exc:  # no tokenizer: nothing can compile
        conn.send(("refused", str(exc)))
        return
    conn.send(("ready", ""))
    while True:
        try:
            what = conn.recv()
        except EOFError:
            return
        answer: Answer
        try:
            if isinstance(what, ToolUse):
                compiled = grammars.compile_tools(what)
            else:
                compiled = grammars.compile(what)
            answer = ("ok", compiled.serialize_json())
        except GrammarRefused as exc:
            answer = ("refused", str(exc))
        except MemoryError:
            answer = ("refused", "compiling the grammar ran out of --grammar-compile-memory-mb")
        conn.send(answer)
