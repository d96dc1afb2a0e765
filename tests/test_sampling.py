"""On-device sampler: greedy rule, counter-based determinism, exact distributions, logprobs."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from outrider.plugins.sampling import (
    SamplingBatch,
    processed_probs,
    sample,
    uniform,
)
from outrider.plugins.sampling_spec import SamplingSpec

# A fixed distribution over 8 ids, deliberately not in id order.
LOGITS8 = [1.2, 2.0, -0.3, 0.9, 1.6, -1.0, 0.4, 0.1]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_batch(
    temperature: Sequence[float],
    top_p: Sequence[float] | None = None,
    top_k: Sequence[int] | None = None,
    seed: Sequence[int] | None = None,
    max_logprobs: int = 0,
    device: str = "cpu",
) -> SamplingBatch:
    n = len(temperature)
    top_p, top_k = top_p or [1.0] * n, top_k or [0] * n
    return SamplingBatch(
        temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
        top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
        seed=torch.tensor(seed or [0] * n, dtype=torch.int64, device=device),
        all_greedy=all(t == 0 for t in temperature),
        max_logprobs=max_logprobs,
        cuts=any(SamplingSpec(*row).cuts for row in zip(temperature, top_p, top_k, strict=True)),
    )


def reference_probs(
    logits: Sequence[float], temperature: float, top_k: int, top_p: float, min_p: float = 0.0
) -> list[float]:
    """The sampling rule enumerated in float64, written independently of the sampler."""
    order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    if temperature == 0.0:
        return [float(i == order[0]) for i in range(len(logits))]
    best = math.exp(logits[order[0]] / temperature)
    order = [i for i in order if math.exp(logits[i] / temperature) >= min_p * best]
    if top_k > 0:
        order = order[:top_k]
    top = max(logits[i] for i in order) / temperature
    weights = {i: math.exp(logits[i] / temperature - top) for i in order}
    total = sum(weights.values())
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p and top_p < 1.0:
            break
        kept.append(i)
        mass += weights[i] / total
    kept_total = sum(weights[i] for i in kept)
    return [weights[i] / kept_total if i in kept else 0.0 for i in range(len(logits))]


def upper_gamma_regularized(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a): power series below a + 1, continued fraction above."""
    if x <= 0.0:
        return 1.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1.0:
        term = total = 1.0 / a
        n = 1
        while abs(term) > 1e-16 * abs(total):
            term *= x / (a + n)
            total += term
            n += 1
        return max(0.0, 1.0 - total * math.exp(log_front))
    # Modified Lentz evaluation of Gamma(a, x) e^x x^-a = 1/(x+1-a- 1(1-a)/(x+3-a- ...)).
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    result = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = b + an / c
        c = c if abs(c) > tiny else tiny
        result *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return math.exp(log_front) * result


def chi_square_p(counts: Sequence[int], probs: Sequence[float]) -> float:
    """Goodness-of-fit p-value; an observation where the model says 0 rejects outright."""
    n = sum(counts)
    if any(c > 0 and p == 0.0 for c, p in zip(counts, probs, strict=True)):
        return 0.0
    cells = [(c, n * p) for c, p in zip(counts, probs, strict=True) if p > 0.0]
    stat = sum((c - e) ** 2 / e for c, e in cells)
    return upper_gamma_regularized((len(cells) - 1) / 2.0, stat / 2.0)


def test_chi_square_helper_matches_closed_forms() -> None:
    for x in (0.1, 1.0, 3.0, 9.0, 40.0):
        assert upper_gamma_regularized(1.0, x / 2) == pytest.approx(math.exp(-x / 2), rel=1e-12)
        assert upper_gamma_regularized(2.0, x / 2) == pytest.approx(
            math.exp(-x / 2) * (1 + x / 2), rel=1e-12
        )
    assert upper_gamma_regularized(0.5, 3.841458820694124 / 2) == pytest.approx(0.05, rel=1e-9)
    assert upper_gamma_regularized(5.0, 18.307038053275146 / 2) == pytest.approx(0.05, rel=1e-9)


# --- greedy ---------------------------------------------------------------------------------


