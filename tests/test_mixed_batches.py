"""Decoding rows riding prompt batches (``SchedulerLimits.mixed_batches``), through the
in-process engine (float32 on CPU): the same tokens and logprobs as with the batches apart,
greedy and seeded sampling, through the overlap loop and the serial one, with prompts
chunked and arriving while others decode; rows that adjust their logits or draw under a
grammar keep to decode batches; a speculative engine refuses them."""

from __future__ import annotations

import argparse
import random
from typing import Any

import msgspec
import pytest
from engine_harness import debug_checks_fixture, engine_for, request, run
from model_fixtures import VOCAB

from outrider.daemon.config import MIXED_NEEDS_NO_SPECULATION, ConfigError
from outrider.daemon.engine.build import Engine
from outrider.daemon.engine.plan import StepPlan
from outrider.daemon.flags import add_serve_arguments, resolve
from outrider.daemon.internal import TokenizedRequest
from outrider.daemon.scheduler.request import Request
from outrider.plugins.sampling_spec import SamplingSpec

debug_checks = debug_checks_fixture()


def workload() -> list[TokenizedRequest]:
    """Prompts of 3 to 70 tokens (several chunks at a budget of 24), greedy and seeded
    sampled, some asking for logprobs, outputs of 4 to 20 tokens."""
    rng = random.Random(7)
    reqs = []
    for rid in range(12):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 70))]
        sampled = rid % 3 == 1
        reqs.append(
            request(
                rid,
                prompt,
                max_new_tokens=rng.randint(4, 20),
                temperature=0.8 if sampled else 0.0,
                seed=100 + rid,
                top_k=20 if sampled else 0,
                logprobs=2 if rid % 4 == 0 else 0,
            )
        )
    return reqs


def served(engine: Engine, reqs: list[TokenizedRequest]) -> tuple[dict[int, Any], list[StepPlan]]:
    """Each request's tokens, finish and logprobs, and every plan launched."""
    plans: list[StepPlan] = []
    launch = engine.loop.runner.launch

    def recorded(plan: StepPlan, *args: object, **kwargs: object) -> object:
        plans.append(plan)
        return launch(plan, *args, **kwargs)  # type: ignore[arg-type]  # passed through

    engine.loop.runner.launch = recorded  # type: ignore[method-assign]
    outcomes = run(engine, reqs, stagger=3)
    finals: dict[int, Any] = {}
    for rid, outcome in outcomes.items():
        logprobs = [
            (lp.token_id, lp.logprob, lp.top) for u in outcome.updates for lp in (u.logprobs or [])
        ]
        finish = outcome.finish
        finals[rid] = (outcome.token_ids, finish.reason, finish.usage.completion_tokens, logprobs)
    return finals, plans


def assert_same(mixed: dict[int, Any], apart: dict[int, Any]) -> None:
    """The same tokens, finishes and logprobs' ids; the logprobs' values within float32's
    rounding (a row's attention sums in another order in a prompt batch)."""
    assert mixed.keys() == apart.keys()
    for rid, (tokens, reason, count, logprobs) in mixed.items():
        assert (tokens, reason, count) == apart[rid][:3], rid
        expected = apart[rid][3]
        assert [(t, [i for i, _ in top]) for t, _, top in logprobs] == [
            (t, [i for i, _ in top]) for t, _, top in expected
        ], rid
        values = [v for _, lp, top in logprobs for v in (lp, *(x for _, x in top))]
        wanted = [v for _, lp, top in expected for v in (lp, *(x for _, x in top))]
        assert values == pytest.approx(wanted, abs=1e-4), rid


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_decoding_rows_ride_prompt_chunks_and_the_outputs_do_not_change(
    llama_dir: str, overlap: bool
) -> None:
    settings = {"chunked_prefill_tokens": 24, "page_size": 4, "no_overlap": not overlap}
    apart, apart_plans = served(engine_for(llama_dir, **settings), workload())
    mixed, mixed_plans = served(engine_for(llama_dir, mixed_batches=True, **settings), workload())
    assert_same(mixed, apart)
    assert not any(p.relay_rows for p in apart_plans)
    riding = [p for p in mixed_plans if p.relay_rows]
    assert len(riding) >= 5, [p.kind for p in mixed_plans]
    for plan in riding:
        assert plan.kind == "extend" and plan.num_tokens <= 24
        assert all(plan.q_lens[row] == 1 for row in plan.relay_rows)
        assert set(plan.relay_rows) <= set(plan.sample_rows)
    # Decoding never waits for a prompt batch: fewer steps than with the batches apart.
    assert len(mixed_plans) < len(apart_plans)


def test_a_row_that_adjusts_its_logits_keeps_to_decode_batches(llama_dir: str) -> None:
    """A row with a penalty waits for a decode batch while its neighbours ride, and every
    row's tokens are those it gets with the batches apart (grammar rows are held out by the
    same rule: planner.py)."""
    reqs = workload()[:6]
    penalised = reqs[2]
    reqs[2] = msgspec.structs.replace(
        penalised, sampling=SamplingSpec(0.0, 1.0, 0, 0, 0, presence_penalty=1.5)
    )
    settings = {"chunked_prefill_tokens": 24, "page_size": 4}
    apart, _ = served(engine_for(llama_dir, **settings), list(reqs))
    engine = engine_for(llama_dir, mixed_batches=True, **settings)
    planner = engine.loop.scheduler.planner
    chosen = planner._riders
    rode: set[int] = set()

    def riders(*args: object) -> list[Request]:
        picked = chosen(*args)  # type: ignore[arg-type]  # passed through
        rode.update(r.rid for r in picked)
        return picked

    planner._riders = riders  # type: ignore[method-assign]
    mixed, _ = served(engine, list(reqs))
    assert_same(mixed, apart)
    assert penalised.rid not in rode and len(rode) >= 3, rode


def test_a_speculative_engine_refuses_mixed_batches(llama_dir: str, eagle3_dir: str) -> None:
    """Its decoding rows' positions are known on the host a step late and its draft keeps
    state: the flag is refused at start, by the CLI and by the engine's builder."""
    with pytest.raises(ConfigError) as refused:
        engine_for(
            llama_dir, speculative_algorithm="eagle3", draft_model=eagle3_dir, mixed_batches=True
        )
    assert str(refused.value) == MIXED_NEEDS_NO_SPECULATION
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    argv = ["--model", llama_dir, "--speculative-algorithm", "ngram", "--mixed-batches"]
    with pytest.raises(ConfigError) as refused:
        resolve(parser.parse_args(argv), environ={})
    assert str(refused.value) == MIXED_NEEDS_NO_SPECULATION
    assert resolve(parser.parse_args(argv[:2] + argv[4:]), environ={}).mixed_batches
