"""Decoding rows riding prompt batches (``SchedulerLimits.mixed_batches``), through the
in-process engine (float32 on CPU): the same tokens and logprobs as with the batches apart,
greedy and seeded sampling, through the overlap loop and the serial one, with prompts
chunked and arriving while others decode; rows that adjust their logits or draw under a
grammar keep to decode batches; the rows of a speculative engine ride as plain steps under
every draft algorithm. A prompt batch's riders attend as a batch of their own, bound to the
decode phase's backend, to the outputs of the batch attended whole."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest
import torch
from engine_harness import (
    DRAFT_ALGORITHMS,
    debug_checks_fixture,
    engine_for,
    record_launches,
    request,
    run,
)
from model_fixtures import VOCAB, PagedRows, torch_backend

from outrider.daemon.engine.build import Engine
from outrider.daemon.engine.deferred import CatchUp
from outrider.daemon.engine.plan import StepPlan
from outrider.daemon.internal import TokenizedRequest
from outrider.daemon.scheduler.drafting import AlternateDrafting
from outrider.daemon.scheduler.request import Request
from outrider.plugins.api import NoOptions
from outrider.plugins.attention.torch_impl import TorchAttention
from outrider.plugins.device import AttentionShape, BatchLayout, ForwardBatch, HostLengths
from outrider.plugins.sampling_spec import SamplingSpec

debug_checks = debug_checks_fixture()

SHAPE = AttentionShape(4, 2, 16, 0.25, torch.float32)


class _Recording(TorchAttention):
    """The torch backend, keeping every layout it builds metadata for."""

    def __init__(self) -> None:
        super().__init__(SHAPE, NoOptions(), torch.device("cpu"))
        self.built: list[BatchLayout] = []

    def build(self, layout: BatchLayout) -> object:
        self.built.append(layout)
        return super().build(layout)


def test_riders_attend_apart_on_the_decode_backend_as_in_the_batch_whole() -> None:
    """Prompt chunks of 5 and 3 tokens (one over a cached prefix), then two riders of one
    token over contexts of 9 and 14: bound with a riders' backend, the prompt rows go to the
    prompt backend and the riders to theirs as a batch of two (exact lengths, one token a
    row), and every token's output is the batch's attended whole."""
    rows = PagedRows(num_layers=1, shape=SHAPE, page_size=4, max_len=32)
    plain = torch_backend(SHAPE)
    gen = torch.Generator().manual_seed(0)

    def attended(fb: ForwardBatch) -> torch.Tensor:
        n = fb.layout.num_tokens
        q, k, v = (torch.randn(n, h, 16, generator=gen) for h in (4, 2, 2))
        return fb.attend(0, q, k, v)

    _, context = rows.batch(plain, [(1, [3] * 4), (2, [3] * 8), (3, [3] * 13)])
    attended(context)
    batch = [(0, [4] * 5), (1, [4] * 3), (2, [4]), (3, [4])]
    _, whole = rows.batch(plain, batch, exact=True)
    n = whole.layout.num_tokens
    q, k, v = (torch.randn(n, h, 16, generator=gen) for h in (4, 2, 2))
    want = whole.attend(0, q, k, v)
    prompts, riders = _Recording(), _Recording()
    split = ForwardBatch.bind(whole.layout, prompts, whole.kv, riders=riders)
    got = split.attend(0, q, k, v)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    (head,), (tail,) = prompts.built, riders.built
    assert (head.bs, head.max_q, head.host) == (2, 5, HostLengths((5, 3), (5, 7)))
    assert (tail.bs, tail.max_q, tail.max_kv) == (2, 1, 14)
    assert tail.host is not None and (tail.host.q_lens, tail.host.seq_lens) == ((1, 1), (9, 14))
    assert tail.slots.tolist() == [2, 3] and tail.positions.tolist() == [8, 13]
    assert tail.q_start.tolist() == [0, 1, 2] and tail.q_pad_index.tolist() == [0, 1]
    assert torch.equal(tail.out_loc, whole.layout.out_loc[8:])
    # A batch without a longer row before its one-token rows stays whole.
    _, decode = rows.batch(plain, [(2, [5]), (3, [5])], exact=True)
    kept = ForwardBatch.bind(decode.layout, prompts, decode.kv, riders=riders)
    assert kept.parts is None and len(riders.built) == 1


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
    plans = record_launches(engine.loop.runner)
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


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_decode_batches_between_prompt_batches_keep_the_outputs(
    llama_dir: str, overlap: bool
) -> None:
    """``--max-prompt-run 1``: while requests decode, every prompt batch is followed by a decode
    batch where one can run; the outputs are those of prompts first."""
    settings = {"chunked_prefill_tokens": 24, "page_size": 4, "no_overlap": not overlap}
    first, first_plans = served(engine_for(llama_dir, **settings), workload())
    between, plans = served(engine_for(llama_dir, max_prompt_run=1, **settings), workload())
    assert_same(between, first)
    kinds, first_kinds = ("".join(p.kind[0] for p in ps) for ps in (plans, first_plans))
    # Once a request decodes, never two prompt batches in a row; prompts first ran several.
    assert "ee" not in kinds[kinds.index("d") :]
    assert "eee" in first_kinds[first_kinds.index("d") :]


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


@pytest.fixture(scope="module")
def target_only(speculative_dirs: dict[str, str]) -> dict[int, Any]:
    """``workload``'s finals from the target alone, prompts in chunks of 24 (the overlap loop's:
    the serial one gives the same, test above)."""
    settings = {"chunked_prefill_tokens": 24, "page_size": 4}
    return served(engine_for(speculative_dirs["target"], **settings), workload())[0]


def _draft_settings(speculative_dirs: dict[str, str], algorithm: str) -> dict[str, object]:
    settings = dict(DRAFT_ALGORITHMS[algorithm])
    name = str(settings["speculative_algorithm"])
    if name in speculative_dirs:
        settings["draft_model"] = speculative_dirs[name]
    return settings


@pytest.mark.parametrize("algorithm", ["eagle3 chain", "dflash"])
def test_speculative_decode_batches_between_prompt_batches_keep_the_target_tokens(
    speculative_dirs: dict[str, str], target_only: dict[int, Any], algorithm: str
) -> None:
    """``--max-prompt-run 1`` under speculation and the overlap loop: drafting and plain decode
    batches between the prompt batches, the target-only engine's tokens and finishes."""
    settings = {"chunked_prefill_tokens": 24, "page_size": 4, "max_prompt_run": 1}
    engine = engine_for(
        speculative_dirs["target"], **settings, **_draft_settings(speculative_dirs, algorithm)
    )
    engine.scheduler.use_policy(AlternateDrafting((engine.loop.runner.shape.width,)))
    between, plans = served(engine, workload())
    assert {rid: b[:3] for rid, b in between.items()} == {r: e[:3] for r, e in target_only.items()}
    kinds = "".join(p.kind[0] for p in plans)
    assert "ee" not in kinds[kinds.index("d") :] and any(p.drafting for p in plans)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("algorithm", DRAFT_ALGORITHMS)
