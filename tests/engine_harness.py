"""Drives the in-process engine (scheduler + runner, no sockets) for matrix tests."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import pytest

from outrider.daemon.config import ServeConfig
from outrider.daemon.engine.build import Engine, build_engine
from outrider.daemon.engine.graphs import DecodeGraphs, GraphKey
from outrider.daemon.engine.plan import StepPlan
from outrider.daemon.engine.results import StepResults
from outrider.daemon.engine.runner import ModelRunner
from outrider.daemon.engine.token_masks import MaskHoles
from outrider.daemon.grammar.compiler import Grammars
from outrider.daemon.internal import Counters, FinishInfo, RequestUpdate, TokenizedRequest
from outrider.plugins.sampling_spec import SamplingSpec
from outrider.protocol.messages import Grammar


@dataclass
class Outcome:
    """Everything the engine sent for one request."""

    updates: list[RequestUpdate] = field(default_factory=list)

    @property
    def final(self) -> RequestUpdate:
        assert self.updates and self.updates[-1].is_final
        return self.updates[-1]

    @property
    def finish(self) -> FinishInfo:
        finish = self.final.finish
        assert finish is not None, self.final.error
        return finish

    @property
    def token_ids(self) -> list[int]:
        return [t for u in self.updates for t in u.token_ids]


# The engine configurations each attention backend's GPU tests serve the family with: plain
# decoding, DFlash's non-causal draft, and an EAGLE-3 tree.
ENGINE_ALGORITHMS: dict[str, dict[str, object]] = {
    "plain": {"speculative_algorithm": "none"},
    "dflash": {"speculative_algorithm": "dflash"},
    "eagle3 tree": {"speculative_algorithm": "eagle3", "speculative_num_steps": 3,
                    "speculative_topk": 2, "speculative_num_draft_tokens": 6},
}  # fmt: skip


# Every drafting algorithm as engine settings, the tree at S = 3, K = 2, N = 6; the drafts for
# ``speculative_dirs`` (conftest.py).
DRAFT_ALGORITHMS: dict[str, dict[str, object]] = {
    "ngram": {"speculative_algorithm": "ngram"},
    "dflash": {"speculative_algorithm": "dflash"},
    "eagle3 chain": {"speculative_algorithm": "eagle3", "speculative_num_steps": 3},
    "eagle3 tree": {"speculative_algorithm": "eagle3", "speculative_num_steps": 3,
                    "speculative_topk": 2, "speculative_num_draft_tokens": 6},
    "standalone": {"speculative_algorithm": "standalone"},
}  # fmt: skip


def engine_for(model: str, **overrides: object) -> Engine:
    """An engine for tests; a speculative one drafts every decode batch unless the overrides
    set ``speculative_min_acceptance`` (its counters then count every step)."""
    settings: dict[str, object] = {
        "model": model,
        "page_size": 16,
        "max_running": 8,
        "kv_cache_tokens": 4096,
        "chunked_prefill_tokens": 256,
        "speculative_min_acceptance": 0.0,
    }
    settings.update(overrides)
    return build_engine(ServeConfig(**settings))  # type: ignore[arg-type]  # test settings


def request(
    rid: int,
    input_ids: Sequence[int],
    *,
    max_new_tokens: int | None = 12,
    temperature: float = 0.0,
    seed: int = 0,
    top_k: int = 0,
    top_p: float = 1.0,
    logprobs: int = 0,
    ignore_eos: bool = True,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    stream: bool = False,
    grammar: Grammar | None = None,
    max_drafts: int | None = None,
) -> TokenizedRequest:
    return TokenizedRequest(
        rid=rid,
        request_id=f"r{rid}",
        input_ids=list(input_ids),
        sampling=SamplingSpec(temperature, top_p, top_k, seed, logprobs),
        max_new_tokens=max_new_tokens,
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        stream=stream,
        want_logprobs=logprobs > 0,
        arrival=time.time(),
        grammar=grammar,
        max_drafts=max_drafts,
    )


def requests_for(
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | None,
    first_rid: int = 0,
    logprobs: int = 0,
) -> list[TokenizedRequest]:
    """One greedy ``request`` per prompt (eos ignored), rids counting up from ``first_rid``."""
    return [
        request(first_rid + i, p, max_new_tokens=max_new_tokens, logprobs=logprobs)
        for i, p in enumerate(prompts)
    ]


def tokens_of(outcomes: Mapping[int, Outcome]) -> dict[int, list[int]]:
    """The tokens each request got, by rid."""
    return {rid: outcome.token_ids for rid, outcome in outcomes.items()}


def record_launches(runner: ModelRunner) -> list[StepPlan]:
    """Every plan ``runner`` launches from now on, in order, in the list returned."""
    launched: list[StepPlan] = []
    launch = runner.launch

    def recorded(plan: StepPlan, *args: object, **kwargs: object) -> object:
        launched.append(plan)
        return launch(plan, *args, **kwargs)  # type: ignore[arg-type]  # passed through

    runner.launch = recorded  # type: ignore[method-assign]
    return launched


def tau_of(counters: Counters) -> float:
    """The mean acceptance length ``1 + accepted / drafts``; asserts there was a draft."""
    assert counters.spec_drafts > 0
    return 1 + counters.spec_accepted_tokens / counters.spec_drafts


def debug_checks_fixture(*, relay_check: bool = True) -> Callable[..., object]:
    """An autouse fixture for the test module that assigns it: every test runs with the KV
    check (``OUTRIDER_DEBUG_KV_CHECK``) and, unless ``relay_check`` is False, the relay check
    (``OUTRIDER_DEBUG_RELAY_CHECK``)."""

    @pytest.fixture(autouse=True)
    def debug_checks(monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("OUTRIDER_DEBUG_KV_CHECK", "1")
        if relay_check:
            monkeypatch.setenv("OUTRIDER_DEBUG_RELAY_CHECK", "1")

    return debug_checks


def run(
    engine: Engine,
    requests: Sequence[TokenizedRequest],
    *,
    stagger: int = 0,
    grammars: Grammars | None = None,
) -> dict[int, Outcome]:
    """Serve ``requests`` to completion; with ``stagger`` > 0, add one request every
    ``stagger`` loop turns instead of all at once; ``grammars`` starts the grammar of each
    request that has one, as the daemon does. Asserts exactly one final per request."""
    outcomes = {r.rid: Outcome() for r in requests}
    pending = list(requests)
    loop = engine.loop
    turn = 0
    while pending or loop.has_work:
        if pending and (stagger == 0 or turn % stagger == 0):
            batch = pending if stagger == 0 else pending[:1]
            for r in batch:
                start = None
                if r.grammar is not None or r.tools is not None:
                    assert grammars is not None, "a request with a grammar needs grammars"
                    start = grammars.start(r)
                loop.scheduler.add(r, start)
            pending = pending[len(batch) :]
        for update in loop.iterate():
            outcome = outcomes[update.rid]
            assert not (outcome.updates and outcome.updates[-1].is_final), "update after final"
            outcome.updates.append(update)
        turn += 1
    loop.idle_check()
    for rid, outcome in outcomes.items():
        assert outcome.updates and outcome.updates[-1].is_final, f"rid {rid} got no final"
    return outcomes


class EagerGraphs(DecodeGraphs):
    """Captures keep the recorded closure; replays run it; padding and replays are counted."""

    def __init__(
        self,
        *args: int,
        kv_bounded: bool = True,
        widths: tuple[int, ...] = (1,),
        sampled_cuts: bool = False,
    ) -> None:
        super().__init__(*args, kv_bounded=kv_bounded, widths=widths, sampled_cuts=sampled_cuts)
        self.runs: dict[GraphKey, Callable[[], StepResults]] = {}
        self.padded_rows = 0
        self.replays = 0
        self.holes: dict[GraphKey, MaskHoles | None] = {}
        self.cuts: Counter[GraphKey] = Counter()  # host waits between segments, per key

    def pad(self, plan: StepPlan, key: GraphKey) -> StepPlan:
        self.padded_rows += key.bs - plan.bs
        return super().pad(plan, key)

    def capture(
        self, key: GraphKey, run: Callable[[], StepResults], holes: MaskHoles | None = None
    ) -> None:
        self.runs[key] = run
        self.holes[key] = holes
        self.graphs[key] = (None, None)  # type: ignore[assignment]  # marks it captured

    def replay(self, key: GraphKey) -> StepResults:
        """The recorded run, its host waits cut as a captured graph's are (each fill run
        between two segments, counted per key)."""
        self.replays += 1
        holes = self.holes[key]
        if holes is None:
            return self.runs[key]()

        def cut(fill: Callable[[], None]) -> None:
            self.cuts[key] += 1
            fill()

        with holes.cutting(cut):
            return self.runs[key]()
