"""The end-to-end tests' requests and what the in-process engine says they produce.

``Reference`` is the engine (tests/engine_harness.py) on the model directory the daemon
serves, with the daemon's page size and context length; ``check_result`` compares what a
client got from the daemon with it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import pytest
from engine_harness import engine_for
from engine_harness import request as engine_request
from engine_harness import run as engine_run

from outrider.daemon.tokenizer import Tokenizer, load_tokenizer
from outrider.protocol import GenerateResult, TokenLogprob

PAGE_SIZE = 4
VOCAB = 300  # the tiny model's; its tokenizer knows 320 ids
Source = Literal["prompt", "input_ids", "messages"]


@dataclass(frozen=True)
class Spec:
    """One request as a client sends it."""

    source: Source
    value: Any
    max_new_tokens: int | None = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0

    def kwargs(self) -> dict[str, Any]:
        return {
            self.source: self.value,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": list(self.stop),
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "logprobs": self.logprobs,
        }


@dataclass(frozen=True)
class Expected:
    input_ids: list[int]
    output_ids: list[int]
    text: str
    reason: str
    matched_stop: str | int | None
    logprobs: list[TokenLogprob] | None


class Reference:
    """The in-process engine on the same model directory, page size and context length."""

    def __init__(self, model: Path, context_length: int) -> None:
        tokenizer = load_tokenizer(model)
        assert tokenizer is not None
        self.tokenizer: Tokenizer = tokenizer
        self.engine = engine_for(str(model), page_size=PAGE_SIZE, context_length=context_length)
        self._next_rid = 0

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decoder().extend(ids)

    def input_ids(self, spec: Spec) -> list[int]:
        if spec.source == "prompt":
            return self.tokenizer.encode_prompt(spec.value)
        if spec.source == "messages":
            return self.tokenizer.apply_chat_template(spec.value)
        return list(spec.value)

    def expect(self, specs: list[Spec]) -> list[Expected]:
        rids = list(range(self._next_rid, self._next_rid + len(specs)))
        self._next_rid += len(specs)
        requests = [
            engine_request(
                rid,
                self.input_ids(spec),
                max_new_tokens=spec.max_new_tokens,
                temperature=spec.temperature,
                seed=spec.seed or 0,
                top_k=spec.top_k,
                top_p=spec.top_p,
                logprobs=spec.logprobs,
                ignore_eos=spec.ignore_eos,
                stop=spec.stop,
                stop_token_ids=spec.stop_token_ids,
            )
            for rid, spec in zip(rids, specs, strict=True)
        ]
        outcomes = engine_run(self.engine, requests)
        expected = []
        for rid, req in zip(rids, requests, strict=True):
            outcome = outcomes[rid]
            finish = outcome.finish
            text = self.decode(outcome.token_ids)
            if finish.text_cut is not None:
                text = text[: finish.text_cut]
            logprobs = [lp for u in outcome.updates for lp in u.logprobs or []]
            expected.append(
                Expected(
                    input_ids=req.input_ids,
                    output_ids=outcome.token_ids,
                    text=text,
                    reason=finish.reason,
                    matched_stop=finish.matched_stop,
                    logprobs=logprobs if req.want_logprobs else None,
                )
            )
        return expected


def _random_ids(rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(rng.randint(low, high))]


def _stop_string_for(text: str, width: int = 2) -> str:
    """A ``width``-character piece of ``text`` to use as a stop string: the first that does
    not occur earlier, past the start (so that the cut leaves some text), preferring
    printable ASCII over the replacement characters a random model's bytes decode to."""
    fresh = [
        text[i : i + width]
        for i in range(1, len(text) - width + 1)
        if text.find(text[i : i + width]) == i
    ]
    readable = [piece for piece in fresh if piece.isascii() and piece.isprintable()]
    return (readable or fresh or [text[:width]])[0]


@dataclass
class Workload:
    """The concurrency test's requests (each sent twice) and the bad-input test's background."""

    cases: list[Spec]
    expected: list[Expected]
    background: list[Spec]
    background_expected: list[Expected]