def test_greedy_is_argmax_with_ties_to_lowest_id() -> None:
    logits = torch.tensor(
        [
            [0.0, 3.0, 1.0, 3.0, -2.0],
            [5.0, 5.0, 5.0, 5.0, 5.0],
            [-1.0, -2.0, -3.0, -0.5, -0.5],
        ]
    )
    batch = make_batch([0.0, 0.0, 0.0], seed=[1, 2, 3])
    result = sample(logits, batch, torch.arange(3), vocab_limit=5)
    assert result.tokens.tolist() == [1, 0, 3]
    assert result.tokens.dtype == torch.int64
    probs = processed_probs(logits, batch, vocab_limit=5)
    assert torch.equal(probs, torch.nn.functional.one_hot(result.tokens, 5).float())


def test_vocab_limit_masks_padded_ids() -> None:
    torch.manual_seed(0)
    logits = torch.randn(64, 16)
    logits[:, 12] = 1e4  # a padded id with a huge logit
    temperature = [0.0] * 16 + [1.0] * 48
    batch = make_batch(temperature, seed=list(range(64)), max_logprobs=4)
    for position in range(8):
        result = sample(logits, batch, torch.full((64,), position), vocab_limit=10)
        assert int(result.tokens.max()) < 10
        assert int(result.top_ids.max()) < 10
        assert torch.isfinite(result.logprob).all()
    probs = processed_probs(logits, batch, vocab_limit=10)
    assert probs.shape == (64, 16)
    assert torch.all(probs[:, 10:] == 0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(64))


# --- determinism ----------------------------------------------------------------------------


def test_draws_do_not_depend_on_batch_composition() -> None:
    torch.manual_seed(1)
    vocab = 1000
    # Each request: (logits, temperature, top_p, top_k, seed, position).
    requests = [
        (torch.randn(vocab), 1.0, 1.0, 0, 11, 5),
        (torch.randn(vocab), 0.7, 0.9, 50, 12, 9),
        (torch.randn(vocab), 1.3, 0.95, 0, 13, 0),
        (torch.randn(vocab), 0.0, 1.0, 0, 14, 3),
        (torch.randn(vocab), 0.5, 1.0, 7, 2**62 + 5, 2**33 + 1),
    ]

    def run(order: list[int], extra: int) -> dict[int, int]:
        rows = [requests[i] for i in order]
        noise = torch.randn(extra, vocab)
        logits = torch.cat([torch.stack([r[0] for r in rows]), noise])
        batch = make_batch(
            [r[1] for r in rows] + [0.9] * extra,
            top_p=[r[2] for r in rows] + [1.0] * extra,
            top_k=[r[3] for r in rows] + [0] * extra,
            seed=[r[4] for r in rows] + list(range(extra)),
            max_logprobs=3,
        )
        position = torch.tensor([r[5] for r in rows] + [1] * extra)
        tokens = sample(logits, batch, position, vocab_limit=vocab).tokens.tolist()
        return {i: tokens[j] for j, i in enumerate(order)}

    expected = run([0, 1, 2, 3, 4], extra=0)
    assert run([4, 3, 2, 1, 0], extra=0) == expected
    assert run([2, 0, 4, 1, 3], extra=17) == expected
    assert run([1], extra=3) == {1: expected[1]}
    assert run([4, 2], extra=0) == {i: expected[i] for i in (4, 2)}
    # A batch of rows that cut nothing skips the sort (SamplingBatch.cuts) with the same draws.
    assert run([0, 3], extra=5) == {i: expected[i] for i in (0, 3)}


