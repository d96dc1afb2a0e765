"""``Grammars``: one model's grammar compiler. Loaded on the first constrained request (the
tokenizer's vocabulary is read then: about a second for 150,000 tokens); every compile after
that goes through xgrammar's cache, keyed by the grammar's content. With a compile timeout
(the daemon's) the compiles run in a child process within its time and memory limits
(child.py), and the last ``CACHED_GRAMMARS`` compiled come from a cache of their own."""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from functools import cached_property
from typing import Any, Literal

import msgspec
import numpy as np
import xgrammar as xgr

from outrider.daemon.grammar import channels
from outrider.daemon.grammar.child import CompileChild, CompileRefused
from outrider.daemon.grammar.schemas import strict_json
from outrider.daemon.grammar.state import GrammarState
from outrider.daemon.grammar.tool_calls import HARMONY, function_schema
from outrider.daemon.internal import FinalMessage, TokenizedRequest, ToolUse
from outrider.daemon.tokenizer import load_tokenizer
from outrider.protocol.messages import Grammar

_SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")
NO_TOKENIZER = "a grammar needs the model's tokenizer and this model has none"
CACHED_GRAMMARS = 64  # grammars compiled by a child, kept for requests that repeat them


class GrammarRefused(ValueError):
    """The grammar cannot be compiled; the message says why (xgrammar's own words)."""


def _refused(what: str, exc: Exception) -> GrammarRefused:
    """xgrammar's ``exc`` as a refusal of ``what``, without the time and source location
    xgrammar puts before its message."""
    return GrammarRefused(f"{what}: {_SOURCE_PREFIX.sub('', str(exc)).strip()}")