def build_workload(ref: Reference) -> Workload:
    rng = random.Random(20260101)
    cases: list[Spec] = []
    for i in range(16):  # greedy token-id prompts, some with logprobs, half stopping at EOS
        cases.append(
            Spec(
                "input_ids",
                _random_ids(rng, 3, 40),
                max_new_tokens=rng.randint(4, 20),
                ignore_eos=i % 2 == 0,
                logprobs=2 if i % 4 == 1 else 0,
            )
        )
    for i in range(8):  # seeded sampling
        cases.append(
            Spec(
                "input_ids",
                _random_ids(rng, 3, 30),
                max_new_tokens=12,
                temperature=0.9,
                top_k=(0, 40)[i % 2],
                top_p=(1.0, 0.9)[i // 2 % 2],
                seed=1000 + i,
                ignore_eos=True,
                logprobs=3 if i == 5 else 0,
            )
        )
    # Prompts and chat messages whose tokens all lie inside the model's 300 ids.
    prompts = ["hello", "hello world", "the dog", "lazy dog", "front door tests", "unicode"]
    chats = [
        [{"role": "user", "content": "hello dog"}],
        [{"role": "system", "content": "unicode"}, {"role": "user", "content": "the dog"}],
        [{"role": "user", "content": "fox"}],
        [{"role": "user", "content": "world, the"}, {"role": "assistant", "content": "tiny"}],
        [{"role": "user", "content": "lazy dog"}, {"role": "user", "content": "hello"}],
        [{"role": "system", "content": "fox"}, {"role": "user", "content": "hello world"}],
    ]
    texts = [Spec("prompt", p, max_new_tokens=24, ignore_eos=True) for p in prompts]
    chat_specs = [Spec("messages", m, max_new_tokens=20, ignore_eos=True) for m in chats]
    free = ref.expect(texts + chat_specs)
    for spec, got in zip(texts + chat_specs, free, strict=True):
        assert max(got.input_ids) < VOCAB, spec
    for i, (spec, got) in enumerate(zip(texts, free[: len(texts)], strict=True)):
        stop = _stop_string_for(got.text)
        assert stop in got.text and "zq" not in got.text
        # Every other one also names a stop string that never matches.
        stops = ("zq", stop) if i % 2 else (stop,)
        cases.append(replace(spec, stop=stops, logprobs=2 if i == 0 else 0))
    for i, (spec, got) in enumerate(zip(chat_specs, free[len(texts) :], strict=True)):
        stop_id = got.output_ids[2]
        cases.append(replace(spec, stop_token_ids=(stop_id, 299), logprobs=1 if i == 0 else 0))
    # Seeded sampling that ends at EOS: the first of a few seeds whose output meets one.
    probes = [
        Spec("input_ids", [7, 8, 9], max_new_tokens=40, temperature=5.0, seed=seed)
        for seed in range(48)
    ]
    cases += [
        spec for spec, got in zip(probes, ref.expect(probes), strict=True) if got.reason == "stop"
    ][:1]
    background = [
        Spec("input_ids", _random_ids(rng, 5, 30), max_new_tokens=100, ignore_eos=True)
        for _ in range(12)
    ]
    expected = ref.expect(cases + background)
    return Workload(cases, expected[: len(cases)], background, expected[len(cases) :])


def check_result(
    result: GenerateResult,
    spec: Spec,
    expected: Expected,
    request_id: str,
    decode: Callable[[list[int]], str],
) -> None:
    where = f"{request_id}: {spec}"
    assert result.request_id == request_id
    assert result.output_ids == expected.output_ids, where
    assert result.text == expected.text, where
    assert result.finish_reason == expected.reason, where
    assert result.matched_stop == expected.matched_stop, where
    assert result.usage.prompt_tokens == len(expected.input_ids)
    assert result.usage.completion_tokens == len(expected.output_ids)
    assert result.usage.cached_tokens % PAGE_SIZE == 0
    assert result.usage.cached_tokens < result.usage.prompt_tokens
    if spec.logprobs:
        assert result.logprobs is not None and expected.logprobs is not None
        assert [lp.token_id for lp in result.logprobs] == result.output_ids
        for got, want in zip(result.logprobs, expected.logprobs, strict=True):
            assert len(got.top) == spec.logprobs
            assert [t for t, _ in got.top] == [t for t, _ in want.top]
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            if spec.temperature == 0:
                assert got.top[0] == (got.token_id, got.logprob)
    else:
        assert result.logprobs is None
    if expected.reason == "stop" and isinstance(expected.matched_stop, str):
        stop = expected.matched_stop
        assert stop in spec.stop
        assert stop not in result.text
        full = decode(result.output_ids)
        assert full.find(stop) == len(result.text), "the text is cut right before the match"
        assert stop not in decode(result.output_ids[:-1]), "ids end at the match"
    elif expected.reason == "stop":
        assert result.output_ids[-1] == expected.matched_stop
        assert result.output_ids.count(expected.matched_stop) == 1
