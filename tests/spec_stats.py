"""The distribution test of sampled speculative decoding: the joint distribution of three
generated tokens enumerated from a target of vocabulary ``VOCAB``, the counts of ``SAMPLES``
seeded requests through an engine, and Pearson's test between them."""

from __future__ import annotations

import torch
from engine_harness import request, run, tau_of

from outrider.daemon.engine.build import Engine

VOCAB = 16
PROMPT = [3, 7, 5, 9]
SAMPLES = 20_000
SIGNIFICANCE = 1e-3
# Engine settings that take the SAMPLES requests in few batches.
BIG_BATCHES = {"max_running": 512, "kv_cache_tokens": 65536, "chunked_prefill_tokens": 4096}


def _next_probs(model: torch.nn.Module, prefixes: list[list[int]]) -> torch.Tensor:
    logits = model(torch.tensor(prefixes)).logits[:, -1].double()
    return torch.softmax(logits, dim=-1)  # [n, V]


def joint_distribution(model: torch.nn.Module) -> torch.Tensor:
    """The HF ``model``'s distribution of the 3 tokens after ``PROMPT``: ``[V, V, V]``."""
    first = _next_probs(model, [PROMPT])[0]  # [V]
    second = _next_probs(model, [[*PROMPT, a] for a in range(VOCAB)])  # [V, V]
    pairs = [[*PROMPT, a, b] for a in range(VOCAB) for b in range(VOCAB)]
    third = _next_probs(model, pairs).view(VOCAB, VOCAB, VOCAB)
    return first[:, None, None] * second[:, :, None] * third


def sampled_joint_counts(
    engine: Engine, max_drafts: int | None = None
) -> tuple[torch.Tensor, float]:
    """Counts of the 3 generated tokens over SAMPLES seeded requests at temperature 1 (each
    with draft cap ``max_drafts``), and the engine's mean acceptance length."""
    reqs = [
        request(i, PROMPT, max_new_tokens=3, temperature=1.0, seed=i, max_drafts=max_drafts)
        for i in range(SAMPLES)
    ]
    counts = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    for outcome in run(engine, reqs).values():
        a, b, c = outcome.token_ids
        counts[a, b, c] += 1
    return counts, tau_of(engine.scheduler.counters())


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test; cells expecting fewer than 5 are pooled into one."""
    expected = probs.flatten() * counts.sum()
    observed = counts.flatten()
    big = expected >= 5
    pooled_e = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    pooled_o = torch.cat([observed[big], observed[~big].sum().unsqueeze(0)])
    statistic = ((pooled_o - pooled_e) ** 2 / pooled_e).sum()
    dof = torch.tensor(pooled_e.numel() - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))
