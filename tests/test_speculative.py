"""Speculative decoding in process (scheduler + engine, float32 on CPU): every algorithm's
output equals the target-only output token for token, greedy and seeded sampled."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from engine_harness import debug_checks_fixture, engine_for, request, requests_for, run, tokens_of
from model_fixtures import VOCAB, save_random_dflash, save_tiny_model
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from outrider.daemon.cli.plugins import run_serve_check
from outrider.daemon.config import EXIT_CONFIG, ConfigError
from outrider.daemon.engine.accept import accept_chain
from outrider.daemon.engine.build import Engine
from outrider.plugins.speculative.dflash_impl import DFlashWorker

NEW_TOKENS = 40
WIDTH = 6


debug_checks = debug_checks_fixture()


def _prompts(seed: int, count: int) -> list[list[int]]:
    """Half random, half repeating a short random phrase (text n-gram drafting can follow)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        if i % 2:
            phrase = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 6))]
            prompts.append(phrase * rng.randint(3, 6))
        else:
            prompts.append([rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 40))])
    return prompts


@pytest.fixture(scope="module")
def plain(llama_dir: str) -> dict[int, list[int]]:
    """The target-only greedy outputs of the 18 prompts."""
    engine = engine_for(llama_dir)
    return tokens_of(run(engine, requests_for(_prompts(1, 18), max_new_tokens=NEW_TOKENS)))


def _ngram(llama_dir: str, **overrides: object) -> Engine:
    settings: dict[str, object] = {
        "speculative_algorithm": "ngram",
        "speculative_num_draft_tokens": WIDTH,
    }
    settings.update(overrides)
    return engine_for(llama_dir, **settings)