class Grammars:
    def __init__(
        self,
        tokenizer_dir: str,
        vocab_size: int,
        stop_ids: Sequence[int],
        mask_limit_ms: float = 0.0,
        compile_timeout: float = 0.0,
        compile_memory_bytes: int = 0,
    ) -> None:
        """``vocab_size``: the model's (the width of its logits, which the masks cover);
        ``stop_ids``: the model's end-of-sequence ids; ``mask_limit_ms``: the time a mask
        of a state started here may take (``GrammarState.too_costly``; 0: no limit);
        ``compile_timeout``: the seconds a compile may take in a child process of its own
        whose data segment is capped at ``compile_memory_bytes`` (0: no cap); 0 s: compiles
        run in this process, without limits."""
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        self.mask_limit_ms = mask_limit_ms
        self.child = (
            CompileChild(tokenizer_dir, vocab_size, stop_ids, compile_timeout, compile_memory_bytes)
            if compile_timeout
            else None
        )
        self._cache: OrderedDict[bytes, xgr.CompiledGrammar] = OrderedDict()

    @cached_property
    def _info(self) -> xgr.TokenizerInfo:
        tokenizer = load_tokenizer(self.tokenizer_dir)
        if tokenizer is None:
            raise GrammarRefused(NO_TOKENIZER)
        return xgr.TokenizerInfo.from_huggingface(
            tokenizer.hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids
        )

    @cached_property
    def _compiler(self) -> xgr.GrammarCompiler:
        return xgr.GrammarCompiler(self._info, max_threads=1)

    @cached_property
    def _harmony_ids(self) -> dict[str, int]:
        """The ids of the harmony format's special tokens (channels.py) in this vocabulary;
        raises ``GrammarRefused`` where one is missing."""
        wanted = {text.encode(): text for text in channels.SPECIALS}
        ids = {
            wanted[piece]: token
            for token, piece in enumerate(self._info.decoded_vocab)
            if piece in wanted
        }
        missing = [text for text in channels.SPECIALS if text not in ids]
        if missing:
            raise GrammarRefused(f"the model's vocabulary has no {', '.join(missing)}")
        return ids

    def compile(self, what: Grammar | FinalMessage) -> xgr.CompiledGrammar:
        """``what`` compiled: a grammar, or one held to the final message of an output in the
        harmony format (channels.py); raises ``GrammarRefused``."""
        if self.child is not None:
            return self._from_child(what)
        grammar = what.grammar if isinstance(what, FinalMessage) else what
        try:
            text = _ebnf(grammar)
            if isinstance(what, FinalMessage):
                tag = channels.final_tag(self._harmony_ids, text)
                text = str(xgr.Grammar.from_structural_tag(tag))
            return self._compiler.compile_grammar(text)
        except (RuntimeError, ValueError) as exc:
            raise _refused(f"grammar ({grammar.kind})", exc) from None

    def compile_tools(self, use: ToolUse) -> xgr.CompiledGrammar:
        """The grammar of ``use``'s calls: xgrammar's structural tag for the model's format,
        which lets text through until a call begins and holds each call to its tool's
        schema; raises ``GrammarRefused``."""
        if self.child is not None:
            return self._from_child(use)
        try:
            tag = self._tools_tag(use)
            return self._compiler.compile_grammar(strict_json(xgr.Grammar.from_structural_tag(tag)))
        except (RuntimeError, ValueError) as exc:
            raise _refused("tools", exc) from None

    def _tools_tag(self, use: ToolUse) -> xgr.StructuralTag:
        """The structural tag of ``use``'s calls: the harmony stream's (channels.py), else
        xgrammar's for the model's format."""
        if use.format == HARMONY:
            return channels.calls_tag(self._harmony_ids, use, max_whitespace_cnt=1)
        choice: Literal["auto", "required"] | dict[str, Any] = use.choice
        if use.name is not None:
            choice = {"type": "function", "function": {"name": use.name}}
        return xgr.get_model_structural_tag(
            use.format,
            tools=[function_schema(tool) for tool in use.tools],
            tool_choice=choice,
            reasoning="disabled",
            parallel_tool_calls=use.parallel,
            # As JSON schemas compile (``compile``): no whitespace runs to wander into.
            max_whitespace_cnt=1,
        )

    def warm(self) -> None:
        """Read the vocabulary now (the first compile does otherwise); raises
        ``GrammarRefused`` for a model without a tokenizer."""
        _ = self._compiler  # a cached property: building it reads the vocabulary

    def close(self) -> None:
        """Stop the compiling child, if any."""
        if self.child is not None:
            self.child.close()

    def _from_child(self, what: Grammar | FinalMessage | ToolUse) -> xgr.CompiledGrammar:
        """``what`` compiled by the child (or taken from the cache), read against this
        process's vocabulary; raises ``GrammarRefused``."""
        assert self.child is not None
        key = type(what).__name__.encode() + msgspec.msgpack.encode(what)
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            return compiled
        try:
            text = self.child.compile(what)
        except CompileRefused as exc:
            raise GrammarRefused(str(exc)) from None
        compiled = xgr.CompiledGrammar.deserialize_json(text, self._info)
        self._cache[key] = compiled
        if len(self._cache) > CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return compiled

    def start(self, msg: TokenizedRequest) -> GrammarState:
        """``msg``'s state at the start of its output (its grammar's, or its tools'); the
        request's own stop token ids end it where the grammar may end, as the model's end
        of sequence does."""
        stops = sorted({*self.stop_ids, *msg.stop_token_ids})
        if msg.grammar is not None:
            compiled = self.compile(FinalMessage(msg.grammar) if msg.harmony else msg.grammar)
        else:
            assert msg.tools is not None
            compiled = self.compile_tools(msg.tools)
        return GrammarState(compiled, stops, self.text_exits, self.mask_limit_ms)

    @cached_property
    def text_exits(self) -> np.ndarray:
        """Per token id (``vocab_size`` of them), whether its text may leave free text: it
        holds a quotation mark or a backslash (how a JSON string ends or an escape begins),
        or it has none (ids past the tokenizer's, special tokens)."""
        exits = np.ones(self.vocab_size, dtype=bool)
        for token, text in enumerate(self._info.decoded_vocab[: self.vocab_size]):
            exits[token] = not text or b'"' in text or b"\\" in text
        return exits


def _ebnf(grammar: Grammar) -> str:
    """``grammar`` as xgrammar's EBNF (a JSON schema's strings strict JSON: schemas.py);
    raises ``RuntimeError`` or ``ValueError`` where it is not one."""
    if grammar.kind == "json_schema":
        # Compact JSON: no whitespace runs for a model to wander into.
        return strict_json(xgr.Grammar.from_json_schema(grammar.text, any_whitespace=False))
    if grammar.kind == "json_object":
        return str(xgr.Grammar.builtin_json_grammar())
    if grammar.kind == "regex":
        return str(xgr.Grammar.from_regex(grammar.text))
    if grammar.kind == "choice":
        return "root ::= " + " | ".join(json.dumps(choice) for choice in grammar.choices)
    if grammar.kind == "lark":
        return str(xgr.Grammar.from_lark(grammar.text))
    return grammar.text