def test_speculative_rows_ride_prompt_chunks_and_keep_the_target_tokens(
    speculative_dirs: dict[str, str], target_only: dict[int, Any], algorithm: str, overlap: bool
) -> None:
    """Decode batches alternate between drafting and plain steps (each of the engine's
    widths in turn), so riders come with positions their plain steps buffered, which catch
    up before the prompt batch they ride: every token and finish is the target-only
    engine's, greedy and seeded. A row rides only when none of its drafting steps is in
    flight: under overlap never the batch right after its drafting step."""
    target = speculative_dirs["target"]
    settings = {"chunked_prefill_tokens": 24, "page_size": 4, "no_overlap": not overlap}
    engine = engine_for(
        target, mixed_batches=True, **settings, **_draft_settings(speculative_dirs, algorithm)
    )
    shape = engine.loop.runner.shape
    widths = tuple(c.width for c in shape.cuts()) if engine.loop.runner.worker.cut_steps else ()
    engine.scheduler.use_policy(AlternateDrafting(widths or (shape.width,)))
    deferred = engine.loop.runner.deferred
    caught_up: list[int] = []  # riders' slots caught up before their prompt batch
    if deferred is not None:
        due = deferred.due

        def recorded(plan: StepPlan) -> CatchUp | None:
            catch_up = due(plan)
            if catch_up is not None and plan.kind == "extend":
                riders = {plan.slots[row] for row in plan.relay_rows}
                caught_up.extend(s for s in catch_up.slots if s in riders)
            return catch_up

        deferred.due = recorded  # type: ignore[method-assign]
    mixed, plans = served(engine, workload())
    assert {rid: m[:3] for rid, m in mixed.items()} == {r: e[:3] for r, e in target_only.items()}
    riding = [i for i, p in enumerate(plans) if p.relay_rows]
    assert len(riding) >= 5, [p.kind for p in plans]
    # The plan before is still in flight when a plan is made under overlap: processed first
    # when serial.
    in_flight = 1 if overlap else 0
    after_drafting = 0
    for i in riding:
        riders = {plans[i].slots[row] for row in plans[i].relay_rows}
        if in_flight and plans[i - 1].drafting:
            assert not riders & set(plans[i - 1].slots), i
        before = plans[i - 1 - in_flight]
        after_drafting += before.drafting and bool(riders & set(before.slots))
    assert after_drafting >= 1
    assert (deferred is None) == (algorithm == "ngram")
    assert len(caught_up) >= (0 if deferred is None else 1)


