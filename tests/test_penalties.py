"""Logit adjustments (daemon/engine/penalties.py) and ``min_p``: the rules node by node against
a reference written from their definitions, verify paths of chains and trees with repeated
tokens included; greedy outputs of the engine equal transformers' model decoded under the same
rules; every draft algorithm keeps the target-only tokens (greedy, and seeded sampling with
deterministic drafts) through the overlap loop and the serial one; ``min_p`` 1 is greedy;
bad values are refused."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import msgspec
import pytest
import torch
from engine_harness import (
    DRAFT_ALGORITHMS,
    debug_checks_fixture,
    engine_for,
    request,
    run,
    tokens_of,
)
from model_fixtures import VOCAB, mixed_prompts, save_drafts, save_tiny_model

from outrider.daemon.engine.accept import tree_geometry
from outrider.daemon.engine.penalties import LogitAdjust, Seen, adjusted_logits
from outrider.daemon.internal import TokenizedRequest
from outrider.plugins.sampling_spec import (
    Adjustments,
    SamplingError,
    SamplingSpec,
    resolve_sampling,
)

debug_checks = debug_checks_fixture()

NEW_TOKENS = 12
PROMPTS = mixed_prompts(7, 4)
# Each request's adjustments: every rule alone, all together, and none.
ADJUSTED = [
    Adjustments(presence_penalty=1.5),
    Adjustments(frequency_penalty=0.7),
    Adjustments(repetition_penalty=1.8),
    Adjustments(logit_bias={7: 4.0, 11: -100.0, 250: 2.5}),
    Adjustments(
        presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={9: 1.5}
    ),
    Adjustments(),
]


def _reference(
    logits: torch.Tensor, adjust: Adjustments, output: list[int], prompt: list[int]
) -> torch.Tensor:
    """One position's adjusted logits from the rules' definitions, token by token."""
    x = logits.clone()
    for token, bias in adjust.logit_bias.items():
        x[token] += bias
    counts = Counter(output)
    for token in set(prompt) | set(counts):
        x[token] = (
            x[token] / adjust.repetition_penalty
            if x[token] > 0
            else (x[token] * adjust.repetition_penalty)
        )
    for token, count in counts.items():
        x[token] -= adjust.frequency_penalty * count + adjust.presence_penalty
    return x


def _device_adjust(adjustments: list[Adjustments]) -> LogitAdjust:
    width = max(len(a.logit_bias) for a in adjustments)
    ids = torch.zeros(len(adjustments), width, dtype=torch.int64)
    values = torch.zeros(len(adjustments), width)
    for r, a in enumerate(adjustments):
        for c, (token, bias) in enumerate(a.logit_bias.items()):
            ids[r, c], values[r, c] = token, bias
    return LogitAdjust(
        presence=torch.tensor([a.presence_penalty for a in adjustments]),
        frequency=torch.tensor([a.frequency_penalty for a in adjustments]),
        repetition=torch.tensor([a.repetition_penalty for a in adjustments]),
        bias_ids=ids,
        bias_values=values,
    )


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_each_node_sees_the_output_of_its_own_path(shape: str) -> None:
    """Rows of 6 nodes whose path tokens repeat each other, the root's, the output's and the
    prompt's: every node's logits are those of a decode whose output ends with its path."""
    gen = torch.Generator().manual_seed(3)
    n, width, vocab = len(ADJUSTED), 6, VOCAB
    logits = torch.randn(n, width, vocab, generator=gen) * 4
    outputs = [torch.randint(0, 12, (5,), generator=gen).tolist() for _ in range(n)]
    prompts = [torch.randint(0, 12, (7,), generator=gen).tolist() for _ in range(n)]
    tokens = torch.randint(0, 12, (n, width), generator=gen)
    tokens[:, 0] = torch.tensor([out[-1] for out in outputs])  # the root: the last output
    tokens[:, 3] = tokens[:, 1]  # a token twice on one path
    if shape == "chain":
        visible = torch.ones(width, width, dtype=torch.bool).tril().expand(n, -1, -1)
    else:  # root -> 1 -> 3 -> 5, root -> 2 -> 4
        parents = torch.tensor([[0, 0, 1, 2, 3]]).expand(n, -1)
        _, visible = tree_geometry(parents, 3)
    counts = torch.zeros(n, vocab, dtype=torch.int32)
    prompt_seen = torch.zeros(n, vocab, dtype=torch.bool)
    for r in range(n):
        for t in outputs[r]:
            counts[r, t] += 1
        prompt_seen[r, prompts[r]] = True
    out = adjusted_logits(
        logits, _device_adjust(ADJUSTED), Seen(counts, prompt_seen), (tokens, visible)
    )
    for r, adjust in enumerate(ADJUSTED):
        for j in range(width):
            path = [int(tokens[r, i]) for i in range(1, width) if visible[r, j, i]]
            expected = _reference(logits[r, j], adjust, outputs[r] + path, prompts[r])
            torch.testing.assert_close(out[r, j], expected, rtol=0, atol=1e-5)


def _adjusted_request(
    rid: int, prompt: list[int], adjust: Adjustments, **sampling: float
) -> TokenizedRequest:
    spec = resolve_sampling(
        sampling.get("temperature", 0.0), 1.0, 0, defaults=SamplingSpec(), seed=rid,
        vocab_size=VOCAB, adjustments=adjust,
    )  # fmt: skip
    return msgspec.structs.replace(request(rid, prompt, max_new_tokens=NEW_TOKENS), sampling=spec)


def _requests(**sampling: float) -> list[TokenizedRequest]:
    """Every prompt under every adjustment."""
    return [
        _adjusted_request(len(ADJUSTED) * p + a, prompt, adjust, **sampling)
        for p, prompt in enumerate(PROMPTS)
        for a, adjust in enumerate(ADJUSTED)
    ]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str], torch.nn.Module]:
    """The tiny llama, its random drafts, and transformers' model of it."""
    root = tmp_path_factory.mktemp("penalties")
    with torch.no_grad():
        hf = save_tiny_model("llama", root / "target")
    return str(root / "target"), save_drafts(root / "drafts", root / "target"), hf


