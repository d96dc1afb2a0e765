"""The most rows a drafting step of each width takes (engine/memory_plan.py): the plan's
arithmetic on served shapes, the scheduler's bound on every batch whatever its policy chose,
the drafting policy's choices and the start-up timing past the bound, and tokens that do not
depend on it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import CONFIGS
from engine_harness import DRAFT_ALGORITHMS, debug_checks_fixture, engine_for, request, run
from engine_harness import tokens_of as tokens
from model_fixtures import VOCAB
from test_scheduler import make, planned, step

from outrider.daemon.config import ServeConfig
from outrider.daemon.engine import build, memory_plan
from outrider.daemon.engine.graphs import DecodeGraphs
from outrider.daemon.engine.memory_plan import GraphSettings, PlanInputs, plan_memory
from outrider.daemon.engine.step_memory import StepWidth, batch_buckets, graph_pool_bytes
from outrider.daemon.internal import TokenizedRequest
from outrider.daemon.scheduler.acceptance import BreakEven
from outrider.daemon.scheduler.drafting import AdaptiveDrafting, AdaptiveSettings, probe_cap
from outrider.daemon.scheduler.request import Request
from outrider.plugins.api import StepShape
from outrider.plugins.models.config import ModelConfig
from outrider.plugins.sampling_spec import SamplingSpec

debug_checks = debug_checks_fixture()

GIB = 2**30


# --- the plan -------------------------------------------------------------------------------


def test_a_dflash_block_of_16_on_qwen3_8b_plans_its_rows_instead_of_being_refused() -> None:
    """Qwen3-8B, a DFlash block of 16 (cut to 8, 4, 2 and 1 drafts), 256 running rows all
    graphed, 120 GiB free: at every row the widest step's working set (about 59 GB) left the KV
    pool nothing. Each width now takes the rows whose step fits in an eighth of the free
    memory (a batch bucket), the estimate is the largest such step, and the KV pool the rest."""
    model = ModelConfig.from_pretrained(str(CONFIGS / "Qwen3-8B.config.json"))
    vocab, budget = model.vocab_size, int(120 * GIB * 0.125)
    widths = tuple(StepWidth(drafts + 1, drafts * vocab) for drafts in (15, 8, 4, 2, 1))
    config = ServeConfig(
        model="qwen3", device="cuda", max_running=256, cuda_graph_max_bs=256, context_length=40960
    )
    kv_per_token = 2 * 36 * 8 * 128 * 2
    inputs = PlanInputs(
        config, model, 2, kv_per_token, 1, 40960, 32, widths, GraphSettings(256, False), 120 * GIB
    )
    plan = plan_memory(inputs)

    def bytes_at(rows: int, step: StepWidth) -> int:
        return graph_pool_bytes(model, 2, rows, step.width, None, draft_logits=step.draft_logits)

    assert bytes_at(256, widths[0]) > 55 * GIB  # what was refused
    assert plan.drafting_rows == ((16, 64), (9, 120), (5, 224), (3, 256), (2, 256))
    planned = [(rows, width) for (_, rows), width in zip(plan.drafting_rows, widths, strict=True)]
    for rows, width in planned:
        assert bytes_at(rows, width) <= budget
        larger = [bs for bs in batch_buckets(256) if bs > rows]
        assert not larger or bytes_at(larger[0], width) > budget  # the next bucket passes it
    largest = max(bytes_at(rows, width) for rows, width in planned)
    assert plan.graph_estimate == largest + 80 * 2**20
    assert plan.activation_bytes == 2 * plan.graph_estimate
    assert plan.pool_tokens > 500_000 and plan.context_length == 40960
    # A width between two planned ones takes the wider one's rows; plain steps take all.
    rows_at = [plan.rows_at(width, 256) for width in (16, 12, 9, 6, 5, 2, 1)]
    assert rows_at == [64, 64, 120, 120, 224, 256, 256]


def test_a_step_that_fits_at_every_row_keeps_every_row() -> None:
    """An EAGLE-3 chain of 3 drafts (32,000-token draft vocabulary) on Llama-3.1-8B at 256
    rows: its step (about 8 GB) fits, so no width is bounded."""
    model = ModelConfig.from_pretrained(str(CONFIGS / "Llama-3.1-8B-Instruct.config.json"))
    widths = tuple(StepWidth(drafts + 1, drafts * 32000) for drafts in (3, 2, 1))
    config = ServeConfig(model="llama", device="cuda", max_running=256, cuda_graph_max_bs=256)
    inputs = PlanInputs(
        config, model, 2, 2 * 32 * 8 * 128 * 2, 1, 8192, 16, widths, GraphSettings(256, False),
        120 * GIB,
    )  # fmt: skip
    assert plan_memory(inputs).drafting_rows == ((4, 256), (3, 256), (2, 256))


def test_graphs_of_a_drafting_width_stop_at_its_rows_largest_first() -> None:
    """Start keys: width 4 up to 2 rows, width 3 up to 4, plain steps at every bucket, in
    order of tokens a step (then width), so that each capture fits in blocks freed before."""
    graphs = DecodeGraphs(5, 64, 0, 5, widths=(4, 3, 1), drafting_rows=((4, 2), (3, 4)))
    steps = [(key.bs, key.width) for key in graphs.start_keys() if key.all_greedy]
    assert steps == [(4, 3), (3, 3), (2, 4), (2, 3), (5, 1), (1, 4), (4, 1), (1, 3), (3, 1),
                     (2, 1), (1, 1)]  # fmt: skip


# --- the scheduler and the policy ---------------------------------------------------------


@pytest.mark.parametrize(("requests", "width"), [(1, 4), (2, 3), (3, 2), (4, 1)])
def test_a_batch_drafts_only_as_wide_as_its_rows_allow(requests: int, width: int) -> None:
    """The engine drafts 3 tokens a row at most for 1 row, 2 for 2, 1 for 3: a batch of more
    rows than the policy's width takes drafts at the widest width it fits, or plain steps."""
    s = make(shape=StepShape(width=4, depth=3, topk=1), drafting_rows=((4, 1), (3, 2), (2, 3)))
    for rid in range(requests):
        s.add(_request(rid))
    step(s, *[[20 + rid] for rid in range(requests)])
    assert planned(s).plan.q_lens == [width] * requests


