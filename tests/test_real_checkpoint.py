"""SmolLM2-135M-Instruct (smollm2_fixture.py), a real chat model nobody here trained, in
float32 on CPU: chat replies equal transformers' greedy ``generate`` token for token, n-gram
speculation on real text is lossless and accepted, and through a real daemon a chat reply ends
at the end-of-turn token, a stop string cuts the text, and the OpenAI API (``openai`` client)
answers the engine's greedy text. Skipped where the package index cannot be reached."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from engine_harness import engine_for, request, run, tau_of, tokens_of
from http_harness import HttpDaemon
from transformers import AutoModelForCausalLM

from outrider.daemon.engine.build import Engine
from outrider.daemon.tokenizer import Tokenizer, load_tokenizer

NEW_TOKENS = 32
QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
    "Explain in two sentences what a compiler does.",
)
PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the "
    "wick, polished the great lens, and watched the ships pass along the rocky coast until the "
    "sun rose again over the grey water."
)
# Measured: tau 7.0 (6 drafts of 7 tokens, 36 accepted) on the repeat request below; the floor
# leaves room for a draft or two more.
MIN_NGRAM_TAU = 6.0
MODEL_NAME = "smollm2"


def _chat(tokenizer: Tokenizer, content: str) -> list[int]:
    """A one-message chat rendered as the front door renders ``messages=``."""
    return tokenizer.apply_chat_template([{"role": "user", "content": content}])


def _greedy(engine: Engine, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy reply, ending at the checkpoint's EOS (kept) or ``new_tokens``."""
    requests = [
        request(rid, prompt, max_new_tokens=new_tokens, ignore_eos=False)
        for rid, prompt in enumerate(prompts)
    ]
    replies = tokens_of(run(engine, requests))
    return [replies[rid] for rid in range(len(prompts))]


def _text(tokenizer: Tokenizer, token_ids: Sequence[int]) -> str:
    return tokenizer.backend.decode(list(token_ids), skip_special_tokens=True)


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_dir: Path) -> Tokenizer:
    tokenizer = load_tokenizer(smollm2_dir)
    assert tokenizer is not None
    return tokenizer


@pytest.fixture(scope="module")
def greedy_engine(smollm2_dir: Path) -> Engine:
    return engine_for(str(smollm2_dir), speculative_algorithm="none")


def test_chat_replies_equal_transformers_greedy(
    smollm2_dir: Path, smol_tokenizer: Tokenizer, greedy_engine: Engine
) -> None:
    prompts = [_chat(smol_tokenizer, question) for question in QUESTIONS]
    replies = _greedy(greedy_engine, prompts, NEW_TOKENS)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False
            )  # stops after the generation config's EOS (<|im_end|>), which it keeps
            expected.append(out[0, len(prompt) :].tolist())
    assert replies == expected, [_text(smol_tokenizer, reply) for reply in replies]
    assert any(reply[-1] == smol_tokenizer.eos_token_id for reply in replies)


def test_ngram_speculation_on_a_repeated_paragraph(
    smollm2_dir: Path, smol_tokenizer: Tokenizer, greedy_engine: Engine
) -> None:
    prompt = _chat(smol_tokenizer, f"Repeat this paragraph word for word:\n\n{PARAGRAPH}")
    engine = engine_for(str(smollm2_dir), speculative_algorithm="ngram")
    speculated = _greedy(engine, [prompt], 64)
    assert speculated == _greedy(greedy_engine, [prompt], 64)
    counters = engine.scheduler.counters()
    assert tau_of(counters) >= MIN_NGRAM_TAU, counters.spec_accepted_per_position


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    http = HttpDaemon(
        tmp_path_factory.mktemp("smollm2"), "--served-model-name", MODEL_NAME,
        "--kv-cache-tokens", "4096", model=smollm2_dir,
    )  # fmt: skip
    try:
        yield http
        assert http.daemon.stop() == 0, http.daemon.log()
    finally:
        http.daemon.kill_all()


def test_a_chat_reply_ends_at_the_end_of_turn(
    server: HttpDaemon, smol_tokenizer: Tokenizer, greedy_engine: Engine
) -> None:
    question = QUESTIONS[0]
    [reply] = _greedy(greedy_engine, [_chat(smol_tokenizer, question)], 64)
    assert reply[-1] == smol_tokenizer.eos_token_id, _text(smol_tokenizer, reply)
    answer = server.openai().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": question}],
        max_completion_tokens=64, temperature=0,
    )  # fmt: skip
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == _text(smol_tokenizer, reply)
    assert answer.usage is not None and answer.usage.completion_tokens == len(reply)


def test_a_stop_string_cuts_the_text_where_it_occurs(
    server: HttpDaemon, smol_tokenizer: Tokenizer, greedy_engine: Engine
) -> None:
    question = QUESTIONS[3]
    [reply] = _greedy(greedy_engine, [_chat(smol_tokenizer, question)], NEW_TOKENS)
    text = _text(smol_tokenizer, reply)
    stop = text.split()[4]
    answer = server.openai().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": question}],
        max_completion_tokens=NEW_TOKENS, temperature=0, stop=[stop],
    )  # fmt: skip
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == text[: text.index(stop)]


def test_completions_equal_the_engine_greedy_text(
    server: HttpDaemon, smol_tokenizer: Tokenizer, greedy_engine: Engine
) -> None:
    prompt = "The three primary colors are"
    [reply] = _greedy(greedy_engine, [smol_tokenizer.encode_prompt(prompt)], NEW_TOKENS)
    answer = server.openai().completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0
    )
    assert answer.choices[0].text == _text(smol_tokenizer, reply)
