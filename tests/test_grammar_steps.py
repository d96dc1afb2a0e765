"""Constrained steps through the loop and graphs: a decode batch takes grammar rows whose step
is still in flight (late masks), drafting or not, with the serial loop's tokens; steps with
grammar rows replay graphs cut where they wait for the host's masks, with the eager engine's
tokens."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from engine_harness import (
    DRAFT_ALGORITHMS,
    EagerGraphs,
    Outcome,
    debug_checks_fixture,
    engine_for,
    record_launches,
    run,
)
from grammar_cases import (
    check_outputs,
    grammar_fixtures,
    grammar_requests,
)

from outrider.daemon.engine.build import Engine
from outrider.daemon.grammar.compiler import Grammars
from outrider.daemon.scheduler.drafting import AlternateDrafting
from outrider.daemon.scheduler.planner import Planned
from outrider.daemon.scheduler.request import Request
from outrider.daemon.tokenizer import Tokenizer

debug_checks = debug_checks_fixture()
_model_dir, _tokenizer, _grammars, _drafts = grammar_fixtures()


@pytest.mark.parametrize(
    ("algorithm", "grammar_drafts"),
    [("none", False), ("eagle3 chain", True), ("eagle3 chain", False)],
    ids=["none", "eagle3-drafting", "eagle3-plain"],
)
def test_a_batch_takes_grammar_rows_whose_step_is_in_flight(
    model_dir: Path,
    tokenizer: Tokenizer,
    grammars: Grammars,
    drafts: dict[str, str],
    algorithm: str,
    grammar_drafts: bool,
) -> None:
    """Late masks (scheduler/loop.py): through the overlap loop a batch holds grammar rows
    whose previous step is still in flight; the host computes their masks inside the step,
    once it has processed that step; greedy and seeded tokens are the serial loop's. Under
    speculation such batches draft, or, with ``grammar_drafts`` off (as on tensor-parallel
    ranks), are plain while the batches without them draft."""
    settings: dict[str, object] = {}
    if algorithm != "none":
        settings |= dict(DRAFT_ALGORITHMS[algorithm], draft_model=drafts["eagle3"])
    for temperature in (0.0, 1.0):
        reference = _target_only(model_dir, grammars, temperature)
        engine = engine_for(str(model_dir), **settings)
        planner = engine.scheduler.planner
        assert planner.limits.late_masks and engine.loop.overlap
        planner.limits = replace(planner.limits, grammar_drafts=grammar_drafts)
        late_rows, drafting_rows = _count_rows(engine)
        outcomes = run(engine, grammar_requests(temperature), grammars=grammars)
        for rid, outcome in reference.items():
            assert outcomes[rid].token_ids == outcome.token_ids, (temperature, rid)
        check_outputs(outcomes, tokenizer)
        # Constrained rows rode behind their own steps, in most of their steps.
        steps = sum(len(o.token_ids) for rid, o in outcomes.items() if rid < 100)
        if grammar_drafts:
            steps //= 2  # a drafting step commits more than one token
        assert late_rows["grammar"] > steps // 2, (late_rows, steps)
        assert (drafting_rows["grammar"] > 0) == grammar_drafts, drafting_rows
        assert (drafting_rows["free"] > 0) == (algorithm != "none")


def _target_only(model_dir: Path, grammars: Grammars, temperature: float) -> dict[int, Outcome]:
    """``grammar_requests(temperature)`` through the target alone, the serial loop."""
    engine = engine_for(str(model_dir), no_overlap=True)
    return run(engine, grammar_requests(temperature), grammars=grammars)


def _count_rows(engine: Engine) -> tuple[Counter[str], Counter[str]]:
    """Counters, filled as ``engine`` plans: rows planned while a step of theirs was in
    flight, and rows of drafting batches, by whether they draw under a grammar."""
    late: Counter[str] = Counter()
    drafting: Counter[str] = Counter()
    schedule = engine.scheduler.schedule

    def counted() -> Planned | None:
        planned = schedule()
        if planned is not None and planned.plan.kind == "decode":
            for req in planned.requests:
                kind = "free" if req.grammar is None else "grammar"
                late[kind] += req.steps_in_flight > 1
                drafting[kind] += planned.plan.drafting
        return planned

    engine.scheduler.schedule = counted  # type: ignore[method-assign]
    return late, drafting


@pytest.mark.parametrize("algorithm", ["eagle3 chain", "eagle3 tree", "dflash"])
def test_grammar_rows_in_steps_cut_short_keep_the_target_only_tokens(
    model_dir: Path,
    tokenizer: Tokenizer,
    grammars: Grammars,
    drafts: dict[str, str],
    algorithm: str,
) -> None:
    """Drafting batches take the shape at each of its sizes in turn (a chain's depths, a
    tree's best nodes, a shorter DFlash block; plain steps between), grammar rows among them
    through the overlap loop: greedy and seeded tokens are the target-only serial loop's and
    every output stays within its grammar."""
    settings = dict(DRAFT_ALGORITHMS[algorithm], draft_model=drafts[algorithm.split()[0]])
    for temperature in (0.0, 1.0):
        reference = _target_only(model_dir, grammars, temperature)
        engine = engine_for(str(model_dir), **settings)
        widths = tuple(cut.width for cut in engine.loop.runner.shape.cuts())
        assert len(widths) > 2
        policy = AlternateDrafting(widths)
        engine.scheduler.use_policy(policy)
        outcomes = run(engine, grammar_requests(temperature), grammars=grammars)
        for rid, outcome in reference.items():
            assert outcomes[rid].token_ids == outcome.token_ids, (temperature, rid)
        check_outputs(outcomes, tokenizer)
        assert set(policy.decisions) == {1, *widths}


class EveryOtherBatchDrafts:
    """A drafting policy: every other decode batch drafts ``width`` tokens a row; every
    request feeds the draft."""

    def __init__(self, width: int) -> None:
        self.full, self.batches = width, 0

    def width(self, rows: list[Request]) -> int:
        self.batches += 1
        return self.full if self.batches % 2 == 0 else 1

    def feeds(self, req: Request, others: int) -> bool:
        return True

    def observe(
        self, req: Request, commit_len: int, drafts: int, ranks: list[int], rows: int
    ) -> None:
        pass


SEGMENTED_CASES = [("cpu", "none"), ("cpu", "eagle3 chain"), ("cpu", "dflash")] + [
    pytest.param("cuda", algorithm, marks=pytest.mark.gpu)
    for algorithm in ("none", *DRAFT_ALGORITHMS)
]


@pytest.mark.parametrize(("device", "algorithm"), SEGMENTED_CASES)
def test_steps_with_grammar_rows_replay_graphs_in_segments(
    model_dir: Path,
    tokenizer: Tokenizer,
    grammars: Grammars,
    drafts: dict[str, str],
    algorithm: str,
    device: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode steps holding grammar rows replay graphs of their own, cut where they wait for
    the host's masks (on the CPU through the runner's capture path, replayed eagerly with
    each fill run at its cut; on CUDA real graphs, every launch under the sync check), beside
    the graphs of batches without them: greedy and seeded tokens are the eager engine's.
    Under speculation every other batch drafts, its grammar rows too (a cut before each draft
    place, after a later place's paths are copied where a forward comes before the place,
    after the drafts' copy and before the verify)."""
    monkeypatch.setenv("OUTRIDER_DEBUG_SYNC_CHECK", "1")
    monkeypatch.delenv("OUTRIDER_DEBUG_RELAY_CHECK")  # graphs are off under it (build.py)
    settings: dict[str, object] = {"device": device}
    if algorithm != "none":
        settings |= dict(DRAFT_ALGORITHMS[algorithm])
        if algorithm != "ngram":
            settings["draft_model"] = drafts[algorithm.split()[0]]
    graphed = engine_for(str(model_dir), **settings)
    eager = engine_for(str(model_dir), disable_cuda_graph=True, **settings)
    runner = graphed.loop.runner
    if device == "cpu":
        widths = tuple(sorted({runner.shape.width, 1}, reverse=True))
        runner.graphs = EagerGraphs(8, 256, 20, runner.slots.scratch_slot, widths=widths)
    assert runner.graphs is not None and eager.loop.runner.graphs is None
    if algorithm != "none":
        for built in (graphed, eager):
            built.scheduler.use_policy(EveryOtherBatchDrafts(runner.shape.width))
    for temperature in (0.0, 1.0):
        expected = run(eager, grammar_requests(temperature), grammars=grammars)
        outcomes = run(graphed, grammar_requests(temperature), grammars=grammars)
        for rid, outcome in expected.items():
            assert outcomes[rid].token_ids == outcome.token_ids, (temperature, rid)
        check_outputs(outcomes, tokenizer)
    masked = {key for key in runner.graphs.graphs if key.masked}
    # Host waits per key: counted over the CPU's replays, the captured segments on CUDA.
    if device == "cpu":
        cuts = runner.graphs.cuts
    else:
        cuts = Counter({key: len(segments) for key, segments in runner.graphs.segments.items()})
    assert any(key.width == 1 for key in masked) and set(cuts) == masked
    drafting = {key for key in masked if key.width > 1}
    assert bool(drafting) == (algorithm != "none")
    if algorithm == "eagle3 chain":
        # A cut at each of the chain's 3 draft places, after the 2 later places' paths are
        # copied (before the forwards of their logits), after the drafts' copy, before the
        # verify.
        assert all(cuts[key] % 7 == 0 for key in drafting), cuts


@pytest.mark.parametrize("algorithm", ["none", "eagle3 chain"])
def test_the_step_log_gives_each_constrained_steps_host_mask_work(
    model_dir: Path, grammars: Grammars, drafts: dict[str, str], algorithm: str, tmp_path: Path
) -> None:
    """A decode step holding grammar rows logs its host's mask time and its waits for the
    device (those a GPU would make): none for a plain step (its masks wait only for the step
    before); for the EAGLE-3 chain's drafting steps the second and third draft places' paths
    (where a row guides them) and the verify nodes' drafts, so one to three. Other steps log
    none (a prompt chunk's masks come in its plan)."""
    settings: dict[str, object] = {"step_log": str(tmp_path / "steps.jsonl")}
    if algorithm != "none":
        settings |= {**DRAFT_ALGORITHMS[algorithm], "draft_model": drafts["eagle3"]}
    engine = engine_for(str(model_dir), **settings)
    launched = record_launches(engine.loop.runner)
    run(engine, grammar_requests(), grammars=grammars)
    engine.loop.close()
    steps = [line for line in map(json.loads, (tmp_path / "steps.jsonl").open()) if "kind" in line]
    assert len(steps) == len(launched)
    widths = Counter()
    for step, plan in zip(steps, launched, strict=True):
        if plan.kind != "decode" or not plan.masked_rows:
            assert "mask_waits" not in step, step
            continue
        widths[step["width"]] += 1
        waits = step["mask_waits"]
        assert waits == 0 if step["width"] == 1 else 1 <= waits <= 3, step
        assert 0 < step["mask_fill_ms"] <= step["turn_ms"] and step["mask_wait_ms"] >= 0
    assert widths[1 if algorithm == "none" else 4], widths