def _request(rid: int) -> TokenizedRequest:
    return TokenizedRequest(
        rid=rid, request_id=f"r{rid}", input_ids=[10, 11, 12, 13, 14], sampling=SamplingSpec(),
        max_new_tokens=8, stop=[], stop_token_ids=[], ignore_eos=False, stream=False,
        want_logprobs=False, arrival=0.0,
    )  # fmt: skip


def test_break_even_past_a_widths_rows_is_infinite_and_probes_take_the_widest_that_fits() -> None:
    """A chain of 3 drafts that takes 2 rows, cut to 2 drafts (4 rows) and 1 (every row):
    past its rows a width never pays; a line towards a size not timed is infinite but at its
    finite end; the probe cap counts the sizes timed; a probe drafts the widest width the
    batch fits."""
    inf = math.inf
    break_even = BreakEven(
        (1, 4, 16), (1.2, inf, inf), (1.3, inf, inf), cut_drafts=(2, 1),
        cut_greedy=((1.1, 1.4, inf), (1.05, 1.2, 1.6)),
        cut_sampled=((1.2, 1.5, inf), (1.1, 1.3, 1.7)), max_rows=(2, 4, 16), resume=0.6,
    )  # fmt: skip
    assert break_even.at(2, True) == inf and break_even.at(1, True) == 1.2
    assert break_even.fits(2) and not break_even.fits(3) and break_even.fits(4, 2)
    assert break_even.at(4, True, 2) == 1.4 and break_even.at(5, True, 2) == inf
    assert break_even.at(10, True, 1) == pytest.approx(1.4)
    assert probe_cap(break_even) == 90  # (1.3 - 1 + 0.6) / 1 %
    policy = AdaptiveDrafting(AdaptiveSettings(break_even, probe_every=1), width=4)
    rows = [Request.from_message(_request(rid)) for rid in range(5)]
    for req in rows:
        req.tau_estimate = 1.0  # no width pays: plain steps, then a probe
    assert [policy.width(rows[:3]) for _ in range(2)] == [1, 3]
    assert [policy.width(rows) for _ in range(3)] == [1, 1, 2]  # the probe wait doubled


