"""``GrammarQueue``: requests whose grammars compile on a worker thread while the daemon's
loop goes on. A JSON schema compiles in milliseconds, but the first grammar reads the
vocabulary (about a second for 150,000 tokens) and a hostile schema can take far longer:
neither may stall the requests already running.

One worker thread: compiles run one at a time (xgrammar's cache makes a repeated grammar
nearly free), and the compiler is built on that thread alone.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from outrider.daemon.grammar.compiler import NO_TOKENIZER, GrammarRefused, Grammars
from outrider.daemon.grammar.state import GrammarState
from outrider.daemon.internal import TokenizedRequest

Compiled = GrammarState | GrammarRefused


class GrammarQueue:
    def __init__(self, grammars: Grammars | None) -> None:
        """``grammars``: None for a model without a tokenizer (every grammar is refused)."""
        self.grammars = grammars
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._pending: dict[int, tuple[TokenizedRequest, Future[GrammarState]]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, msg: TokenizedRequest) -> None:
        """Compile ``msg``'s grammar (or its tools') and start its state."""
        assert msg.grammar is not None or msg.tools is not None
        grammars = self.grammars
        if grammars is None:
            future: Future[GrammarState] = Future()
            future.set_exception(GrammarRefused(NO_TOKENIZER))
        else:
            future = self._pool.submit(grammars.start, msg)
        self._pending[msg.rid] = (msg, future)

    def ready(self) -> list[tuple[TokenizedRequest, Compiled]]:
        """The requests whose compile ended, each with its state or why it was refused."""
        done = [rid for rid, (_, future) in self._pending.items() if future.done()]
        out: list[tuple[TokenizedRequest, Compiled]] = []
        for rid in done:
            msg, future = self._pending.pop(rid)
            error = future.exception()
            if error is None:
                out.append((msg, future.result()))
            elif isinstance(error, GrammarRefused):
                out.append((msg, error))
            else:  # the compiler itself failed: refused with what it said
                out.append((msg, GrammarRefused(f"grammar: {type(error).__name__}: {error}")))
        return out

    def rids(self) -> list[int]:
        """The requests waiting here."""
        return list(self._pending)

    def cancel(self, rid: int) -> TokenizedRequest | None:
        """Forget the request ``rid`` if it waits here (its compile runs to its end
        unseen); None if it does not."""
        pending = self._pending.pop(rid, None)
        return None if pending is None else pending[0]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.grammars is not None:
            self.grammars.close()
