"""On-device token sampling with counter-based randomness (ARCHITECTURE.md 4.4), from a
``SamplingBatch``: the per-row device form of the rows' ``SamplingSpec`` (sampling_spec.py).

Rule, per row, over the logits a request's adjustments left (logit bias and penalties:
daemon/engine/penalties.py; the raw logits where it has none): greedy rows (``temperature ==
0``) take the argmax, ties to the lowest id. Sampled rows divide by the temperature, drop the
tokens less likely than ``min_p`` times the most likely one, keep the ``top_k`` largest (0 =
all), then the smallest set of most likely tokens whose mass reaches ``top_p`` (mass measured
after those cuts and renormalisation; the most likely token is always kept), renormalise, and draw
with an exponential race: ``argmax_i p_i / E_i`` with ``E_i = -log(U_i)`` i.i.d. Exp(1). The
race winner is distributed exactly as ``p``; it is computed as ``log p_i - log E_i``, and the
normalisation constant is dropped because it shifts every score of a row alike. Every value is
computed in id order; the vocabulary is sorted only where some sampled row of the batch cuts
by top-k or top-p (``SamplingBatch.cuts``, known on the host), to find those cuts, so a row's
result does not depend on whether its batch sorts.

Randomness: ``U`` is a pure function of (request seed, output position, draw index, token id),
so a request's draws do not depend on which rows share its batch, their order, overlap,
retraction, CUDA graphs or the device. ``draw`` separates independent uses at one position
(speculative verification draws an acceptance uniform and a residual sample there).

Invariants of the hash (statistical quality, not cryptography):

- Every word is a 32-bit value held in an int64 tensor; products stay below 2^63 and are
  reduced with ``& 0xFFFFFFFF``: nothing relies on signed wrap-around, so every device gives
  the same bits.
- A row's key is 64 bits (two 32-bit lanes absorbing draw, seed and position): two distinct
  (seed, position, draw) share a row of uniforms with probability about 2^-64, not 2^-32.
- ``U = ((h >> 9) + 0.5) / 2^23``: odd multiples of 2^-24, exact in float32, strictly inside
  (0, 1).

Everything is torch operations, run eagerly (CUDA graphs remove the launches), but the race on
a GPU: two Triton kernels (race_kernel.py) that read a row once where torch's operations pass
over it about twenty-five times, and give torch's winner. Their arguments are sizes and
strides, not shapes, so a new batch size does not compile them again while serving.

NOTE: changing any constant here changes every seeded output; tests pin a few values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from outrider.plugins.debug import debug_knob
from outrider.plugins.graph_build import in_graph_build
from outrider.plugins.sampling_spec import SamplingSpec

_MASK32 = 0xFFFFFFFF
# Multipliers of a low-bias 32-bit mixer (the hash-prospector family); both are below 2^31.
_MIX_MUL_1 = 0x21F0AAAD
_MIX_MUL_2 = 0x735A2D97
MIXERS = (_MIX_MUL_1, _MIX_MUL_2)  # what race_kernel.py hashes with
_LANE_INITS = (0x6A09E667, 0xBB67AE85)
_U_SCALE = 2.0**-23

_Word = TypeVar("_Word", torch.Tensor, int)

# Draw indices at one output position: plain sampling draws 0 there; a speculative step
# draws its acceptance uniform, a replacement after a rejection and a sampling draft's own
# token with the others (accept.py).
DRAW_ACCEPT = 1
DRAW_RESIDUAL = 2
DRAW_DRAFT = 3
DRAW_SIMULATE = 4  # debug: the simulated acceptance of a benchmark (verify.py)


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, on the logits' device: the device form of
    the rows' ``SamplingSpec``.

    ``all_greedy`` must be True only when every row has temperature 0 (it skips the random
    path); ``max_logprobs`` is the largest top-n any row asked for (0 = none); ``min_p`` None
    when no row asks for one (the cut is skipped); ``cuts`` False only when no sampled row cuts
    by top-k or top-p (``SamplingSpec.cuts``: the sort that finds those cuts is skipped).
    """

    temperature: torch.Tensor  # [n] float32; 0 = greedy
    top_p: torch.Tensor  # [n] float32 in (0, 1]
    top_k: torch.Tensor  # [n] int64; 0 = no top-k
    seed: torch.Tensor  # [n] int64 in [0, 2^63)
    all_greedy: bool
    max_logprobs: int
    min_p: torch.Tensor | None = None  # [n] float32 in [0, 1]; 0 = no cut
    cuts: bool = True

    @classmethod
    def from_specs(
        cls, specs: Sequence[SamplingSpec], device: torch.device | str = "cpu"
    ) -> SamplingBatch:
        """The batch of the rows' ``specs`` (the engine gathers its own batches from per-slot
        device buffers instead: engine/slots.py)."""
        return cls(
            temperature=torch.tensor(
                [s.temperature for s in specs], dtype=torch.float32, device=device
            ),
            top_p=torch.tensor([s.top_p for s in specs], dtype=torch.float32, device=device),
            top_k=torch.tensor([s.top_k for s in specs], dtype=torch.int64, device=device),
            seed=torch.tensor([s.seed for s in specs], dtype=torch.int64, device=device),
            all_greedy=all(s.temperature == 0 for s in specs),
            max_logprobs=max((s.logprobs for s in specs), default=0),
            min_p=torch.tensor([s.min_p for s in specs], dtype=torch.float32, device=device)
            if any(s.min_p > 0 for s in specs)
            else None,
            cuts=any(s.cuts for s in specs),
        )


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [n] int64
    logprob: torch.Tensor  # [n] float32, raw log-softmax at the chosen token
    top_ids: torch.Tensor  # [n, max_logprobs] int64
    top_logprobs: torch.Tensor  # [n, max_logprobs] float32, raw log-softmax


