"""Drafts that truly sample keep each draft with probability min(1, p/q): the committed tokens
are distributed as the target's. A chi-square test of the joint distribution of three
generated tokens (20,000 seeded requests through the in-process engine, a target with a
vocabulary of 16) against the probabilities enumerated from the target; the same test must
reject a deliberately wrong rule (an argmax draft verified with its softmax as q)."""

from __future__ import annotations

import pytest
import torch
from engine_harness import engine_for, request, run
from model_fixtures import save_tiny_model

from outrider.plugins.speculative import standalone_impl

VOCAB = 16
PROMPT = [3, 7, 5, 9]
SAMPLES = 20_000
SIGNIFICANCE = 1e-3


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, torch.Tensor]:
    """(target dir, draft dir, the target's joint distribution of 3 tokens [16, 16, 16])."""
    target_dir = tmp_path_factory.mktemp("target16")
    draft_dir = tmp_path_factory.mktemp("draft16")
    with torch.no_grad():
        target = save_tiny_model("llama", target_dir, vocab_size=VOCAB, seed=1)
        save_tiny_model("qwen2", draft_dir, vocab_size=VOCAB, seed=2)
        return str(target_dir), str(draft_dir), _joint(target)


def _next_probs(model: torch.nn.Module, prefixes: list[list[int]]) -> torch.Tensor:
    logits = model(torch.tensor(prefixes)).logits[:, -1].double()
    return torch.softmax(logits, dim=-1)  # [n, V]


def _joint(model: torch.nn.Module) -> torch.Tensor:
    first = _next_probs(model, [PROMPT])[0]  # [V]
    second = _next_probs(model, [[*PROMPT, a] for a in range(VOCAB)])  # [V, V]
    pairs = [[*PROMPT, a, b] for a in range(VOCAB) for b in range(VOCAB)]
    third = _next_probs(model, pairs).view(VOCAB, VOCAB, VOCAB)
    return first[:, None, None] * second[:, :, None] * third


def _sampled_joint_counts(target_dir: str, draft_dir: str) -> tuple[torch.Tensor, float]:
    """Counts of the 3 generated tokens over SAMPLES seeded requests, and the engine's mean
    acceptance length."""
    engine = engine_for(
        target_dir,
        speculative_algorithm="standalone",
        draft_model=draft_dir,
        speculative_num_draft_tokens=4,
        speculative_config='{"sample": true}',
        max_running=512,
        kv_cache_tokens=65536,
        chunked_prefill_tokens=4096,
    )
    reqs = [request(i, PROMPT, max_new_tokens=3, temperature=1.0, seed=i) for i in range(SAMPLES)]
    counts = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    for outcome in run(engine, reqs).values():
        a, b, c = outcome.token_ids
        counts[a, b, c] += 1
    counters = engine.scheduler.counters()
    return counts, 1 + counters.spec_accepted_tokens / counters.spec_drafts


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test; cells expecting fewer than 5 are pooled into one."""
    expected = probs.flatten() * counts.sum()
    observed = counts.flatten()
    big = expected >= 5
    pooled_e = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    pooled_o = torch.cat([observed[big], observed[~big].sum().unsqueeze(0)])
    statistic = ((pooled_o - pooled_e) ** 2 / pooled_e).sum()
    dof = torch.tensor(pooled_e.numel() - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


def test_sampled_drafts_are_distributed_as_the_target(
    models: tuple[str, str, torch.Tensor],
) -> None:
    target_dir, draft_dir, joint = models
    counts, tau = _sampled_joint_counts(target_dir, draft_dir)
    assert tau > 1.1  # drafts are kept often enough for the rule to matter
    assert _chi_square_p_value(counts, joint) > SIGNIFICANCE


def test_an_argmax_draft_verified_with_its_softmax_is_rejected(
    models: tuple[str, str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wrong rule: drafts are the draft's argmax, but q is its softmax."""
    target_dir, draft_dir, joint = models

    def argmax(probs: torch.Tensor, *_: object) -> torch.Tensor:
        return probs.argmax(dim=-1)

    monkeypatch.setattr(standalone_impl, "sample_probs", argmax)
    counts, _tau = _sampled_joint_counts(target_dir, draft_dir)
    assert _chi_square_p_value(counts, joint) < SIGNIFICANCE


def test_greedy_requests_stay_exact_with_sampled_drafts(
    models: tuple[str, str, torch.Tensor],
) -> None:
    target_dir, draft_dir, _joint_probs = models
    prompts = [[(3 * i + j) % VOCAB for j in range(5 + i % 7)] for i in range(16)]
    reqs = [request(i, p, max_new_tokens=20) for i, p in enumerate(prompts)]
    expected = {rid: o.token_ids for rid, o in run(engine_for(target_dir), reqs).items()}
    engine = engine_for(
        target_dir,
        speculative_algorithm="standalone",
        draft_model=draft_dir,
        speculative_config='{"sample": true}',
    )
    assert {rid: o.token_ids for rid, o in run(engine, reqs).items()} == expected
