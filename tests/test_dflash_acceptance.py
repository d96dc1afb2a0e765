"""DFlash with a distilled draft (``dflash_fixture.distill_dflash``) in process (scheduler +
engine, float32 on CPU): greedy output equals the target alone token for token, the draft is
accepted across page sizes, overlap, prefix-cache hits and chunked prefill, and the engine
counts exactly what the training twin of the draft predicts (its context K/V are materialised
right after every EXTEND and verify, or the counts differ)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from dflash_fixture import BLOCK, dense_block_counts, distill_dflash
from draft_fixtures import random_prompts
from engine_harness import Outcome, engine_for, request, run
from model_fixtures import VOCAB, save_tiny_model

from outrider.daemon.engine.build import Engine
from outrider.daemon.internal import Counters, TokenizedRequest

NEW_TOKENS = 48
MIN_TAU = 1.5
PROMPTS = random_prompts(random.Random(1001), 18, VOCAB)  # the distillation used seed 0


@pytest.fixture(autouse=True)
def _debug_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTRIDER_DEBUG_KV_CHECK", "1")
    monkeypatch.setenv("OUTRIDER_DEBUG_RELAY_CHECK", "1")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The tiny Qwen3 target (tied embeddings) and its distilled DFlash draft."""
    target = tmp_path_factory.mktemp("qwen3")
    with torch.no_grad():
        save_tiny_model("qwen3", target)
    draft = distill_dflash(target, tmp_path_factory.mktemp("dflash"))
    return str(target), str(draft)


def _requests(prompts: list[list[int]], first_rid: int = 0) -> list[TokenizedRequest]:
    return [request(first_rid + i, p, max_new_tokens=NEW_TOKENS) for i, p in enumerate(prompts)]


def _tokens(outcomes: dict[int, Outcome]) -> dict[int, list[int]]:
    return {rid: outcome.token_ids for rid, outcome in outcomes.items()}


def _dflash(dirs: tuple[str, str], **overrides: object) -> Engine:
    target, draft = dirs
    return engine_for(target, speculative_algorithm="dflash", draft_model=draft, **overrides)


def _tau(counters: Counters) -> float:
    assert counters.spec_drafts > 0
    return 1 + counters.spec_accepted_tokens / counters.spec_drafts


@pytest.fixture(scope="module")
def plain(dirs: tuple[str, str]) -> dict[int, list[int]]:
    return _tokens(run(engine_for(dirs[0]), _requests(PROMPTS)))


@pytest.mark.parametrize("page_size", [1, 16])
def test_blocks_are_lossless_and_accepted(
    dirs: tuple[str, str], plain: dict[int, list[int]], page_size: int
) -> None:
    counters = []
    for overlap in (True, False):
        engine = _dflash(dirs, page_size=page_size, no_overlap=not overlap)
        assert engine.loop.runner.width == BLOCK
        assert _tokens(run(engine, _requests(PROMPTS))) == plain
        counters.append(engine.scheduler.counters())
    overlapped, serial = counters
    assert overlapped.spec_drafts == serial.spec_drafts
    assert overlapped.spec_accepted_per_position == serial.spec_accepted_per_position
    # Whole blocks were accepted: every draft and the bonus committed at once.
    assert serial.spec_accepted_per_position[BLOCK - 2] > 0
    assert _tau(serial) >= MIN_TAU, serial.spec_accepted_per_position


def test_engine_drafts_what_the_training_twin_drafts(dirs: tuple[str, str]) -> None:
    engine = _dflash(dirs, no_overlap=True)
    run(engine, _requests(PROMPTS))
    counters = engine.scheduler.counters()
    expected = dense_block_counts(Path(dirs[0]), Path(dirs[1]), PROMPTS, NEW_TOKENS)
    assert (counters.spec_drafts, counters.spec_accepted_per_position) == expected


def test_prefix_hits_and_chunks_are_lossless_and_accepted(dirs: tuple[str, str]) -> None:
    shared = random_prompts(random.Random(1050), 1, VOCAB)[0][:8]
    prompts = [shared + prompt for prompt in PROMPTS]
    reference = _tokens(run(engine_for(dirs[0]), _requests(prompts)))
    expected = dense_block_counts(Path(dirs[0]), Path(dirs[1]), prompts, NEW_TOKENS)
    for overlap in (True, False):
        engine = _dflash(dirs, page_size=4, chunked_prefill_tokens=8, no_overlap=not overlap)
        first = run(engine, _requests(prompts[:1]))
        rest = run(engine, _requests(prompts[1:], first_rid=1))
        assert _tokens(first) | _tokens(rest) == reference
        assert all(o.finish.usage.cached_tokens > 0 for o in rest.values())
        counters = engine.scheduler.counters()
        assert (counters.spec_drafts, counters.spec_accepted_per_position) == expected
        assert _tau(counters) >= MIN_TAU
