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
from engine_harness import debug_checks_fixture, engine_for, requests_for, run, tau_of, tokens_of
from model_fixtures import VOCAB, save_tiny_model

from outrider.daemon.engine.build import Engine

NEW_TOKENS = 48
MIN_TAU = 1.5
PROMPTS = random_prompts(random.Random(1001), 18, VOCAB)  # the distillation used seed 0


debug_checks = debug_checks_fixture()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The tiny Qwen3 target (tied embeddings) and its distilled DFlash draft."""
    target = tmp_path_factory.mktemp("qwen3")
    with torch.no_grad():
        save_tiny_model("qwen3", target)
    draft = distill_dflash(target, tmp_path_factory.mktemp("dflash"))
    return str(target), str(draft)


def _dflash(dirs: tuple[str, str], **overrides: object) -> Engine:
    target, draft = dirs
    return engine_for(target, speculative_algorithm="dflash", draft_model=draft, **overrides)


@pytest.fixture(scope="module")
def plain(dirs: tuple[str, str]) -> dict[int, list[int]]:
    return tokens_of(run(engine_for(dirs[0]), requests_for(PROMPTS, max_new_tokens=NEW_TOKENS)))


@pytest.mark.parametrize("page_size", [1, 16])
def test_blocks_are_lossless_and_accepted(
    dirs: tuple[str, str], plain: dict[int, list[int]], page_size: int
) -> None:
    counters = []
    for overlap in (True, False):
        engine = _dflash(dirs, page_size=page_size, no_overlap=not overlap)
        assert engine.loop.runner.shape.width == BLOCK
        assert tokens_of(run(engine, requests_for(PROMPTS, max_new_tokens=NEW_TOKENS))) == plain
        counters.append(engine.scheduler.counters())
    overlapped, serial = counters
    assert overlapped.spec_drafts == serial.spec_drafts
    assert overlapped.spec_accepted_per_position == serial.spec_accepted_per_position
    # Whole blocks were accepted: every draft and the bonus committed at once.
    assert serial.spec_accepted_per_position[BLOCK - 2] > 0
    assert tau_of(serial) >= MIN_TAU, serial.spec_accepted_per_position


def test_engine_drafts_what_the_training_twin_drafts(dirs: tuple[str, str]) -> None:
    engine = _dflash(dirs, no_overlap=True)
    run(engine, requests_for(PROMPTS, max_new_tokens=NEW_TOKENS))
    counters = engine.scheduler.counters()
    expected = dense_block_counts(Path(dirs[0]), Path(dirs[1]), PROMPTS, NEW_TOKENS)
    assert (counters.spec_drafts, counters.spec_accepted_per_position) == expected


def test_prefix_hits_and_chunks_are_lossless_and_accepted(dirs: tuple[str, str]) -> None:
    shared = random_prompts(random.Random(1050), 1, VOCAB)[0][:8]
    prompts = [shared + prompt for prompt in PROMPTS]
    reference = tokens_of(
        run(engine_for(dirs[0]), requests_for(prompts, max_new_tokens=NEW_TOKENS))
    )
    expected = dense_block_counts(Path(dirs[0]), Path(dirs[1]), prompts, NEW_TOKENS)
    for overlap in (True, False):
        engine = _dflash(dirs, page_size=4, chunked_prefill_tokens=8, no_overlap=not overlap)
        first = run(engine, requests_for(prompts[:1], max_new_tokens=NEW_TOKENS))
        rest = run(engine, requests_for(prompts[1:], max_new_tokens=NEW_TOKENS, first_rid=1))
        assert tokens_of(first) | tokens_of(rest) == reference
        assert all(o.finish.usage.cached_tokens > 0 for o in rest.values())
        counters = engine.scheduler.counters()
        assert (counters.spec_drafts, counters.spec_accepted_per_position) == expected
        assert tau_of(counters) >= MIN_TAU