@pytest.mark.parametrize("algorithm", DRAFT_ALGORITHMS)
def test_riders_retracted_and_readmitted_keep_the_target_tokens(
    speculative_dirs: dict[str, str],
    target_only: dict[int, Any],
    algorithm: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every fourth plan retracts the youngest running request (the retraction drill), so
    rows leave and come back through prompt batches while others ride them, some with
    drafting steps in flight: the tokens stay the target-only engine's."""
    target = speculative_dirs["target"]
    settings = {"chunked_prefill_tokens": 24, "page_size": 4}
    monkeypatch.setenv("OUTRIDER_DEBUG_RETRACT_EVERY", "4")
    engine = engine_for(
        target, mixed_batches=True, **settings, **_draft_settings(speculative_dirs, algorithm)
    )
    shape = engine.loop.runner.shape
    widths = tuple(c.width for c in shape.cuts()) if engine.loop.runner.worker.cut_steps else ()
    engine.scheduler.use_policy(AlternateDrafting(widths or (shape.width,)))
    admission = engine.scheduler.admission
    retract, retracted = admission.retract, []

    def counted(req: Request) -> None:
        retracted.append(req.rid)
        retract(req)

    admission.retract = counted  # type: ignore[method-assign]
    mixed, plans = served(engine, workload())
    assert {rid: m[:3] for rid, m in mixed.items()} == {r: e[:3] for r, e in target_only.items()}
    assert sum(len(p.relay_rows) for p in plans) >= 10 and len(retracted) >= 5


class _EveryoneFeeds(AlternateDrafting):
    """Drafting every other batch, and every request feeds the draft."""

    def feeds(self, req: Request, others: int) -> bool:
        return True


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_a_rider_leaves_the_draft_current(llama_dir: str, overlap: bool) -> None:
    """The target as its own standalone draft, greedy: with the draft's KV current at every
    drafting step (riders' buffered positions caught up, the rider's own token run through
    the draft as a chunk of one), each draft is the target's own choice and is accepted, but
    in a request's last step, which its length may cut."""
    steps = 3
    reqs = [msgspec.structs.replace(r, sampling=SamplingSpec(0.0, 1.0, 0, 0)) for r in workload()]
    engine = engine_for(
        llama_dir, mixed_batches=True, speculative_algorithm="standalone", draft_model=llama_dir,
        speculative_num_steps=steps, chunked_prefill_tokens=24, page_size=4,
        no_overlap=not overlap,
    )  # fmt: skip
    engine.scheduler.use_policy(_EveryoneFeeds((steps + 1,)))
    plans = record_launches(engine.loop.runner)
    outcomes = run(engine, reqs, stagger=3)
    assert sum(len(plan.relay_rows) for plan in plans) >= 10
    usages = {rid: outcome.finish.usage for rid, outcome in outcomes.items()}
    assert sum(u.spec_drafts for u in usages.values()) >= len(reqs)
    for rid, usage in usages.items():
        assert usage.spec_accepted_tokens >= steps * (usage.spec_drafts - 1), (rid, usage)