def _mix32(x: _Word) -> _Word:
    """Bijective mixer of 32-bit words held in int64 tensors (or Python ints)."""
    # NOTE: x < 2^32 and both multipliers < 2^31: every product stays below 2^63.
    x = x ^ (x >> 16)
    x = (x * _MIX_MUL_1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX_MUL_2) & _MASK32
    return x ^ (x >> 15)


def _row_keys(seed: torch.Tensor, position: torch.Tensor, draw: int) -> torch.Tensor:
    """The 64-bit key of each row as two 32-bit lanes: [n, 2] int64."""
    if not 0 <= draw <= _MASK32:
        raise ValueError(f"draw must be in [0, 2^32), got {draw}")
    # draw is host-known: it enters through the lanes' initial values, mixed on the host.
    init_a, init_b = (_mix32(init ^ draw) for init in _LANE_INITS)
    # >> is arithmetic on int64; the masks keep every word in [0, 2^32).
    seed_lo = (seed & _MASK32).unsqueeze(-1)
    seed_hi = ((seed >> 32) & _MASK32).unsqueeze(-1)
    key = _mix32(torch.cat([seed_lo ^ init_a, seed_lo ^ init_b], dim=-1))
    key = _mix32(key ^ seed_hi)
    return _mix32(key ^ (position & _MASK32).unsqueeze(-1))