@pytest.fixture(scope="module")
def plain_greedy(target: tuple[str, dict[str, str], torch.nn.Module]) -> dict[int, list[int]]:
    return tokens_of(run(engine_for(target[0]), _requests()))


def test_greedy_outputs_are_transformers_decoded_under_the_rules(
    target: tuple[str, dict[str, str], torch.nn.Module], plain_greedy: dict[int, list[int]]
) -> None:
    hf = target[2]
    expected = {}
    with torch.no_grad():
        for req in _requests():
            adjust = Adjustments(
                presence_penalty=req.sampling.presence_penalty,
                frequency_penalty=req.sampling.frequency_penalty,
                repetition_penalty=req.sampling.repetition_penalty,
                logit_bias=dict(req.sampling.logit_bias),
            )
            output: list[int] = []
            for _ in range(NEW_TOKENS):
                logits = hf(torch.tensor([req.input_ids + output])).logits[0, -1].float()
                scores = _reference(logits, adjust, output, req.input_ids)
                output.append(int(scores.argmax()))
            expected[req.rid] = output
    assert plain_greedy == expected
    # The rules change the outputs: each adjusted request differs from the unadjusted one.
    none = len(ADJUSTED) - 1
    for p in range(len(PROMPTS)):
        for a in range(none):
            assert expected[len(ADJUSTED) * p + a] != expected[len(ADJUSTED) * p + none]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("algorithm", [*DRAFT_ALGORITHMS, "itself"])
def test_drafts_keep_the_adjusted_greedy_tokens(
    target: tuple[str, dict[str, str], torch.nn.Module],
    plain_greedy: dict[int, list[int]],
    algorithm: str,
    overlap: bool,
) -> None:
    """``itself``: the target as its own standalone draft, whose unadjusted drafts are
    accepted until an adjustment changes the target's choice."""
    directory, drafts, _ = target
    if algorithm == "itself":
        settings: dict[str, object] = {
            "speculative_algorithm": "standalone",
            "draft_model": directory,
        }
    else:
        settings = dict(DRAFT_ALGORITHMS[algorithm])
        name = str(settings["speculative_algorithm"])
        if name in drafts:
            settings["draft_model"] = drafts[name]
    engine = engine_for(directory, no_overlap=not overlap, **settings)
    assert tokens_of(run(engine, _requests())) == plain_greedy
    counters = engine.scheduler.counters()
    assert counters.spec_drafts > 0
    if algorithm == "itself":
        assert 0 < counters.spec_accepted_tokens < 3 * counters.spec_drafts


@pytest.mark.parametrize("algorithm", ["ngram", "dflash", "eagle3 tree"])
def test_seeded_sampling_under_the_rules_keeps_the_target_only_draws(
    target: tuple[str, dict[str, str], torch.nn.Module], algorithm: str
) -> None:
    directory, drafts, _ = target
    plain = tokens_of(run(engine_for(directory), _requests(temperature=0.8)))
    settings = dict(DRAFT_ALGORITHMS[algorithm])
    name = str(settings["speculative_algorithm"])
    if name in drafts:
        settings["draft_model"] = drafts[name]
    engine = engine_for(directory, **settings)
    assert tokens_of(run(engine, _requests(temperature=0.8))) == plain


@pytest.mark.parametrize("algorithm", ["none", "eagle3 chain"])
def test_min_p_of_one_keeps_only_the_most_likely_token(
    target: tuple[str, dict[str, str], torch.nn.Module],
    plain_greedy: dict[int, list[int]],
    algorithm: str,
) -> None:
    directory, drafts, _ = target
    settings: dict[str, object] = {"speculative_algorithm": "none"}
    if algorithm != "none":
        settings = dict(DRAFT_ALGORITHMS[algorithm]) | {"draft_model": drafts["eagle3"]}
    cut = [
        msgspec.structs.replace(
            r, sampling=msgspec.structs.replace(r.sampling, temperature=1.0, min_p=1.0)
        )
        for r in _requests()
    ]
    assert tokens_of(run(engine_for(directory, **settings), cut)) == plain_greedy


def test_out_of_range_adjustments_are_refused() -> None:
    with pytest.raises(SamplingError, match="logit_bias names token 300: vocab_size is 300"):
        resolve_sampling(
            0.0, None, None, defaults=SamplingSpec(), vocab_size=VOCAB,
            adjustments=Adjustments(logit_bias={300: 1.0}),
        )  # fmt: skip


def test_a_request_without_adjustments_adjusts_nothing(tmp_path: Path) -> None:
    spec = resolve_sampling(0.0, None, None, defaults=SamplingSpec(), seed=1)
    assert not spec.adjusts and spec.min_p == 0.0
    biased = resolve_sampling(
        0.0, None, None, defaults=SamplingSpec(), seed=1,
        adjustments=Adjustments(logit_bias={5: 0.5, 2: -1.0}),
    )  # fmt: skip
    assert biased.adjusts and biased.logit_bias == ((2, -1.0), (5, 0.5))