def test_accept_chain_counts_leading_matches() -> None:
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 7], [5, 6, 7]])
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 0, 8]])
    assert accept_chain(drafts, target).tolist() == [4, 2, 1, 3]
    # Without drafts every row commits one token.
    assert accept_chain(drafts[:, :0], target[:, :1]).tolist() == [1, 1, 1, 1]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_ngram_greedy_equals_target_only(
    llama_dir: str, plain: dict[int, list[int]], page_size: int, overlap: bool
) -> None:
    engine = _ngram(llama_dir, page_size=page_size, no_overlap=not overlap)
    outcomes = run(engine, requests_for(_prompts(1, 18), max_new_tokens=NEW_TOKENS))
    assert tokens_of(outcomes) == plain
    counters = engine.scheduler.counters()
    drafts = sum(o.finish.usage.spec_drafts for o in outcomes.values())
    accepted = sum(o.finish.usage.spec_accepted_tokens for o in outcomes.values())
    assert (counters.spec_drafts, counters.spec_accepted_tokens) == (drafts, accepted)
    assert counters.spec_draft_tokens == drafts * (WIDTH - 1)
    per_position = counters.spec_accepted_per_position
    assert len(per_position) == WIDTH - 1 and sum(per_position) == accepted
    assert per_position == sorted(per_position, reverse=True)
    # Every output token but the first (from prefill) came out of a verify step; the last
    # step may accept past max_new_tokens (counted before the finish truncation).
    for outcome in outcomes.values():
        usage = outcome.finish.usage
        made = usage.spec_drafts + usage.spec_accepted_tokens
        assert usage.completion_tokens - 1 <= made < usage.completion_tokens - 1 + WIDTH
    # Repetitive text: several tokens per verify on average.
    assert 1 + accepted / drafts >= 1.5


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_ngram_prefix_hits_and_chunks(llama_dir: str, overlap: bool) -> None:
    shared = _prompts(5, 2)[1]  # a repeating phrase as the shared prefix
    prompts = [shared + tail for tail in _prompts(6, 8)]
    reference = tokens_of(run(engine_for(llama_dir), requests_for(prompts, max_new_tokens=24)))
    engine = _ngram(llama_dir, page_size=4, chunked_prefill_tokens=8, no_overlap=not overlap)
    first = run(engine, requests_for(prompts[:1], max_new_tokens=24))
    assert first[0].token_ids == reference[0]
    rest = run(engine, requests_for(prompts, max_new_tokens=24)[1:])
    assert tokens_of(rest) == {i: reference[i] for i in range(1, len(prompts))}
    assert all(o.finish.usage.cached_tokens > 0 for o in rest.values())


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_ngram_retraction(
    llama_dir: str, plain: dict[int, list[int]], monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    monkeypatch.setenv("OUTRIDER_DEBUG_RETRACT_EVERY", "5")
    # A pool of 320 tokens cannot hold 18 growing requests at once: real retraction too.
    engine = _ngram(
        llama_dir, page_size=4, kv_cache_tokens=320, context_length=96, no_overlap=not overlap
    )
    outcomes = run(engine, requests_for(_prompts(1, 18), max_new_tokens=NEW_TOKENS))
    assert tokens_of(outcomes) == plain


def test_ngram_seeded_sampling_equals_target_only(llama_dir: str) -> None:
    prompts = _prompts(2, 12)
    params = [
        {"temperature": 0.7, "seed": 11},
        {"temperature": 1.0, "top_k": 5, "seed": 12},
        {"temperature": 1.3, "top_p": 0.8, "seed": 13},
    ]
    reqs = [
        request(i, p, max_new_tokens=30, **params[i % 3])  # type: ignore[arg-type]
        for i, p in enumerate(prompts)
    ]
    expected = tokens_of(run(engine_for(llama_dir), reqs))
    engine = _ngram(llama_dir)
    assert tokens_of(run(engine, reqs)) == expected
    assert engine.scheduler.counters().spec_accepted_tokens > 0


def test_ngram_stops_inside_an_accepted_run(llama_dir: str, plain: dict[int, list[int]]) -> None:
    prompts = _prompts(1, 18)
    engine = _ngram(llama_dir, speculative_num_draft_tokens=8)
    # Rows 1, 3, ... repeat a phrase: their outputs come several tokens per step.
    reqs = []
    for rid in (1, 3, 5):
        expected = plain[rid]
        stop_at = expected[9]
        reqs.append(request(100 + rid, prompts[rid], stop_token_ids=[stop_at], max_new_tokens=40))
        reqs.append(request(200 + rid, prompts[rid], max_new_tokens=7))
        reqs.append(request(300 + rid, prompts[rid], max_new_tokens=40, logprobs=2, stream=True))
    outcomes = run(engine, reqs)
    for rid in (1, 3, 5):
        expected = plain[rid]
        cut = expected.index(expected[9]) + 1
        assert outcomes[100 + rid].token_ids == expected[:cut]
        assert outcomes[100 + rid].finish.reason == "stop"
        assert outcomes[200 + rid].token_ids == expected[:7]
        assert outcomes[200 + rid].finish.usage.completion_tokens == 7
        streamed = outcomes[300 + rid]
        assert streamed.token_ids == expected
        logprobs = [lp for u in streamed.updates for lp in (u.logprobs or [])]
        assert [lp.token_id for lp in logprobs] == expected
        for lp in logprobs:
            assert lp.top[0][0] == lp.token_id and lp.top[0][1] == pytest.approx(lp.logprob)
        # Streaming sends runs of several committed tokens: fewer updates than tokens.
        assert len(streamed.updates) < len(expected)


def test_overlap_and_serial_count_the_same(llama_dir: str) -> None:
    prompts = _prompts(3, 10)
    counters = []
    for overlap in (True, False):
        engine = _ngram(llama_dir, no_overlap=not overlap)
        run(engine, requests_for(prompts, max_new_tokens=20))
        counters.append(engine.scheduler.counters())
    overlapped, serial = counters
    assert overlapped.spec_drafts == serial.spec_drafts
    assert overlapped.spec_accepted_per_position == serial.spec_accepted_per_position


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"draft_model": "/nowhere"}, "--draft-model: ngram uses no draft model; leave it out"),
        ({"speculative_topk": 4}, "--speculative-topk: ngram drafts chains only: use 1, not 4"),
        (
            {"speculative_num_draft_tokens": 1},
            "--speculative-num-draft-tokens: must be at least 2 (the root and a draft)",
        ),
        (
            {"speculative_config": '{"max_match": 3, "min_match": 4}'},
            "--speculative-config: ngram: need 1 <= min_match <= max_match < window, got 4, 3, "
            "1024",
        ),
        (
            {"speculative_config": '{"depth": 3}'},
            "--speculative-config: ngram: Object contains unknown field `depth`",
        ),
    ],
)
def test_ngram_refusals_name_the_flag(
    llama_dir: str, overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        _ngram(llama_dir, **overrides)
    assert message in str(refused.value)


def test_unknown_algorithm_lists_the_available_ones(llama_dir: str) -> None:
    with pytest.raises(ConfigError) as refused:
        engine_for(llama_dir, speculative_algorithm="medusa")
    assert "--speculative-algorithm: unknown speculative algorithm 'medusa'; available: " in str(
        refused.value
    )
    assert "ngram" in str(refused.value)


def test_problems_are_reported_together(llama_dir: str) -> None:
    with pytest.raises(ConfigError) as refused:
        _ngram(llama_dir, draft_model="/nowhere", speculative_topk=2)
    text = str(refused.value)
    assert "--draft-model" in text and "--speculative-topk" in text


def test_a_step_verifies_the_configured_width(llama_dir: str) -> None:
    engine = _ngram(llama_dir, speculative_num_steps=3, speculative_num_draft_tokens=0)
    runner = engine.loop.runner
    assert (runner.shape.width, runner.shape.max_commit) == (4, 4)
    default = _ngram(llama_dir, speculative_num_draft_tokens=0)
    assert default.loop.runner.shape.width == 8


def test_plugins_check_prints_the_verdict_without_starting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    refused = run_serve_check(
        ["--speculative-algorithm", "ngram", "--speculative-topk", "3", "--draft-model", "x"],
        environ={},
    )
    assert refused == EXIT_CONFIG
    assert capsys.readouterr().out.splitlines() == [
        "the configuration cannot run:",
        "  --draft-model: ngram uses no draft model; leave it out",
        "  --speculative-topk: ngram drafts chains only: use 1, not 3",
    ]
    ok = run_serve_check(["--page-size", "1"], environ={"OUTRIDER_SPECULATIVE_ALGORITHM": "ngram"})
    assert ok == 0
    assert capsys.readouterr().out.startswith(
        "the configuration can run: speculative ngram; extend torch, decode torch, verify torch"
    )


# --- EAGLE-3 ------------------------------------------------------------------------------


def _eagle3(llama_dir: str, eagle3_dir: str, **overrides: object) -> Engine:
    settings: dict[str, object] = {
        "speculative_algorithm": "eagle3",
        "draft_model": eagle3_dir,
        "speculative_num_steps": 3,
    }
    settings.update(overrides)
    return engine_for(llama_dir, **settings)


# (S, K, N): a chain, and a tree whose node slots (S - 1) K outnumber its N.
TREE = {"speculative_num_steps": 4, "speculative_topk": 3, "speculative_num_draft_tokens": 8}
SHAPES = {"chain": {}, "tree": TREE}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("shape", SHAPES)
def test_eagle3_greedy_equals_target_only(
    llama_dir: str,
    eagle3_dir: str,
    plain: dict[int, list[int]],
    page_size: int,
    overlap: bool,
    shape: str,
) -> None:
    engine = _eagle3(
        llama_dir, eagle3_dir, page_size=page_size, no_overlap=not overlap, **SHAPES[shape]
    )
    runner = engine.loop.runner
    width, span, commit = (8, 9, 5) if shape == "tree" else (4, 4, 4)
    geometry = runner.shape
    assert (geometry.width, geometry.kv_span, geometry.max_commit) == (width, span, commit)
    outcomes = run(engine, requests_for(_prompts(1, 18), max_new_tokens=NEW_TOKENS))
    assert tokens_of(outcomes) == plain
    counters = engine.scheduler.counters()
    assert counters.spec_draft_tokens == (width - 1) * counters.spec_drafts > 0
    assert len(counters.spec_accepted_per_position) == commit - 1


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("shape", SHAPES)
def test_eagle3_prefix_hits_chunks_retraction_and_sampling(
    llama_dir: str, eagle3_dir: str, monkeypatch: pytest.MonkeyPatch, overlap: bool, shape: str
) -> None:
    shared = _prompts(5, 2)[1]
    prompts = [shared + tail for tail in _prompts(6, 8)]
    sampled = {"temperature": 0.9, "top_k": 20, "seed": 5}
    reqs = requests_for(prompts, max_new_tokens=24)
    reqs += [request(100 + i, p, max_new_tokens=24, **sampled) for i, p in enumerate(prompts)]
    reference = tokens_of(run(engine_for(llama_dir), reqs))
    monkeypatch.setenv("OUTRIDER_DEBUG_RETRACT_EVERY", "9")
    engine = _eagle3(
        llama_dir,
        eagle3_dir,
        page_size=4,
        chunked_prefill_tokens=16,
        no_overlap=not overlap,
        **SHAPES[shape],
    )
    first = run(engine, reqs[:1])
    assert first[0].token_ids == reference[0]
    rest = run(engine, reqs[1:])
    assert tokens_of(rest) == {r.rid: reference[r.rid] for r in reqs[1:]}
    assert any(o.finish.usage.cached_tokens > 0 for o in rest.values())


@pytest.mark.parametrize(
    ("flags", "problems"),
    [
        (
            {"speculative_topk": 2},
            [
                "--speculative-num-steps: a tree (topk 2) needs its depth",
                "--speculative-num-draft-tokens: a tree (topk 2) needs its size N",
            ],
        ),
        (
            {"speculative_topk": 2, "speculative_num_steps": 2, "speculative_num_draft_tokens": 8},
            [
                "--speculative-num-draft-tokens: a tree of depth 2 and topk 2 scores 6 "
                "candidates: at most 7, not 8"
            ],
        ),
    ],
)
def test_eagle3_tree_refusals_name_the_flag(
    llama_dir: str, eagle3_dir: str, flags: dict[str, int], problems: list[str]
) -> None:
    with pytest.raises(ConfigError) as refused:
        engine_for(llama_dir, speculative_algorithm="eagle3", draft_model=eagle3_dir, **flags)
    assert str(refused.value).splitlines()[1:] == [f"  {p}" for p in problems]


def test_a_chain_verifies_its_steps_plus_one(llama_dir: str, eagle3_dir: str) -> None:
    engine = _eagle3(llama_dir, eagle3_dir, speculative_num_draft_tokens=8)
    assert (engine.loop.runner.shape.width, engine.loop.runner.shape.max_commit) == (4, 4)


def test_eagle3_refusals_name_the_flag(llama_dir: str, eagle3_dir: str) -> None:
    with pytest.raises(ConfigError) as refused:
        engine_for(llama_dir, speculative_algorithm="eagle3")
    assert "--draft-model: eagle3 needs a draft model directory" in str(refused.value)
    with pytest.raises(ConfigError) as refused:
        engine_for(llama_dir, speculative_algorithm="eagle3", draft_model=llama_dir)
    assert "--draft-model: eagle3 needs a LlamaForCausalLMEagle3 draft, not" in str(refused.value)


# --- DFlash -------------------------------------------------------------------------------

BLOCK = 4


@pytest.fixture(scope="module")
def dflash_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_random_dflash(tmp_path_factory.mktemp("dflash"), block_size=BLOCK))