def test_rows_that_cut_nothing_skip_the_sort_with_the_same_results(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch where no sampled row cuts by top-k or top-p (``SamplingBatch.cuts`` False)
    sorts nothing, and its rows get the tokens and probabilities they get, bit for bit, in a
    batch whose other rows cut (every value is computed in id order either way)."""
    torch.manual_seed(3)
    logits = torch.randn(6, 1000) * 2
    temperature = [1.0, 0.7, 0.0, 1.3, 0.9, 0.5]
    top_p, top_k = [1.0, 1.0, 1.0, 1.0, 0.9, 1.0], [0, 0, 0, 0, 0, 20]
    seed, position = list(range(40, 46)), torch.arange(6) * 3
    cutting = make_batch(temperature, top_p, top_k, seed)
    plain = make_batch(temperature[:4], top_p[:4], top_k[:4], seed[:4])
    assert cutting.cuts and not plain.cuts
    expected = sample(logits, cutting, position, vocab_limit=1000).tokens
    expected_probs = processed_probs(logits, cutting, vocab_limit=1000)
    sorts: list[int] = []
    torch_sort = torch.sort

    def counted(*args: Any, **kwargs: Any) -> Any:
        sorts.append(1)
        return torch_sort(*args, **kwargs)

    monkeypatch.setattr(torch, "sort", counted)
    tokens = sample(logits[:4], plain, position[:4], vocab_limit=1000).tokens
    probs = processed_probs(logits[:4], plain, vocab_limit=1000)
    assert sorts == []
    assert torch.equal(tokens, expected[:4])
    assert torch.equal(probs, expected_probs[:4])


def test_different_positions_seeds_and_draws_differ() -> None:
    vocab = 1000
    logits = torch.zeros(64, vocab)  # uniform distribution: the draw is all in the noise
    batch = make_batch([1.0] * 64, seed=[42] * 64)
    by_position = sample(logits, batch, torch.arange(64), vocab_limit=vocab).tokens
    assert len(set(by_position.tolist())) > 48

    by_seed = sample(
        logits,
        make_batch([1.0] * 64, seed=list(range(64))),
        torch.zeros(64, dtype=torch.int64),
        vocab_limit=vocab,
    ).tokens
    assert len(set(by_seed.tolist())) > 48

    other_draw = sample(logits, batch, torch.arange(64), vocab_limit=vocab, draw=1).tokens
    assert (other_draw != by_position).sum() > 48

    seeds = torch.tensor([7, 7, 8])
    positions = torch.tensor([3, 4, 3])
    u = uniform(seeds, positions, 0, vocab)
    assert not torch.equal(u[0], u[1])
    assert not torch.equal(u[0], u[2])
    assert not torch.equal(u, uniform(seeds, positions, 1, vocab))
    assert torch.equal(u, uniform(seeds, positions, 0, vocab))


# --- exact distributions --------------------------------------------------------------------

CONFIG_FILTERED = (0.7, 5, 0.9)  # temperature, top_k, top_p
CONFIG_PLAIN = (1.0, 0, 1.0)


def draw_counts(samples_per_config: int) -> dict[tuple[float, int, float], list[int]]:
    """Counts over ids for both configs, drawn in one mixed call with some greedy rows."""
    configs = [CONFIG_FILTERED, CONFIG_PLAIN, (0.0, 0, 1.0)]
    n = 2 * samples_per_config + 64
    kinds = torch.arange(n) % 2
    kinds[-64:] = 2
    index = torch.arange(n)
    batch = make_batch(
        [configs[k][0] for k in kinds.tolist()],
        top_k=[configs[k][1] for k in kinds.tolist()],
        top_p=[configs[k][2] for k in kinds.tolist()],
        # Vary both the seed and the position across draws.
        seed=(1000 + index // 5000).tolist(),
    )
    logits = torch.tensor(LOGITS8).expand(n, 8)
    tokens = sample(logits, batch, index % 5000 * 3, vocab_limit=8).tokens
    assert torch.all(tokens[kinds == 2] == 1)
    return {configs[k]: torch.bincount(tokens[kinds == k], minlength=8).tolist() for k in (0, 1)}


@pytest.fixture(scope="module")
def counts() -> dict[tuple[float, int, float], list[int]]:
    return draw_counts(24_000)


@pytest.mark.parametrize("config", [CONFIG_FILTERED, CONFIG_PLAIN])
def test_samples_follow_the_rule(
    counts: dict[tuple[float, int, float], list[int]], config: tuple[float, int, float]
) -> None:
    temperature, top_k, top_p = config
    expected = reference_probs(LOGITS8, temperature, top_k, top_p)
    assert sum(counts[config]) == 24_000
    assert chi_square_p(counts[config], expected) > 1e-3


@pytest.mark.parametrize(
    ("config", "wrong"),
    [
        (CONFIG_FILTERED, (0.7, 5, 1.0)),  # top-p cut forgotten
        (CONFIG_FILTERED, (1.0, 5, 0.9)),  # temperature forgotten
        (CONFIG_FILTERED, (0.7, 5, 0.85)),  # top-p cut one token early
        (CONFIG_PLAIN, (0.9, 0, 1.0)),  # a slightly different temperature
    ],
)
def test_wrong_rules_are_rejected(
    counts: dict[tuple[float, int, float], list[int]],
    config: tuple[float, int, float],
    wrong: tuple[float, int, float],
) -> None:
    assert chi_square_p(counts[config], reference_probs(LOGITS8, *wrong)) < 1e-6


def test_processed_probs_match_the_reference() -> None:
    configs = [CONFIG_FILTERED, CONFIG_PLAIN, (0.0, 0, 1.0), (2.0, 3, 1.0), (0.3, 0, 0.5)]
    batch = make_batch(
        [c[0] for c in configs], top_k=[c[1] for c in configs], top_p=[c[2] for c in configs]
    )
    logits = torch.tensor([*LOGITS8, 50.0]).expand(len(configs), 9)  # id 8 is padding
    probs = processed_probs(logits, batch, vocab_limit=8)
    expected = [[*reference_probs(LOGITS8, *c), 0.0] for c in configs]
    torch.testing.assert_close(probs, torch.tensor(expected, dtype=torch.float32))


def test_min_p_cuts_before_top_k_and_top_p() -> None:
    """``min_p`` drops what is less likely than its share of the most likely token (at the
    row's temperature), then top-k and top-p cut what is left."""
    configs = [(1.0, 0, 1.0, 0.3), (0.5, 0, 1.0, 0.3), (1.0, 2, 1.0, 0.5), (1.0, 0, 0.6, 0.2)]
    batch = make_batch(
        [c[0] for c in configs], top_k=[c[1] for c in configs], top_p=[c[2] for c in configs]
    )
    batch.min_p = torch.tensor([c[3] for c in configs])
    logits = torch.tensor(LOGITS8).expand(len(configs), 8)
    expected = [reference_probs(LOGITS8, *c) for c in configs]
    kept = [sum(p > 0 for p in row) for row in expected]
    assert kept == [4, 2, 2, 2]  # each cut bites
    probs = processed_probs(logits, batch, vocab_limit=8)
    torch.testing.assert_close(probs, torch.tensor(expected, dtype=torch.float32))


def test_sample_is_the_race_over_processed_probs() -> None:
    """The contract speculative verification builds on: with the same (seed, position, draw),
    ``sample`` picks ``argmax(processed_probs / -log(uniform))``."""
    torch.manual_seed(4)
    n, vocab = 64, 1000
    logits = torch.randn(n, vocab) * 2
    batch = make_batch(
        [0.0, 0.6, 1.0, 1.4] * 16,
        top_k=[0, 0, 20, 200] * 16,
        top_p=[1.0, 0.8, 1.0, 0.95] * 16,
        seed=list(range(100, 100 + n)),
    )
    probs = processed_probs(logits, batch, vocab_limit=vocab)
    for draw in (0, 3):
        position = torch.arange(n) * 13 + draw
        tokens = sample(logits, batch, position, vocab_limit=vocab, draw=draw).tokens
        exponentials = -torch.log(uniform(batch.seed, position, draw, vocab))
        assert torch.equal(tokens, torch.argmax(probs / exponentials, dim=-1))


def test_top_k_ties_keep_the_lowest_ids() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    probs = processed_probs(logits, make_batch([1.0], top_k=[2]), vocab_limit=5)
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0]]))


