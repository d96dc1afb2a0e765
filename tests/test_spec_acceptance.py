"""EAGLE-3 with a distilled draft (``draft_fixtures.distill_eagle3``) in process (scheduler +
engine, float32 on CPU): greedy output equals the target alone token for token, and the draft
is accepted (mean acceptance length ``tau = 1 + accepted / drafts``) across page sizes,
overlap, prefix-cache hits and chunked prefill, as a chain and as a tree."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from draft_fixtures import (
    DenseShape,
    distill_eagle3,
    random_prompts,
    target_continuations,
    unrolled_logits,
)
from engine_harness import (
    debug_checks_fixture,
    engine_for,
    request,
    requests_for,
    run,
    tau_of,
    tokens_of,
)
from model_fixtures import VOCAB, save_tiny_model

from outrider.daemon.engine import verify
from outrider.daemon.engine.build import Engine
from outrider.daemon.internal import Counters
from outrider.plugins.models.weights import checkpoint_tensors
from outrider.plugins.speculative.eagle3_model import load_eagle3

NEW_TOKENS = 48
STEPS = 3
MIN_TAU = 1.5
TREE = {"speculative_num_steps": STEPS, "speculative_topk": 3, "speculative_num_draft_tokens": 8}


debug_checks = debug_checks_fixture()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The tiny Llama target and its distilled draft."""
    target = tmp_path_factory.mktemp("llama")
    with torch.no_grad():
        save_tiny_model("llama", target)
    draft = distill_eagle3(target, tmp_path_factory.mktemp("eagle3"))
    return str(target), str(draft)