def _dflash(llama_dir: str, dflash_dir: str, **overrides: object) -> Engine:
    settings: dict[str, object] = {"speculative_algorithm": "dflash", "draft_model": dflash_dir}
    settings.update(overrides)
    return engine_for(llama_dir, **settings)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_dflash_greedy_equals_target_only(
    llama_dir: str, dflash_dir: str, plain: dict[int, list[int]], page_size: int, overlap: bool
) -> None:
    engine = _dflash(llama_dir, dflash_dir, page_size=page_size, no_overlap=not overlap)
    assert engine.loop.runner.shape.width == BLOCK  # the draft's block size
    outcomes = run(engine, requests_for(_prompts(1, 18), max_new_tokens=NEW_TOKENS))
    assert tokens_of(outcomes) == plain
    counters = engine.scheduler.counters()
    assert counters.spec_draft_tokens == (BLOCK - 1) * counters.spec_drafts > 0


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_dflash_prefix_hits_chunks_retraction_sampling_and_logprobs(
    llama_dir: str, dflash_dir: str, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    shared = _prompts(5, 2)[1]
    prompts = [shared + tail for tail in _prompts(6, 8)]
    sampled = {"temperature": 0.8, "top_p": 0.9, "seed": 9, "logprobs": 2}
    reqs = requests_for(prompts, max_new_tokens=24)
    reqs += [request(100 + i, p, max_new_tokens=24, **sampled) for i, p in enumerate(prompts)]
    expected = run(engine_for(llama_dir), reqs)
    monkeypatch.setenv("OUTRIDER_DEBUG_RETRACT_EVERY", "9")
    engine = _dflash(
        llama_dir, dflash_dir, page_size=4, chunked_prefill_tokens=16, no_overlap=not overlap
    )
    first = run(engine, reqs[:1])
    assert first[0].token_ids == expected[0].token_ids
    rest = run(engine, reqs[1:])
    assert tokens_of(rest) == {r.rid: expected[r.rid].token_ids for r in reqs[1:]}
    assert any(o.finish.usage.cached_tokens > 0 for o in rest.values())
    # Logprobs of sampled requests come from the verify logits: the same values.
    for rid in range(100, 100 + len(prompts)):
        got = [lp for u in rest[rid].updates for lp in (u.logprobs or [])]
        want = [lp for u in expected[rid].updates for lp in (u.logprobs or [])]
        assert [lp.token_id for lp in got] == [lp.token_id for lp in want]
        assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want], abs=1e-4)


