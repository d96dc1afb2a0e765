"""In-process matrix: scheduler + engine against Hugging Face transformers' greedy generate."""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import CUDA
from engine_harness import debug_checks_fixture, engine_for, request, requests_for, run
from model_fixtures import VOCAB, hf_greedy, save_tiny_model

from outrider.daemon.config import ConfigError
from outrider.daemon.engine.plan import StepPlan
from outrider.daemon.engine.runner import Launched
from outrider.daemon.engine.token_masks import GrammarRows
from outrider.daemon.flags import resolve

NEW_TOKENS = 10


# The relay check syncs; the CUDA tests run the sync check instead.
debug_checks = debug_checks_fixture(relay_check=not CUDA)


def _prompts(seed: int, count: int, low: int, high: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(low, high))] for _ in range(count)]


class Reference:
    def __init__(self, directory: Path, model: torch.nn.Module) -> None:
        self.directory = str(directory)
        self.prompts = _prompts(1, 6, 5, 40)
        # Shared 40-token prefix for prefix-cache hits.
        shared = _prompts(2, 1, 40, 40)[0]
        self.prefixed = [shared + tail for tail in _prompts(3, 4, 3, 9)]
        self.expected = hf_greedy(model, self.prompts, NEW_TOKENS)
        self.expected_prefixed = hf_greedy(model, self.prefixed, NEW_TOKENS)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def reference(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Reference:
    directory = tmp_path_factory.mktemp(request.param)
    with torch.no_grad():
        model = save_tiny_model(request.param, directory, max_shard_size="100KB")
        return Reference(directory, model)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_greedy_matches_transformers(reference: Reference, page_size: int, overlap: bool) -> None:
    engine = engine_for(reference.directory, page_size=page_size, no_overlap=not overlap)
    reqs = requests_for(reference.prompts, max_new_tokens=NEW_TOKENS)
    outcomes = run(engine, reqs)
    for i, expected in enumerate(reference.expected):
        assert outcomes[i].token_ids == expected, f"prompt {i}"
        assert outcomes[i].finish.reason == "length"
        assert outcomes[i].finish.usage.completion_tokens == NEW_TOKENS

    # Prefix hits: the first prefixed request publishes the shared pages, the rest reuse them.
    first = run(engine, [request(100, reference.prefixed[0], max_new_tokens=NEW_TOKENS)])
    assert first[100].token_ids == reference.expected_prefixed[0]
    rest = requests_for(reference.prefixed[1:], max_new_tokens=NEW_TOKENS, first_rid=101)
    outcomes = run(engine, rest)
    for i, expected in enumerate(reference.expected_prefixed[1:]):
        outcome = outcomes[101 + i]
        assert outcome.token_ids == expected
        assert outcome.finish.usage.cached_tokens == 40 // page_size * page_size
    counters = engine.scheduler.counters()
    assert counters.prefix_cache_hits >= len(rest)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_chunked_prefill_and_staggered_arrivals(reference: Reference, overlap: bool) -> None:
    engine = engine_for(
        reference.directory, page_size=4, chunked_prefill_tokens=8, no_overlap=not overlap
    )
    reqs = requests_for(reference.prompts, max_new_tokens=NEW_TOKENS)
    outcomes = run(engine, reqs, stagger=3)
    for i, expected in enumerate(reference.expected):
        assert outcomes[i].token_ids == expected, f"prompt {i}"


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_retraction(reference: Reference, overlap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTRIDER_DEBUG_RETRACT_EVERY", "3")
    # A pool of 160 tokens cannot hold six growing requests at once: real retraction too.
    engine = engine_for(
        reference.directory,
        page_size=4,
        kv_cache_tokens=160,
        context_length=64,
        no_overlap=not overlap,
    )
    reqs = requests_for(reference.prompts, max_new_tokens=NEW_TOKENS)
    outcomes = run(engine, reqs)
    for i, expected in enumerate(reference.expected):
        assert outcomes[i].token_ids == expected, f"prompt {i}"


def test_eos_and_stop_tokens_end_requests(reference: Reference) -> None:
    engine = engine_for(reference.directory)
    prompt, expected = reference.prompts[0], reference.expected[0]
    stop_at = expected[3]
    outcomes = run(
        engine,
        [
            request(0, prompt, stop_token_ids=[stop_at]),
            request(1, prompt, max_new_tokens=4),
            request(2, prompt, max_new_tokens=1),
        ],
    )
    cut = expected.index(stop_at) + 1
    assert outcomes[0].token_ids == expected[:cut]
    assert outcomes[0].finish.reason == "stop"
    assert outcomes[0].finish.matched_stop == stop_at
    assert outcomes[1].token_ids == expected[:4]
    assert outcomes[1].finish.reason == "length"
    assert outcomes[2].token_ids == expected[:1]


def test_seeded_sampling_is_reproducible_across_batches(reference: Reference) -> None:
    engine = engine_for(reference.directory)
    prompts = reference.prompts
    alone = run(
        engine,
        [request(0, prompts[0], temperature=0.8, seed=7, top_k=50, max_new_tokens=NEW_TOKENS)],
    )
    crowd = run(
        engine,
        [request(0, prompts[0], temperature=0.8, seed=7, top_k=50, max_new_tokens=NEW_TOKENS)]
        + [request(i, p, temperature=1.0, seed=i) for i, p in enumerate(prompts[1:], start=1)],
    )
    assert alone[0].token_ids == crowd[0].token_ids
    assert len(alone[0].token_ids) == NEW_TOKENS


def test_logprobs_and_streaming(reference: Reference) -> None:
    engine = engine_for(reference.directory)
    outcomes = run(
        engine,
        [request(0, reference.prompts[1], logprobs=3, stream=True, max_new_tokens=NEW_TOKENS)],
    )
    outcome = outcomes[0]
    assert outcome.token_ids == reference.expected[1]
    assert len(outcome.updates) == NEW_TOKENS  # one streamed update per step, the last final
    logprobs = [lp for u in outcome.updates for lp in (u.logprobs or [])]
    assert [lp.token_id for lp in logprobs] == reference.expected[1]
    for lp in logprobs:
        assert len(lp.top) == 3
        # Greedy: the chosen token is the most likely one.
        assert lp.top[0][0] == lp.token_id
        assert lp.top[0][1] == pytest.approx(lp.logprob)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_greedy_matches_transformers(
    reference: Reference, page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32 on CUDA with overlap, any host sync inside a step raising."""
    monkeypatch.setenv("OUTRIDER_DEBUG_SYNC_CHECK", "1")
    engine = engine_for(reference.directory, page_size=page_size, device="cuda", dtype="float32")
    reqs = requests_for(reference.prompts, max_new_tokens=NEW_TOKENS)
    reqs += [
        request(100 + i, p, max_new_tokens=NEW_TOKENS, temperature=0.9, top_k=20, top_p=0.9)
        for i, p in enumerate(reference.prompts)
    ]
    outcomes = run(engine, reqs)
    for i, expected in enumerate(reference.expected):
        assert outcomes[i].token_ids == expected, f"prompt {i}"
        assert len(outcomes[100 + i].token_ids) == NEW_TOKENS


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_failed_step_ends_its_batch_with_internal(reference: Reference, overlap: bool) -> None:
    engine = engine_for(reference.directory, no_overlap=not overlap)
    runner = engine.loop.runner
    launch = runner.launch
    calls = 0

    def failing_launch(
        plan: StepPlan,
        grammar: GrammarRows | None = None,
        settle: Callable[[], None] | None = None,
    ) -> Launched:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected failure")
        return launch(plan, grammar, settle)

    runner.launch = failing_launch  # type: ignore[method-assign]  # fault injection
    prompts = reference.prompts
    first = run(engine, requests_for(prompts, max_new_tokens=NEW_TOKENS))
    # Launch 1 is the EXTEND of all six, launch 2 their first decode batch, launch 3 fails.
    for outcome in first.values():
        error = outcome.final.error
        assert error is not None and error.code == "internal"
        assert "injected failure" in error.message
    # The daemon goes on: later requests are served, and every page came back.
    again = run(engine, [request(10, prompts[0], max_new_tokens=NEW_TOKENS)])
    assert again[10].token_ids == reference.expected[0]
    assert engine.scheduler.counters().kv_used_tokens == 0


def test_attention_options_are_validated(reference: Reference) -> None:
    with pytest.raises(ConfigError, match=r"--attention-config torch: Object contains unknown"):
        engine_for(reference.directory, attention_config=('torch={"nope": 1}',))
    args = argparse.Namespace(model=reference.directory, attention_config=["torch"])
    with pytest.raises(ConfigError, match=r"--attention-config 'torch': expected NAME="):
        resolve(args, environ={})