def test_top_p_one_keeps_every_token() -> None:
    vocab = 50_000
    logits = torch.zeros(1, vocab)
    logits[0, 0] = 30.0  # float32 mass reaches 1.0 long before the tail
    probs = processed_probs(logits, make_batch([1.0], top_p=[1.0]), vocab_limit=vocab)
    assert bool((probs > 0).all())


# --- uniform() ------------------------------------------------------------------------------


def test_uniform_range_mean_and_histogram() -> None:
    seeds = torch.tensor([0, 1, 2**63 - 1, 987654321])
    u = uniform(seeds, torch.tensor([0, 17, 2**40, 3]), 0, 1 << 16)
    assert u.shape == (4, 1 << 16) and u.dtype == torch.float32
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.double().mean()) - 0.5) < 0.003
    bins = torch.bincount((u * 64).long().flatten(), minlength=64).tolist()
    assert chi_square_p(bins, [1 / 64] * 64) > 1e-3


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def test_uniform_has_no_correlation_between_neighbours() -> None:
    vocab = 4096
    positions = torch.arange(65)
    by_position = uniform(torch.full((65,), 5), positions, 0, vocab)
    assert abs(correlation(by_position[:, :-1], by_position[:, 1:])) < 0.01  # adjacent ids
    assert abs(correlation(by_position[:-1], by_position[1:])) < 0.01  # adjacent positions
    by_seed = uniform(torch.arange(65), torch.zeros(65, dtype=torch.int64), 0, vocab)
    assert abs(correlation(by_seed[:-1], by_seed[1:])) < 0.01  # adjacent seeds
    other_draw = uniform(torch.full((65,), 5), positions, 1, vocab)
    assert abs(correlation(by_position, other_draw)) < 0.01  # adjacent draws