def test_dflash_refusals_name_the_flag(llama_dir: str, dflash_dir: str) -> None:
    with pytest.raises(ConfigError) as refused:
        _dflash(llama_dir, dflash_dir, speculative_num_draft_tokens=8)
    assert (
        "--speculative-num-draft-tokens: dflash verifies whole blocks: the draft's block_size "
        "is 4, not 8" in str(refused.value)
    )
    with pytest.raises(ConfigError) as refused:
        _dflash(llama_dir, llama_dir)
    assert "--draft-model: dflash needs a DFlashDraftModel draft, not ['LlamaForCausalLM']" in str(
        refused.value
    )


# --- standalone ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Another random tiny model with the target's vocabulary (a Qwen2 this time)."""
    directory = tmp_path_factory.mktemp("qwen2-draft")
    with torch.no_grad():
        save_tiny_model("qwen2", directory)
    return str(directory)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_standalone_greedy_and_sampled_equal_target_only(
    llama_dir: str,
    small_draft_dir: str,
    plain: dict[int, list[int]],
    monkeypatch: pytest.MonkeyPatch,
    overlap: bool,
) -> None:
    engine = engine_for(
        llama_dir,
        speculative_algorithm="standalone",
        draft_model=small_draft_dir,
        page_size=4,
        no_overlap=not overlap,
    )
    assert engine.loop.runner.shape.width == 4
    outcomes = run(engine, requests_for(_prompts(1, 18), max_new_tokens=NEW_TOKENS))
    assert tokens_of(outcomes) == plain
    sampled = [
        request(i, p, max_new_tokens=20, temperature=0.9, seed=i)
        for i, p in enumerate(_prompts(2, 6))
    ]
    monkeypatch.setenv("OUTRIDER_DEBUG_RETRACT_EVERY", "7")
    expected = tokens_of(run(engine_for(llama_dir), sampled))
    again = engine_for(
        llama_dir, speculative_algorithm="standalone", draft_model=small_draft_dir,
        chunked_prefill_tokens=16, no_overlap=not overlap,
    )  # fmt: skip
    assert tokens_of(run(again, sampled)) == expected


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_the_target_as_its_own_draft_accepts_every_draft(
    llama_dir: str, plain: dict[int, list[int]], overlap: bool
) -> None:
    """A draft equal to the target proposes exactly the target's greedy tokens: every verify
    commits all of them, and stops and length limits land inside accepted runs."""
    engine = engine_for(
        llama_dir,
        speculative_algorithm="standalone",
        draft_model=llama_dir,
        speculative_num_draft_tokens=5,
        no_overlap=not overlap,
    )
    prompts = _prompts(1, 18)
    reqs = requests_for(prompts, max_new_tokens=NEW_TOKENS)
    reqs += requests_for(prompts[:6], max_new_tokens=7, first_rid=100)
    reqs += [
        request(200 + i, p, stop_token_ids=[plain[i][10]], max_new_tokens=NEW_TOKENS)
        for i, p in enumerate(prompts[:6])
    ]
    outcomes = run(engine, reqs)
    for i in range(len(prompts)):
        assert outcomes[i].token_ids == plain[i]
    for i in range(6):
        assert outcomes[100 + i].token_ids == plain[i][:7]
        cut = plain[i].index(plain[i][10]) + 1
        assert outcomes[200 + i].token_ids == plain[i][:cut]
        assert outcomes[200 + i].finish.reason == "stop"
    counters = engine.scheduler.counters()
    tau = 1 + counters.spec_accepted_tokens / counters.spec_drafts
    assert tau > 4.9  # 5 tokens per verify, but for float32 near-ties between the two paths
    assert counters.spec_accepted_per_position[-1] > 0.9 * counters.spec_drafts


