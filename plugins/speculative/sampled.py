"""How draft models draw the drafts of sampled requests (the modes: draft_options.py).

Draft ``j`` of a row stands where the target draws at output index ``out_len + j`` (a tree's
node of depth ``j + 1``, whose parent draws there). Both modes start from the draft's logits
processed exactly as the request samples (``processed_probs``: temperature, top-k, top-p), so
``q`` is the distribution each draft is drawn from:

- coupled: the exponential race over ``q`` with the target's own uniforms at that index (draw
  0, keyed by target token id): ``argmax_i log q_i - log E_i``. The target's draw is the same
  race over ``p``, so the two agree whenever the distributions let them, and the accept needs
  no ``q``. A tree takes the ``K`` best race scores as children.
- rejection: a race with the draft's own uniforms (``DRAW_DRAFT``); the verify keeps the
  draft with probability ``min(1, p/q)`` and so needs ``q``.

Greedy rows keep the draft's argmax (their ``q`` is one-hot), so in a mixed batch each row
keeps its own rule.
"""

from __future__ import annotations

import torch

from outrider.plugins.sampling import (
    DRAW_DRAFT,
    SamplingBatch,
    processed_probs,
    sample_probs,
    uniform_at,
)

# Scores of tokens the request's top-k / top-p cut (probability 0): low but finite, so that
# cumulative tree scores never meet inf - inf.
_CUT_SCORE = -1e6


def repeat_rows(batch: SamplingBatch, times: int) -> SamplingBatch:
    """Each row's parameters ``times`` times in a row (row-major: row 0's copies first)."""
    return SamplingBatch(
        temperature=batch.temperature.repeat_interleave(times),
        top_p=batch.top_p.repeat_interleave(times),
        top_k=batch.top_k.repeat_interleave(times),
        seed=batch.seed.repeat_interleave(times),
        all_greedy=batch.all_greedy,
        max_logprobs=0,
        min_p=None if batch.min_p is None else batch.min_p.repeat_interleave(times),
        cuts=batch.cuts,
    )


def coupled_scores(
    logits: torch.Tensor,
    batch: SamplingBatch,
    counters: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    vocab_limit: int,
) -> torch.Tensor:
    """Race scores of the draft's tokens: ``[n, C]`` from ``logits: [n, C]`` whose column
    ``c`` is target token ``token_ids[c]`` (``token_ids: [C]``), ``batch`` and ``counters``
    (the output index each row draws at, ``[n]``) one per row. Sampled rows: ``log q - log E``
    with the target's uniforms, shifted so that each row's winner scores 0 (the rest below:
    how far each token is from winning). Greedy rows: the draft's log-probabilities."""
    logits = logits.float().masked_fill(token_ids >= vocab_limit, float("-inf"))
    logprobs = torch.log_softmax(logits, dim=-1)
    if batch.all_greedy:
        return logprobs
    q = processed_probs(logits, batch, vocab_limit=logits.shape[-1])  # [n, C]
    u = uniform_at(batch.seed, counters, 0, token_ids.expand_as(logits))
    race = torch.log(q) - torch.log(-torch.log(u))
    race = (race - race.max(dim=-1, keepdim=True).values).clamp_(min=_CUT_SCORE)
    return torch.where((batch.temperature > 0).unsqueeze(-1), race, logprobs)


def coupled_drafts(
    logits: torch.Tensor,
    batch: SamplingBatch,
    out_lens: torch.Tensor,
    offsets: torch.Tensor,
    *,
    vocab_limit: int,
) -> torch.Tensor:
    """Drafts ``[bs, n]`` from target-width logits ``[bs * n, V]`` of ``n`` draft places per
    row: ``batch`` one row per request, ``out_lens: [bs]``, ``offsets: [n]`` (draft ``j``
    draws at ``out_len + offsets[j]``)."""
    bs, n = out_lens.shape[0], offsets.shape[0]
    counters = (out_lens.unsqueeze(1) + offsets).view(-1)
    ids = torch.arange(logits.shape[-1], device=logits.device)
    scores = coupled_scores(logits, repeat_rows(batch, n), counters, ids, vocab_limit=vocab_limit)
    return scores.argmax(dim=-1).view(bs, n)


def rejection_drafts(
    logits: torch.Tensor,
    batch: SamplingBatch,
    out_lens: torch.Tensor,
    offsets: torch.Tensor,
    *,
    vocab_limit: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafts ``[bs, n]``, their ``q`` ``[bs, n, V]``), arguments as ``coupled_drafts``."""
    bs, n = out_lens.shape[0], offsets.shape[0]
    q = processed_probs(logits, repeat_rows(batch, n), vocab_limit=vocab_limit)  # [bs * n, V]
    counters = (out_lens.unsqueeze(1) + offsets).view(-1)
    drafts = sample_probs(q, batch.seed.repeat_interleave(n), counters, DRAW_DRAFT)
    return drafts.view(bs, n), q.view(bs, n, -1)