def _uniform_at(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) for token ``ids`` (int64, broadcast against [n, 1])."""
    # keys: [n, 2]
    h = _mix32(_mix32(ids ^ keys[:, :1]) ^ keys[:, 1:])
    return (h >> 9).to(torch.float32).add_(0.5).mul_(_U_SCALE)


def uniform(seed: torch.Tensor, position: torch.Tensor, draw: int, vocab: int) -> torch.Tensor:
    """Counter-based uniforms: ``out[r, i]`` is a pure function of
    ``(seed[r], position[r] mod 2^32, draw, i)``, strictly inside (0, 1), and bitwise the same
    on every device.

    seed, position: [n] int64. Returns [n, vocab] float32.
    """
    keys = _row_keys(seed, position, draw)
    ids = torch.arange(vocab, dtype=torch.int64, device=seed.device)
    return _uniform_at(keys, ids)


def uniform_at(
    seed: torch.Tensor, position: torch.Tensor, draw: int, ids: torch.Tensor
) -> torch.Tensor:
    """The uniforms of ``uniform`` at token ``ids`` only: ids [n, k] int64 -> [n, k]."""
    return _uniform_at(_row_keys(seed, position, draw), ids)


def sample_probs(
    probs: torch.Tensor, seed: torch.Tensor, position: torch.Tensor, draw: int
) -> torch.Tensor:
    """One token per row drawn from ``probs`` [n, V] (rows summing to 1) by the exponential
    race over the counter-based uniforms of ``(seed, position, draw)``: [n] int64."""
    return _race(torch.log(probs), _row_keys(seed, position, draw)).squeeze(-1)


def _check_limits(logits: torch.Tensor, vocab_limit: int, max_logprobs: int = 0) -> None:
    if not 0 < vocab_limit <= logits.shape[-1]:
        raise ValueError(f"vocab_limit {vocab_limit} outside [1, {logits.shape[-1]}]")
    if max_logprobs > vocab_limit:
        raise ValueError(f"max_logprobs {max_logprobs} exceeds vocab_limit {vocab_limit}")


def _filtered(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The sampled-row rule in id order: tempered logits with the cut tokens at -inf, [n, V].
    Greedy rows get temperature 1 (their result is discarded). Only where the batch cuts by
    top-k or top-p (``batch.cuts``) is the vocabulary sorted, to find those cuts; every value
    is computed in id order either way, so a row's result does not depend on whether another
    row of its batch cuts."""
    # logits: [n, V]
    vocab = logits.shape[-1]
    temperature = torch.where(batch.temperature > 0, batch.temperature, 1.0)
    values = logits / temperature.unsqueeze(-1)
    if batch.min_p is not None:
        # p_i < min_p * p_max, in log space; log(0) = -inf cuts nothing.
        floor = values.amax(dim=-1, keepdim=True) + torch.log(batch.min_p).unsqueeze(-1)
        values = values.masked_fill(values < floor, float("-inf"))
    if not batch.cuts:
        return values
    # Stable sort: equal logits keep id order, so top-k ties go to the lowest ids everywhere.
    ordered, ids = torch.sort(values, dim=-1, descending=True, stable=True)
    top_k = torch.where(batch.top_k > 0, batch.top_k, vocab).unsqueeze(-1)  # [n, 1]
    rank = torch.arange(vocab, device=logits.device)
    ordered = ordered.masked_fill(rank >= top_k, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    # NOTE: a float32 cumsum can reach 1.0 before the tail; top_p == 1 must keep every token.
    top_p = torch.where(batch.top_p < 1.0, batch.top_p, float("inf")).unsqueeze(-1)  # [n, 1]
    cut_ranks = (rank >= top_k) | (mass_before >= top_p)
    cut = torch.empty_like(cut_ranks).scatter_(-1, ids, cut_ranks)
    return values.masked_fill(cut, float("-inf"))


def _race(values: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Exponential race over rows in id order: the token id ``argmax(values - log E)``, [n, 1]
    (ties to the lowest id); on a GPU in one read of the row (race_kernel.py, the same
    winner)."""
    # values: [n, V] log-weights (-inf = cut); keys: [n, 2]
    if values.is_cuda and not debug_knob("OUTRIDER_DEBUG_TORCH_KERNELS"):
        from outrider.plugins.race_kernel import race_fits, race_winners

        if race_fits(values):
            return race_winners(values, keys, MIXERS)
    return _race_torch(values, keys)


def _race_torch(values: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``_race`` in torch's operations, on any device."""
    ids = torch.arange(values.shape[-1], dtype=torch.int64, device=values.device)
    log_e = torch.log(-torch.log(_uniform_at(keys, ids)))
    return torch.argmax(values - log_e, dim=-1, keepdim=True)


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    # torch.argmax returns the first maximal index: ties go to the lowest id.
    return torch.argmax(logits, dim=-1)


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    position: torch.Tensor,
    *,
    vocab_limit: int,
    draw: int = 0,
    choose_from: torch.Tensor | None = None,
) -> SampleResult:
    """Choose one token per row, with no host synchronisation.

    logits: [n, V] float32; ids >= ``vocab_limit`` are never chosen nor reported.
    choose_from: [n, V], the logits the rule chooses from when a request adjusted them
    (``logits``, the raw ones, give the logprobs); None: ``logits``.
    position: [n] int64, the output position of the token being drawn (a randomness counter).
    draw: separates independent draws at the same (seed, position).
    Logprobs are the raw log-softmax over the first ``vocab_limit`` ids (no temperature or
    filtering): the chosen token's, and the ``batch.max_logprobs`` largest.
    """
    _check_limits(logits, vocab_limit, batch.max_logprobs)
    # Slicing is free and keeps shapes static: padded ids simply do not exist below here.
    logits = logits[:, :vocab_limit].float()  # [n, Vl]
    # A graph being built reads the vocabulary once for the greedy token and its logprob
    # (greedy_kernel.py); eagerly, two Triton launches cost more host time than they save.
    if batch.all_greedy and not batch.max_logprobs and choose_from is None and in_graph_build():
        from outrider.plugins.greedy_kernel import greedy_fits, greedy_logprob

        if greedy_fits(logits):
            tokens, logprob = greedy_logprob(logits)
            return SampleResult(tokens, logprob, *_no_top(logits))
    chosen = logits if choose_from is None else choose_from[:, :vocab_limit].float()
    tokens = _greedy(chosen)
    if not batch.all_greedy:
        keys = _row_keys(batch.seed, position, draw)
        sampled = _race(_filtered(chosen, batch), keys).squeeze(-1)
        tokens = torch.where(batch.temperature > 0, sampled, tokens)
    return token_logprobs(logits, tokens, batch.max_logprobs, vocab_limit=vocab_limit)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, max_logprobs: int, *, vocab_limit: int
) -> SampleResult:
    """``tokens`` [n] with their raw log-softmax over the first ``vocab_limit`` ids of
    ``logits`` [n, V], and the ``max_logprobs`` largest (ids and logprobs)."""
    logits = logits[:, :vocab_limit].float()
    log_norm = torch.logsumexp(logits, dim=-1)  # [n]
    logprob = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - log_norm
    if max_logprobs > 0:
        top_values, top_ids = torch.topk(logits, max_logprobs, dim=-1)
        top_logprobs = top_values - log_norm.unsqueeze(-1)
    else:
        top_ids, top_logprobs = _no_top(logits)
    return SampleResult(tokens, logprob, top_ids, top_logprobs)


def _no_top(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty top ids and logprobs for the rows of ``logits`` [n, V]: ``[n, 0]`` each."""
    top_ids = torch.empty((logits.shape[0], 0), dtype=torch.int64, device=logits.device)
    return top_ids, torch.empty((logits.shape[0], 0), dtype=logits.dtype, device=logits.device)


def processed_probs(
    logits: torch.Tensor, batch: SamplingBatch, *, vocab_limit: int
) -> torch.Tensor:
    """The distribution ``sample`` draws from, renormalised: [n, V] float32.

    Greedy rows are a one-hot of the argmax; ids >= ``vocab_limit`` have probability 0.
    """
    _check_limits(logits, vocab_limit)
    full = logits.float()
    logits = full[:, :vocab_limit]  # [n, Vl]
    greedy_ids = _greedy(logits).unsqueeze(-1)
    one_hot = torch.zeros_like(full).scatter_(-1, greedy_ids, 1.0)
    if batch.all_greedy:
        return one_hot
    probs = torch.zeros_like(full)
    probs[:, :vocab_limit] = torch.softmax(_filtered(logits, batch), dim=-1)
    return torch.where((batch.temperature > 0).unsqueeze(-1), probs, one_hot)