def test_standalone_refuses_a_draft_with_other_token_ids(
    llama_dir: str, small_draft_dir: str, tmp_path: Path
) -> None:
    other = tmp_path / "draft"
    shutil.copytree(small_draft_dir, other)
    # Tokenizer files: the target's, with two ids swapped in the draft's copy.
    target_tokenizer = {"model": {"vocab": {"a": 3, "b": 4, "c": 5}}, "added_tokens": []}
    (Path(llama_dir) / "tokenizer.json").write_text(json.dumps(target_tokenizer))
    try:
        swapped = {"model": {"vocab": {"a": 4, "b": 3, "c": 5}}, "added_tokens": []}
        (other / "tokenizer.json").write_text(json.dumps(swapped))
        with pytest.raises(ConfigError) as refused:
            engine_for(llama_dir, speculative_algorithm="standalone", draft_model=str(other))
        assert (
            "--draft-model: the draft's tokenizer maps tokens to other ids (2 differ, e.g. "
            "'a': target 3, draft 4)" in str(refused.value)
        )
    finally:
        (Path(llama_dir) / "tokenizer.json").unlink()


def test_dflash_mask_token_string_resolves_through_the_target_tokenizer(
    llama_dir: str, dflash_dir: str, tmp_path: Path
) -> None:
    draft = tmp_path / "draft"
    shutil.copytree(dflash_dir, draft)
    config = json.loads((draft / "config.json").read_text())
    del config["dflash_config"]["mask_token_id"]
    config["dflash_config"]["mask_token"] = "<|mask|>"
    (draft / "config.json").write_text(json.dumps(config))
    target = tmp_path / "target"
    shutil.copytree(llama_dir, target)
    vocab = {f"t{i}": i for i in range(VOCAB - 1)}
    Tokenizer(WordLevel(vocab, unk_token="t0")).save(str(target / "tokenizer.json"))
    with pytest.raises(ConfigError) as refused:
        _dflash(str(target), str(draft))
    assert "--draft-model: the target's tokenizer has no mask token '<|mask|>'" in str(
        refused.value
    )
    vocab["<|mask|>"] = VOCAB - 1
    Tokenizer(WordLevel(vocab, unk_token="t0")).save(str(target / "tokenizer.json"))
    engine = _dflash(str(target), str(draft))
    worker = engine.loop.runner.worker
    assert isinstance(worker, DFlashWorker) and int(worker.block[0, 1]) == VOCAB - 1
    reqs = requests_for(_prompts(1, 4), max_new_tokens=NEW_TOKENS)
    assert tokens_of(run(engine, reqs)) == tokens_of(run(engine_for(str(target)), reqs))