# --- the engine -----------------------------------------------------------------------------


def _workload() -> list[TokenizedRequest]:
    """Six greedy and seeded sampled requests decoding together, ending one after another."""
    prompts = [[3 + (7 * i + 3 * j) % (VOCAB - 3) for j in range(5 + 2 * i)] for i in range(6)]
    return [
        request(i, p, max_new_tokens=6 + 4 * i, temperature=0.0 if i % 2 else 0.9, top_k=20,
                seed=i)
        for i, p in enumerate(prompts)
    ]  # fmt: skip


@pytest.fixture
def three_rows_at_full_width(
    speculative_dirs: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step memory share and free memory at which the tiny DFlash engine's widest step
    (block 4, float32 on the CPU) takes 3 rows: its step at 3 rows is the whole budget."""
    target = ModelConfig.from_pretrained(speculative_dirs["target"])
    step = graph_pool_bytes(target, 4, 3, 4, None, draft_logits=3 * target.vocab_size)
    free = 64 * GIB
    monkeypatch.setattr(build, "_free_bytes", lambda device: free)
    monkeypatch.setattr(memory_plan, "STEP_MEMORY_SHARE", (step + 0.5) / free)


@pytest.mark.usefixtures("three_rows_at_full_width")
def test_an_engine_drafting_every_batch_takes_plain_steps_past_its_rows(
    speculative_dirs: dict[str, str], tmp_path: Path
) -> None:
    """DFlash drafting every batch (the policy off), 3 rows at most a drafting step: batches
    of more rows take plain steps (the step log's widths), and the tokens are the target's."""
    expected = tokens(run(engine_for(speculative_dirs["target"]), _workload()))
    log = tmp_path / "steps.jsonl"
    settings = dict(DRAFT_ALGORITHMS["dflash"], draft_model=speculative_dirs["dflash"])
    engine = engine_for(speculative_dirs["target"], step_log=str(log), **settings)
    assert engine.scheduler.planner.limits.drafting_rows == ((4, 3),)
    assert tokens(run(engine, _workload())) == expected
    engine.loop.close()
    decodes = [line for line in map(json.loads, log.read_text().splitlines())
               if line.get("kind") == "decode"]  # fmt: skip
    assert all(line["rows"] <= 3 for line in decodes if line["width"] == 4)
    assert {line["width"] for line in decodes if line["rows"] > 3} == {1}
    assert any(line["width"] == 4 for line in decodes)


@pytest.mark.usefixtures("three_rows_at_full_width")
def test_the_start_up_timing_leaves_out_the_sizes_past_a_widths_rows(
    speculative_dirs: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """The measured policy: DFlash's block of 4 is not timed at 4 rows (it takes 3), its cuts
    to 2 drafts (4 rows) and 1 (6) are; the log says which; the tokens are the target's."""
    expected = tokens(run(engine_for(speculative_dirs["target"]), _workload()))
    settings = dict(DRAFT_ALGORITHMS["dflash"], draft_model=speculative_dirs["dflash"])
    with caplog.at_level("INFO", "outrider.engine"):
        engine = engine_for(speculative_dirs["target"], speculative_min_acceptance=-1.0, **settings)
    policy = engine.scheduler.policy
    assert isinstance(policy, AdaptiveDrafting)
    break_even = policy.settings.break_even
    assert (break_even.sizes, break_even.max_rows) == ((1, 4), (3, 4, 6))
    assert break_even.greedy[1] == break_even.sampled[1] == math.inf
    assert all(values[1] < math.inf for values in break_even.cut_greedy + break_even.cut_sampled)
    assert "drafting 3 tokens a row pays from an acceptance length of" in caplog.text
    assert "drafting steps run for at most 3 rows at 3 drafts, 4 rows at 2 drafts" in caplog.text
    line = next(r.message for r in caplog.records if r.message.startswith("drafting 3 tokens"))
    assert ", - greedy" in line and ", - sampled" in line
    assert tokens(run(engine, _workload())) == expected