def _prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts the distillation (seed 0) never saw."""
    return random_prompts(random.Random(1000 + seed), count, VOCAB)


def _eagle3(dirs: tuple[str, str], **overrides: object) -> Engine:
    target, draft = dirs
    settings: dict[str, object] = {
        "speculative_algorithm": "eagle3",
        "draft_model": draft,
        "speculative_num_steps": STEPS,
    }
    settings.update(overrides)
    return engine_for(target, **settings)


PROMPTS = _prompts(1, 18)


def _dense_chain_counts(
    target_dir: Path, draft_dir: Path, prompts: Sequence[Sequence[int]], new_tokens: int
) -> tuple[int, list[int]]:
    """What a greedy ``STEPS``-draft chain of the draft at ``draft_dir`` should count
    serving ``prompts`` for ``new_tokens`` each, from the dense reference over the target's
    own continuations: ``(drafts, accepted per position)``, as the scheduler counts them
    (the last step of a request may accept past ``new_tokens``)."""
    import transformers

    target = transformers.AutoModelForCausalLM.from_pretrained(
        target_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    draft = load_eagle3(draft_dir, dtype=torch.float32, device="cpu", max_positions=256)
    embedding = target.get_input_embeddings().weight
    drafts, per_position = 0, [0] * STEPS
    with torch.no_grad():
        # Tokens past new_tokens settle the last step's drafts.
        data = target_continuations(target, prompts, new_tokens + STEPS)
        logits = unrolled_logits(
            checkpoint_tensors(draft), embedding, data.tokens, data.taps, STEPS,
            DenseShape.of(draft.config),
        )  # fmt: skip
    guesses = torch.stack([step.argmax(-1) for step in logits], dim=-1)  # [B, n, STEPS]
    for row, prompt in enumerate(prompts):
        # The root (the last committed token, KV not yet written) sits at ``seq``; the draft
        # row before it predicts the token after it.
        seq, made = len(prompt), 1
        while made < new_tokens:
            truth = data.tokens[row, seq + 1 : seq + 1 + STEPS]
            hits = (guesses[row, seq - 1] == truth).int().cumprod(0)
            accepted = int(hits.sum())
            drafts += 1
            for k in range(accepted):
                per_position[k] += 1
            seq += accepted + 1
            made += accepted + 1
    return drafts, per_position


@pytest.fixture(scope="module")
def plain(dirs: tuple[str, str]) -> dict[int, list[int]]:
    """The target-only greedy outputs of ``PROMPTS``."""
    return tokens_of(run(engine_for(dirs[0]), requests_for(PROMPTS, max_new_tokens=NEW_TOKENS)))


@pytest.fixture(scope="module")
def serial_chains(dirs: tuple[str, str]) -> Callable[[int], tuple[dict[int, list[int]], Counters]]:
    """``serial_chain(page_size)``: the tokens and counters of the chain (no overlap) serving
    ``PROMPTS``, served once per page size for the tests that read it."""
    served: dict[int, tuple[dict[int, list[int]], Counters]] = {}

    def serial_chain(page_size: int) -> tuple[dict[int, list[int]], Counters]:
        if page_size not in served:
            engine = _eagle3(dirs, page_size=page_size, no_overlap=True)
            tokens = tokens_of(run(engine, requests_for(PROMPTS, max_new_tokens=NEW_TOKENS)))
            served[page_size] = tokens, engine.scheduler.counters()
        return served[page_size]

    return serial_chain


@pytest.mark.parametrize("page_size", [1, 16])
def test_chain_is_lossless_and_accepted(
    dirs: tuple[str, str],
    plain: dict[int, list[int]],
    serial_chains: Callable[[int], tuple[dict[int, list[int]], Counters]],
    page_size: int,
) -> None:
    engine = _eagle3(dirs, page_size=page_size, no_overlap=False)
    assert tokens_of(run(engine, requests_for(PROMPTS, max_new_tokens=NEW_TOKENS))) == plain
    overlapped = engine.scheduler.counters()
    tokens, serial = serial_chains(page_size)
    assert tokens == plain
    assert overlapped.spec_drafts == serial.spec_drafts
    assert overlapped.spec_accepted_per_position == serial.spec_accepted_per_position
    per_position = serial.spec_accepted_per_position
    assert len(per_position) == STEPS and sum(per_position) == serial.spec_accepted_tokens
    # Some step committed 3+ tokens (two drafts and the bonus), some all four.
    assert per_position[1] > 0 and per_position[2] > 0
    assert tau_of(serial) >= MIN_TAU, per_position


def test_engine_drafts_what_the_dense_reference_drafts(
    dirs: tuple[str, str],
    serial_chains: Callable[[int], tuple[dict[int, list[int]], Counters]],
) -> None:
    """The worker's positions and features against ``draft_fixtures``' convention: the
    engine accepts exactly what the dense draft over the target's continuations predicts
    (an off-by-one position, tap or fed-back feature shows up here as a count mismatch)."""
    _, counters = serial_chains(16)  # engine_for's page size
    drafts, per_position = _dense_chain_counts(Path(dirs[0]), Path(dirs[1]), PROMPTS, NEW_TOKENS)
    assert (counters.spec_drafts, counters.spec_accepted_per_position) == (drafts, per_position)


def test_prefix_hits_and_chunks_are_lossless_and_accepted(dirs: tuple[str, str]) -> None:
    # Two pages of 4 shared: a hit keeps one (the last comes back to be recomputed, its draft
    # KV having been made with the publishing request's next token).
    shared = _prompts(50, 1)[0][:8]
    prompts = [shared + prompt for prompt in PROMPTS]
    reference = tokens_of(
        run(engine_for(dirs[0]), requests_for(prompts, max_new_tokens=NEW_TOKENS))
    )
    expected = _dense_chain_counts(Path(dirs[0]), Path(dirs[1]), prompts, NEW_TOKENS)
    for overlap in (True, False):
        engine = _eagle3(dirs, page_size=4, chunked_prefill_tokens=8, no_overlap=not overlap)
        first = run(engine, requests_for(prompts[:1], max_new_tokens=NEW_TOKENS))
        rest = run(engine, requests_for(prompts[1:], max_new_tokens=NEW_TOKENS, first_rid=1))
        assert tokens_of(first) | tokens_of(rest) == reference
        assert all(o.finish.usage.cached_tokens > 0 for o in rest.values())
        counters = engine.scheduler.counters()
        assert (counters.spec_drafts, counters.spec_accepted_per_position) == expected
        assert tau_of(counters) >= MIN_TAU, counters.spec_accepted_per_position


def _side_branch_commits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts, per tree accept, the rows whose accepted path leaves the first branch (a node
    ``path[j] != j`` below the commit length): their KV had to move."""
    counts: list[int] = []
    accept_tree = verify.accept_tree

    def recording(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        lens, path = accept_tree(*args, **kwargs)  # type: ignore[arg-type]
        depth = torch.arange(path.shape[1])
        moved = (path != depth) & (depth < lens.unsqueeze(1))
        counts.append(int(moved.any(dim=1).sum()))
        return lens, path

    monkeypatch.setattr(verify, "accept_tree", recording)
    return counts


@pytest.mark.parametrize("page_size", [1, 16])
def test_tree_is_lossless_and_accepts_more_than_the_chain(
    dirs: tuple[str, str],
    plain: dict[int, list[int]],
    serial_chains: Callable[[int], tuple[dict[int, list[int]], Counters]],
    page_size: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, chain = serial_chains(page_size)
    moved = _side_branch_commits(monkeypatch)
    counters = []
    for overlap in (True, False):
        engine = _eagle3(dirs, page_size=page_size, no_overlap=not overlap, **TREE)
        assert tokens_of(run(engine, requests_for(PROMPTS, max_new_tokens=NEW_TOKENS))) == plain
        counters.append(engine.scheduler.counters())
    overlapped, serial = counters
    assert overlapped.spec_drafts == serial.spec_drafts
    assert overlapped.spec_accepted_per_position == serial.spec_accepted_per_position
    assert serial.spec_draft_tokens == 7 * serial.spec_drafts
    # Accepted paths through later branches: the compaction moved KV, and outputs held.
    assert sum(moved) > 0
    tau, chain_tau = tau_of(serial), tau_of(chain)
    assert tau >= MIN_TAU and tau > chain_tau, (tau, chain_tau)


def test_tree_prefix_hits_chunks_sampling_and_logprobs(dirs: tuple[str, str]) -> None:
    """Greedy and seeded sampled requests (with logprobs, from the verify logits along the
    accepted path) equal the target alone, across prefix hits and chunks."""
    shared = _prompts(50, 1)[0][:8]
    prompts = [shared + prompt for prompt in PROMPTS[:10]]
    sampled = {"temperature": 0.7, "top_k": 8, "seed": 3, "logprobs": 2}
    reqs = requests_for(prompts, max_new_tokens=NEW_TOKENS)
    reqs += [
        request(100 + i, p, max_new_tokens=NEW_TOKENS, **sampled)  # type: ignore[arg-type]
        for i, p in enumerate(prompts)
    ]
    expected = run(engine_for(dirs[0]), reqs)
    engine = _eagle3(dirs, page_size=4, chunked_prefill_tokens=8, **TREE)
    first = run(engine, reqs[:1])
    rest = run(engine, reqs[1:])
    assert tokens_of(first) | tokens_of(rest) == tokens_of(expected)
    assert all(o.finish.usage.cached_tokens > 0 for o in rest.values())
    for rid in range(100, 100 + len(prompts)):
        got = [lp for u in rest[rid].updates for lp in (u.logprobs or [])]
        want = [lp for u in expected[rid].updates for lp in (u.logprobs or [])]
        assert [(lp.token_id, lp.top[0][0]) for lp in got] == [
            (lp.token_id, lp.top[0][0]) for lp in want
        ]
        assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want], abs=1e-4)
    # Whole paths were accepted (sampled rows accept less than greedy ones).
    assert engine.scheduler.counters().spec_accepted_per_position[STEPS - 1] > 0
