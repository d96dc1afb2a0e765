"""Grammars compiled in a child process (daemon/grammar/child.py): the same grammars as in
the daemon's process, refusals with the same reasons, a cache for repeats, and a compile
past the time limit, or one that ends its process, refused while the next compile works."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xgrammar as xgr
from grammar_cases import GRAMMARS, VOCAB, grammar_fixtures

from outrider.daemon.grammar.child import ENDED
from outrider.daemon.grammar.compiler import GrammarRefused, Grammars
from outrider.daemon.grammar.state import GrammarState
from outrider.daemon.tokenizer import Tokenizer
from outrider.protocol.messages import Grammar

model_dir, tokenizer, grammars, _drafts = grammar_fixtures()

# Compiles for tens of seconds against the tests' vocabulary (37 s on a busy 2-core host): far
# past any limit these tests set.
SLOW = Grammar(
    "json_schema", json.dumps({"type": "string", "enum": [f"v{i}" for i in range(50_000)]})
)


@pytest.fixture(name="isolated")
def isolated_fixture(model_dir: Path, tokenizer: Tokenizer) -> Iterator[Grammars]:
    assert tokenizer.eos_token_id is not None
    isolated = Grammars(
        str(model_dir),
        VOCAB,
        [tokenizer.eos_token_id],
        compile_timeout=60.0,
        compile_memory_bytes=2048 << 20,
    )
    yield isolated
    isolated.close()


def _masks_along(state: GrammarState, path: list[int]) -> list[torch.Tensor]:
    """``state``'s next mask before each token of ``path`` and after the last."""
    masks = []
    for token in [*path, None]:
        row = xgr.allocate_token_bitmask(1, VOCAB)
        state.fill(row, 0)
        masks.append(row[0])
        if token is not None:
            assert state.advance([token])
    return masks


def test_a_child_compiles_what_this_process_compiles_and_repeats_come_from_the_cache(
    grammars: Grammars, isolated: Grammars, tokenizer: Tokenizer
) -> None:
    """Every kind of grammar: the child's compile gives the masks of this process's along a
    path it accepts; a refusal carries the same reason; a repeat does not reach the child;
    the child outlives SIGINT and SIGTERM."""
    paths = {
        "json_schema": '{"answer": "yes", "digit": 3',
        "regex": "ab",
        "choice": "gr",
        "ebnf": "(x,",
        "lark": "[p;",
    }
    for kind, grammar in GRAMMARS.items():
        path = tokenizer.hf.encode(paths[kind], add_special_tokens=False)
        here = _masks_along(GrammarState(grammars.compile(grammar), grammars.stop_ids), path)
        there = _masks_along(GrammarState(isolated.compile(grammar), isolated.stop_ids), path)
        assert all(torch.equal(a, b) for a, b in zip(here, there, strict=True)), kind
    bad = Grammar("regex", "[0-9")
    with pytest.raises(GrammarRefused) as here_refused:
        grammars.compile(bad)
    with pytest.raises(GrammarRefused) as there_refused:
        isolated.compile(bad)
    assert str(there_refused.value) == str(here_refused.value)
    assert isolated.child is not None
    calls: list[object] = []
    compile_there = isolated.child.compile
    isolated.child.compile = lambda what: calls.append(what) or compile_there(what)  # type: ignore[method-assign]
    isolated.compile(GRAMMARS["regex"])
    assert calls == []
    # A signal to the process group (Ctrl-C, systemd's stop) is the daemon's to act on.
    proc = isolated.child._proc
    assert proc is not None and proc.pid is not None
    os.kill(proc.pid, signal.SIGINT)
    os.kill(proc.pid, signal.SIGTERM)
    isolated.compile(Grammar("regex", "[a-c]+"))
    assert isolated.child._proc is proc and proc.is_alive() and calls


def test_a_compile_past_the_time_limit_is_refused_and_the_next_starts_a_new_child(
    isolated: Grammars,
) -> None:
    """Under a 2 s limit, which a child's start (seconds: imports, the vocabulary's read)
    does not count against: a grammar compiles, one that compiles for a minute is refused
    and its child killed, and the next compiles in a new child."""
    child = isolated.child
    assert child is not None
    child.timeout = 2.0
    isolated.compile(GRAMMARS["choice"])
    first = child._proc
    assert first is not None and first.is_alive()
    with pytest.raises(GrammarRefused) as refused:
        isolated.compile(SLOW)
    assert (
        str(refused.value) == "the grammar did not compile within 2 s (--grammar-compile-timeout)"
    )
    assert not first.is_alive()
    isolated.compile(GRAMMARS["ebnf"])
    assert child._proc is not None and child._proc is not first and child._proc.is_alive()


def test_a_compile_that_ends_its_process_is_refused_and_the_cap_is_set(
    isolated: Grammars,
) -> None:
    """The child killed while it compiles (as the kernel would past its memory): refused,
    naming the memory flag; the child's data segment is capped at the given bytes."""
    child = isolated.child
    assert child is not None
    isolated.compile(GRAMMARS["choice"])
    proc = child._proc
    assert proc is not None and proc.pid is not None
    limits = Path(f"/proc/{proc.pid}/limits").read_text().splitlines()
    data = next(line for line in limits if line.startswith("Max data size"))
    assert data.split()[3:5] == [str(2048 << 20)] * 2, data
    killer = threading.Timer(1.0, os.kill, (proc.pid, signal.SIGKILL))
    killer.start()
    with pytest.raises(GrammarRefused) as refused:
        isolated.compile(SLOW)
    killer.join()
    assert str(refused.value) == ENDED
    isolated.compile(GRAMMARS["lark"])