def test_uniform_is_pinned() -> None:
    # Computed once from the hash; a change here changes every seeded output in production.
    seeds = torch.tensor([0, 1, 2**63 - 1, 123456789])
    positions = torch.tensor([0, 1, 2**31 + 3, 7])
    columns = [0, 1, 2, 151935, 199999]
    expected = {
        0: [
            [16597207, 6888963, 9811651, 8756589, 14958205],
            [821573, 3295843, 10259633, 8239219, 11240003],
            [14583489, 16502621, 15071083, 16181903, 8987711],
            [490531, 92411, 5750943, 13699053, 3672321],
        ],
        1: [
            [13277379, 4109423, 16173377, 7171291, 5073543],
            [13660523, 9027041, 14876947, 5840697, 16156117],
            [14081135, 2987293, 3779047, 3168583, 2041037],
            [12673681, 9239325, 12241219, 6655815, 5285039],
        ],
    }
    for draw, values in expected.items():
        u = uniform(seeds, positions, draw, 200_000)[:, columns]
        # u is an odd multiple of 2^-24, so this scaling is exact.
        assert (u * 2**24).long().tolist() == values


def test_uniform_follows_the_documented_construction() -> None:
    """The module docstring's hash, re-derived with Python ints."""
    mask = 0xFFFFFFFF

    def mix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x21F0AAAD) & mask
        x ^= x >> 15
        x = (x * 0x735A2D97) & mask
        return x ^ (x >> 15)

    def reference(seed: int, position: int, draw: int, token: int) -> float:
        lanes = []
        for init in (0x6A09E667, 0xBB67AE85):
            key = mix(mix(init ^ draw) ^ (seed & mask))
            key = mix(key ^ (seed >> 32))
            lanes.append(mix(key ^ (position & mask)))
        h = mix(mix(token ^ lanes[0]) ^ lanes[1])
        return ((h >> 9) + 0.5) / 2**23

    cases = [(3, 9, 0), (2**62 + 11, 2**20, 5), (2**63 - 1, 0, 2**32 - 1)]
    u = torch.cat([uniform(torch.tensor([s]), torch.tensor([p]), d, 70_000) for s, p, d in cases])
    for row, (s, p, d) in enumerate(cases):
        for token in (0, 1, 31, 4097, 69_999):
            assert float(u[row, token]) == reference(s, p, d, token)


# --- logprobs -------------------------------------------------------------------------------


@pytest.mark.parametrize("max_logprobs", [0, 1, 5])
def test_logprobs_are_raw_log_softmax(max_logprobs: int) -> None:
    torch.manual_seed(2)
    logits = torch.randn(6, 50) * 3
    batch = make_batch(
        [0.0, 0.5, 1.0, 1.5, 0.0, 0.8],
        top_k=[0, 3, 0, 10, 0, 0],
        top_p=[1.0, 1.0, 0.5, 0.9, 1.0, 0.7],
        seed=[1, 2, 3, 4, 5, 6],
        max_logprobs=max_logprobs,
    )
    result = sample(logits, batch, torch.arange(6), vocab_limit=50)
    reference = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(result.logprob, reference.gather(1, result.tokens[:, None])[:, 0])
    values, ids = reference.topk(max_logprobs, dim=-1)
    assert result.top_ids.shape == (6, max_logprobs)
    assert result.top_ids.dtype == torch.int64
    assert torch.equal(result.top_ids, ids)
    torch.testing.assert_close(result.top_logprobs, values)


