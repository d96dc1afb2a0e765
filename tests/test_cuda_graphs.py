"""Decode batches replayed from CUDA graphs (daemon/engine/graphs.py): padded batch sizes,
bucketed KV bounds and sampling variants must not change a single token.

On CPU the runner's graph path runs with eager "replays": each capture keeps the closure a
graph would record (over the same staged buffers), each replay runs it. On CUDA, real graphs
against the eager engine."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from engine_harness import debug_checks_fixture, engine_for, request, run
from model_fixtures import VOCAB, save_random_dflash, save_random_eagle3, save_tiny_model

from outrider.daemon.engine.build import Engine
from outrider.daemon.engine.graphs import DecodeGraphs, GraphKey, batch_buckets
from outrider.daemon.engine.plan import StepPlan
from outrider.daemon.engine.results import StepResults
from outrider.daemon.internal import TokenizedRequest

# The relay check poisons the scratch slot too; graphs are off under it (build.py).
debug_checks = debug_checks_fixture(relay_check=False)

ALGORITHMS = {
    "none": {},
    "ngram": {"speculative_algorithm": "ngram"},
    "eagle3 chain": {"speculative_algorithm": "eagle3", "speculative_num_steps": 3},
    "eagle3 tree": {"speculative_algorithm": "eagle3", "speculative_num_steps": 3,
                    "speculative_topk": 2, "speculative_num_draft_tokens": 6},
    "dflash": {"speculative_algorithm": "dflash"},
}  # fmt: skip


class EagerGraphs(DecodeGraphs):
    """Captures keep the recorded closure; replays run it; padding is counted."""

    def __init__(self, *args: int) -> None:
        super().__init__(*args)
        self.runs: dict[GraphKey, Callable[[], StepResults]] = {}
        self.padded_rows = 0

    def pad(self, plan: StepPlan, key: GraphKey) -> StepPlan:
        self.padded_rows += key.bs - plan.bs
        return super().pad(plan, key)

    def capture(self, key: GraphKey, run: Callable[[], StepResults]) -> None:
        self.runs[key] = run
        self.graphs[key] = (None, None)  # type: ignore[assignment]  # marks it captured

    def replay(self, key: GraphKey) -> StepResults:
        return self.runs[key]()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("graphs")
    with torch.no_grad():
        save_tiny_model("llama", root / "target")
    return {
        "target": str(root / "target"),
        "eagle3": str(save_random_eagle3(root / "eagle3")),
        "dflash": str(save_random_dflash(root / "dflash")),
    }


def engine(dirs: dict[str, str], algorithm: str, **overrides: object) -> Engine:
    settings: dict[str, object] = dict(ALGORITHMS[algorithm])
    name = str(settings.get("speculative_algorithm", ""))
    if name in ("eagle3", "dflash"):
        settings["draft_model"] = dirs[name]
    return engine_for(dirs["target"], max_running=MAX_RUNNING, **settings, **overrides)


MAX_RUNNING = 12  # buckets 1 .. 8 and 12: batches of 9 to 11 rows are padded


def workload() -> list[TokenizedRequest]:
    """Nine greedy requests, then three sampled ones asking for logprobs, added one per loop
    turn so that decode batches of every size up to 12 occur."""
    prompts = [[3 + (11 * i + 5 * j) % (VOCAB - 3) for j in range(4 + 2 * i)] for i in range(12)]
    return [
        request(i, p, max_new_tokens=16 + i)
        if i < 9
        else request(i, p, max_new_tokens=14, temperature=0.8, top_p=0.9, seed=i, logprobs=3)
        for i, p in enumerate(prompts)
    ]


def outputs(engine: Engine) -> tuple[dict[int, list[int]], dict[int, list[float]]]:
    """Every request's tokens, and the logprobs (chosen and top) of those that asked."""
    outcomes = run(engine, workload(), stagger=1)
    tokens = {rid: o.token_ids for rid, o in outcomes.items()}
    logprobs = {
        rid: [x for lp in o.final.logprobs for x in (lp.logprob, *(v for _, v in lp.top))]
        for rid, o in outcomes.items()
        if o.final.logprobs
    }
    return tokens, logprobs


def assert_same_outputs(graphed: Engine, eager: Engine) -> None:
    """Tokens exactly; logprobs to float32 rounding (a padded batch or a wider KV bound sums
    in another order)."""
    graphed_tokens, graphed_logprobs = outputs(graphed)
    eager_tokens, eager_logprobs = outputs(eager)
    assert graphed_tokens == eager_tokens
    assert graphed_logprobs.keys() == eager_logprobs.keys() == {9, 10, 11}
    for rid, values in eager_logprobs.items():
        assert graphed_logprobs[rid] == pytest.approx(values, rel=1e-5, abs=1e-5)
    assert graphed.scheduler.counters() == eager.scheduler.counters()


def test_buckets_and_keys() -> None:
    assert batch_buckets(40) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40]
    assert batch_buckets(5) == [1, 2, 3, 4, 5]
    graphs = DecodeGraphs(12, 300, 20, 12)
    plan = StepPlan("decode", [0, 1, 2, 3, 4, 5, 6, 7, 8], [5] * 9, [4] * 9, [], [], [], [], [],
                    [], max_logprobs=2, all_greedy=False)  # fmt: skip
    assert graphs.key(plan, 70) == GraphKey(bs=12, max_kv=128, all_greedy=False, max_logprobs=20)
    assert graphs.key(plan, 20) == GraphKey(bs=12, max_kv=64, all_greedy=False, max_logprobs=20)
    assert graphs.key(plan, 290).max_kv == 300  # type: ignore[union-attr]  # the cap
    padded = graphs.pad(plan, GraphKey(12, 128, False, 20))
    assert padded.slots == [0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 12, 12]
    assert (padded.starts[9:], padded.q_lens[9:], padded.sample_rows) == (
        [0, 0, 0], [4, 4, 4], list(range(12)),
    )  # fmt: skip
    wide = StepPlan("decode", list(range(13)), [5] * 13, [4] * 13, [], [], [], [], [], [], 0, True)
    assert graphs.key(wide, 70) is None  # larger than the largest bucket: eager


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_padded_replays_give_the_eager_tokens(dirs: dict[str, str], algorithm: str) -> None:
    eager = engine(dirs, algorithm)
    graphed = engine(dirs, algorithm)
    runner = graphed.loop.runner
    graphs = EagerGraphs(MAX_RUNNING, 256, 20, runner.slots.scratch_slot)
    runner.graphs = graphs
    assert_same_outputs(graphed, eager)
    assert graphs.padded_rows > 0 and len(graphs.runs) >= 3
    assert {key.all_greedy for key in graphs.runs} == {True, False}


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_cuda_graphs_give_the_eager_tokens(
    dirs: dict[str, str], algorithm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32 on CUDA, every launch under the sync check: graphs on (the default) against
    --disable-cuda-graph."""
    monkeypatch.setenv("OUTRIDER_DEBUG_SYNC_CHECK", "1")
    graphed = engine(dirs, algorithm, device="cuda")
    assert graphed.loop.runner.graphs is not None
    eager = engine(dirs, algorithm, device="cuda", disable_cuda_graph=True)
    assert eager.loop.runner.graphs is None
    assert_same_outputs(graphed, eager)
    assert len(graphed.loop.runner.graphs.graphs) >= 3