def test_batch_from_specs() -> None:
    specs = [
        SamplingSpec(),
        SamplingSpec(temperature=0.7, top_p=0.9, top_k=5, seed=2**63 - 1, logprobs=3),
    ]
    batch = SamplingBatch.from_specs(specs)
    assert batch.temperature.tolist() == pytest.approx([0.0, 0.7])
    assert batch.top_k.tolist() == [0, 5]
    assert batch.seed.tolist() == [0, 2**63 - 1]
    assert not batch.all_greedy and batch.max_logprobs == 3
    assert SamplingBatch.from_specs(specs[:1]).all_greedy


def test_bad_arguments_are_refused() -> None:
    logits = torch.zeros(2, 8)
    batch = make_batch([1.0, 0.0], max_logprobs=3)
    with pytest.raises(ValueError, match="vocab_limit"):
        sample(logits, batch, torch.zeros(2, dtype=torch.int64), vocab_limit=9)
    with pytest.raises(ValueError, match="max_logprobs"):
        sample(logits, batch, torch.zeros(2, dtype=torch.int64), vocab_limit=2)
    with pytest.raises(ValueError, match="draw"):
        uniform(batch.seed, torch.zeros(2, dtype=torch.int64), 2**32, 8)


# --- CUDA -----------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cuda_inputs(n: int = 16, vocab: int = 4096) -> tuple[torch.Tensor, SamplingBatch, torch.Tensor]:
    torch.manual_seed(3)
    logits = torch.randn(n, vocab, device="cuda") * 2
    batch = make_batch(
        [0.0, 0.7, 1.0, 1.3] * (n // 4),
        top_k=[0, 40, 0, 7] * (n // 4),
        top_p=[1.0, 0.9, 0.95, 1.0] * (n // 4),
        seed=list(range(n)),
        max_logprobs=5,
        device="cuda",
    )
    return logits, batch, torch.arange(n, device="cuda") * 7


@pytest.mark.gpu
@needs_cuda
def test_cuda_sample_does_not_synchronise() -> None:
    logits, batch, position = cuda_inputs()
    # Warm-up (and the first compilation) outside the check.
    sample(logits, batch, position, vocab_limit=4000)
    processed_probs(logits, batch, vocab_limit=4000)
    uniform(batch.seed, position, 0, 4096)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = sample(logits, batch, position, vocab_limit=4000, draw=1)
        probs = processed_probs(logits, batch, vocab_limit=4000)
        u = uniform(batch.seed, position, 2, 4096)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert result.tokens.device.type == probs.device.type == u.device.type == "cuda"


@pytest.mark.gpu
@needs_cuda
def test_cuda_matches_cpu_and_replays_in_a_graph() -> None:
    logits, batch, position = cuda_inputs()
    u_cuda = uniform(batch.seed, position, 0, 4096)
    u_cpu = uniform(batch.seed.cpu(), position.cpu(), 0, 4096)
    assert torch.equal(u_cuda.cpu(), u_cpu)

    on_cuda = sample(logits, batch, position, vocab_limit=4000)
    cpu_batch = make_batch(
        batch.temperature.tolist(),
        top_k=batch.top_k.tolist(),
        top_p=batch.top_p.tolist(),
        seed=batch.seed.tolist(),
        max_logprobs=5,
    )
    on_cpu = sample(logits.cpu(), cpu_batch, position.cpu(), vocab_limit=4000)
    assert torch.equal(on_cuda.tokens.cpu(), on_cpu.tokens)
    row = slice(5, 6)  # a batch of one draws the same tokens
    alone = SamplingBatch(
        batch.temperature[row], batch.top_p[row], batch.top_k[row], batch.seed[row], False, 0
    )
    assert torch.equal(
        sample(logits[row], alone, position[row], vocab_limit=4000).tokens, on_cuda.tokens[row]
    )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sample(logits, batch, position, vocab_limit=4000)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sample(logits, batch, position, vocab_limit=4000)
    position.add_(1)  # inputs change in place between replays, as in the graph runner
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.tokens, sample(logits, batch, position, vocab_limit=4000).tokens)
