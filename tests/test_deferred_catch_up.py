"""Deferred catch-up (plugins/speculative/deferred.py, engine/deferred.py): plain steps of a
speculative engine buffer the draft's catch-up, and the draft ends up exactly where catching
up at every plain step leaves it: the same drafts at every drafting step, the same draft KV."""

from __future__ import annotations

import json
from collections.abc import Callable

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
from model_fixtures import VOCAB

from outrider.daemon.engine.build import Engine
from outrider.daemon.engine.deferred import CatchUp, DeferredCatchUp, Padding
from outrider.daemon.engine.graphs import CatchUpKey, DecodeGraphs
from outrider.daemon.engine.plan import StepPlan
from outrider.daemon.internal import TokenizedRequest
from outrider.daemon.scheduler.request import Request
from outrider.plugins.device import HostLengths
from outrider.plugins.speculative.base import DecodeView, Drafts

debug_checks = debug_checks_fixture()

# --- the host's decisions -----------------------------------------------------------------


def _plan(kind: str, slots: list[int], *, width: int = 1, released: list[int] = ()) -> StepPlan:
    return StepPlan(
        kind=kind,  # type: ignore[arg-type]  # "extend" or "decode"
        slots=slots,
        starts=[10 * (s + 1) for s in slots],
        q_lens=[width] * len(slots),
        input_ids=[],
        sample_rows=[],
        sample_positions=[],
        page_writes=[],
        page_values=[],
        slot_params=[],
        max_logprobs=0,
        all_greedy=True,
        released_slots=list(released),
    )


def test_the_host_catches_up_before_drafting_when_full_and_when_released() -> None:
    deferred = DeferredCatchUp(capacity=3, rows=5, device=torch.device("cpu"))

    def step(plan: StepPlan) -> CatchUp | None:
        due = deferred.due(plan)
        deferred.advance(plan, due)
        return due

    assert step(_plan("extend", [0, 1, 2])) is None
    assert step(_plan("decode", [0, 1, 2])) is None
    assert step(_plan("decode", [0, 1])) is None  # plain: slots 0 and 1 hold 2, slot 2 holds 1
    assert deferred.pending[:3] == [2, 2, 1]
    # A drafting step catches its rows up first; the KV bound is the last plain step's, the
    # floor the prompt's end and a token a step.
    assert step(_plan("decode", [1, 2], width=4)) == CatchUp([1, 2], [2, 1], 31, 23)
    assert deferred.pending[:3] == [2, 0, 0]
    assert step(_plan("decode", [0, 1, 2])) is None  # slot 0 now full
    assert deferred.pending[:3] == [3, 1, 1]
    # A plain step with a full row catches every buffered row of the batch up.
    assert step(_plan("decode", [0, 1])) == CatchUp([0, 1], [3, 1], 21, 14)
    assert deferred.pending[:3] == [1, 1, 1]
    # An ended request's slot catches up with the next plan, whatever it is; an EXTEND row
    # starts its slot afresh.
    assert step(_plan("extend", [3], released=[2, 4])) == CatchUp([2], [1], 31, 34)
    assert deferred.pending[:4] == [1, 1, 0, 0]


def test_a_short_prompt_ending_is_buffered_and_a_longer_or_unfinished_chunk_is_not() -> None:
    deferred = DeferredCatchUp(capacity=4, rows=4, device=torch.device("cpu"))
    ending = msgspec.structs.replace(_plan("extend", [0, 1]), q_lens=[4, 2], sample_rows=[0, 1])
    assert deferred.buffers(ending)
    deferred.advance(ending, None)
    assert deferred.pending[:2] == [4, 2] and deferred.kv_floor[:2] == [14, 22]
    # A row past the buffer, or a chunk that does not end its prompt, runs the draft at once
    # (a later chunk would start the slot afresh).
    assert not deferred.buffers(msgspec.structs.replace(ending, q_lens=[5, 2]))
    assert not deferred.buffers(msgspec.structs.replace(ending, sample_rows=[1]))
    chunk = msgspec.structs.replace(_plan("extend", [2, 3]), q_lens=[4, 2], sample_rows=[1])
    deferred.advance(chunk, None)
    assert deferred.pending[:4] == [4, 2, 0, 0] and deferred.kv_floor[2:4] == [34, 42]
    assert not deferred.buffers(_plan("decode", [0, 1]))


def test_a_catch_up_batch_lays_out_each_row_before_its_start() -> None:
    deferred = DeferredCatchUp(capacity=4, rows=3, device=torch.device("cpu"))
    starts = torch.tensor([7, 20, 3])
    shape = deferred.stage(CatchUp([2, 0], [1, 3], max_kv=21, min_start=3))
    rows = deferred.rows(shape, starts)
    assert rows.slots.tolist() == [2, 0] and rows.starts.tolist() == [3, 7]
    assert rows.q_start.tolist() == [0, 1, 4]
    assert rows.token_rows.tolist() == [0, 1, 1, 1]
    assert rows.token_index.tolist() == [0, 0, 1, 2]
    assert rows.real.tolist() == [True] * 4
    assert (rows.max_q, rows.max_kv) == (3, 21)
    page_table = torch.arange(3 * 4, dtype=torch.int32).view(3, 4)  # slot s: pages 4s ..
    layout = rows.layout(page_table, page_size=4)
    assert layout.positions.tolist() == [2, 4, 5, 6]  # slot 2: 3 - 1; slot 0: 7 - 3 ..
    assert layout.out_loc.tolist() == [8 * 4 + 2, 0 * 4 + 4, 5, 6]
    assert layout.seq_lens.tolist() == [3, 7]
    assert layout.q_pad_index.tolist() == [0, 3, 4, 5]
    # The host's view of the batch, for a backend that plans on the host: the same lengths.
    assert shape.host is None and layout.host is None  # no exact starts given
    exact = deferred.stage(CatchUp([2, 0], [1, 3], max_kv=21, min_start=3), None, [3, 7])
    assert exact.host == HostLengths((1, 3), (3, 7))
    assert deferred.rows(exact, starts).layout(page_table, page_size=4).host == exact.host


def test_a_padded_catch_up_puts_its_padding_before_the_buffered_positions() -> None:
    """A captured graph's shape: 3 rows of 4 tokens for 2 real rows; the padding reads buffer
    entry 0 and writes to the scratch page, the third row runs on the scratch slot."""
    deferred = DeferredCatchUp(capacity=4, rows=4, device=torch.device("cpu"))
    starts = torch.tensor([7, 20, 5, 0])
    shape = deferred.stage(CatchUp([2, 0], [1, 3], max_kv=21, min_start=5), Padding(3, 4))
    rows = deferred.rows(shape, starts)
    assert rows.slots.tolist() == [2, 0, 3]  # slot 3: the scratch slot
    assert rows.counts.tolist() == [1, 3, 0]
    assert rows.starts.tolist() == [5, 7, 4]  # the padding row starts at its length
    assert rows.q_start.tolist() == [0, 4, 8, 12]
    assert rows.real.tolist() == [False] * 3 + [True] + [False] + [True] * 3 + [False] * 4
    assert rows.token_index.tolist() == [0, 0, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0]
    assert (rows.max_q, rows.max_kv) == (4, 21)
    page_table = torch.arange(4 * 4, dtype=torch.int32).view(4, 4)
    page_table[3] = 0  # the scratch slot's row: the scratch page
    layout = rows.layout(page_table, page_size=4)
    assert layout.positions.tolist() == [1, 2, 3, 4, 3, 4, 5, 6, 0, 1, 2, 3]
    # Slot 2 at 4 (page 9), slot 0 at 4 .. 6 (page 1), the padding on the scratch page 0.
    assert layout.out_loc.tolist() == [0, 0, 0, 9 * 4 + 0, 0, 4, 5, 6, 0, 0, 0, 0]
    assert layout.seq_lens.tolist() == [5, 7, 4]
    assert layout.q_pad_index.tolist() == list(range(12))
    catch_up = CatchUp([2, 0], [1, 3], max_kv=21, min_start=5)
    assert deferred.stage(catch_up, Padding(3, 4), [5, 7]).host == HostLengths((4, 4, 4), (5, 7, 4))


def test_captured_catch_ups_take_small_batches_of_rows_long_enough_to_pad() -> None:
    graphs = DecodeGraphs(4, 300, 20, 4, kv_bounded=True, catch_up_capacity=40)
    assert graphs.catch_up_rows == [1, 2, 4] and graphs.catch_up_lens == [16, 32, 40]
    assert graphs.catch_up_key(CatchUp([1], [3], 100, 50)) == CatchUpKey(1, 16, 128)
    assert graphs.catch_up_key(CatchUp([1, 2, 3], [17, 2, 40], 64, 40)) == CatchUpKey(4, 40, 64)
    assert graphs.catch_up_key(CatchUp([0, 1, 2, 3, 4], [1] * 5, 64, 40)) is None  # 5 rows
    assert graphs.catch_up_key(CatchUp([1], [20], 64, 31)) is None  # a row shorter than 32
    assert len(graphs.catch_up_start_keys()) == 3 * 3 * len(graphs.kv_buckets)
    assert DecodeGraphs(4, 300, 20, 4).catch_up_start_keys() == []  # no deferral


def test_a_whole_request_buffered_catches_up_in_two_graphed_pieces() -> None:
    """Slot 1 buffered its whole request (20 positions of 20): 20 pads to 32, past its start,
    so its oldest 16 entries go first (ending 4 before the start: room for no padding), then
    its last 4 with slot 2's 5 (padded to 16, both starts past 16)."""
    graphs = DecodeGraphs(4, 300, 20, 4, kv_bounded=True, catch_up_capacity=40)
    deferred = DeferredCatchUp(capacity=40, rows=4, device=torch.device("cpu"))
    deferred.kv_floor[1:3] = [20, 100]
    catch_up = CatchUp([1, 2], [20, 5], max_kv=120, min_start=20)
    assert graphs.catch_up_key(catch_up) is None
    pieces = deferred.split(catch_up, graphs.catch_up_lens)
    assert pieces == (
        CatchUp([1], [16], 120, 16, first=(0,), behind=(4,)),
        CatchUp([1, 2], [4, 5], 120, 20, first=(16, 0), behind=(0, 0)),
    )
    keys = [graphs.catch_up_key(piece) for piece in pieces]
    assert keys == [CatchUpKey(1, 16, 128), CatchUpKey(2, 16, 128)]
    starts = torch.tensor([0, 20, 100, 0])
    page_table = torch.arange(4 * 32, dtype=torch.int32).view(4, 32)
    first = deferred.rows(deferred.stage(pieces[0], Padding(1, 16)), starts)
    assert first.starts.tolist() == [16] and first.real.all()
    assert first.token_index.tolist() == list(range(16))
    assert first.layout(page_table, page_size=4).positions.tolist() == list(range(16))
    second = deferred.rows(deferred.stage(pieces[1], Padding(2, 16)), starts)
    assert second.starts.tolist() == [20, 100]
    # Slot 1's padding reads its piece's first entry (16); its buffered ones are 16 .. 19.
    assert second.token_index.tolist() == [16] * 12 + [16, 17, 18, 19] + [0] * 11 + list(range(5))
    positions = second.layout(page_table, page_size=4).positions.tolist()
    assert positions[12:16] == [16, 17, 18, 19] and positions[27:] == [95, 96, 97, 98, 99]
    # On the host, each piece ends where its rows do: the first 4 before slot 1's start.
    assert deferred.stage(pieces[0], Padding(1, 16), [20]).host == HostLengths((16,), (16,))
    assert deferred.stage(pieces[1], Padding(2, 16), [20, 100]).host == HostLengths(
        (16, 16), (20, 100)
    )
    # A row shorter than the shortest length has nothing to split off: it runs eagerly.
    deferred.kv_floor[3] = 10
    assert deferred.split(CatchUp([3], [10], 20, 10), graphs.catch_up_lens) is None


# --- the engine ---------------------------------------------------------------------------


# n-gram keeps no draft state: nothing to defer.
ALGORITHMS = {name: flags for name, flags in DRAFT_ALGORITHMS.items() if name != "ngram"}


class EveryNth:
    """Every ``n``-th decode batch drafts: plain stretches longer than a small buffer."""

    def __init__(self, n: int, width: int) -> None:
        self.n, self.full, self.batches = n, width, 0

    def width(self, rows: list[Request]) -> int:
        self.batches += 1
        return self.full if self.batches % self.n == 0 else 1

    def feeds(self, req: Request, others: int) -> bool:
        return True

    def observe(
        self, req: Request, commit_len: int, drafts: int, ranks: list[int], rows: int
    ) -> None:
        pass


def _workload(first_rid: int = 0, shortest: int = 4) -> list[TokenizedRequest]:
    prompts = [
        [3 + (5 * i + 2 * j) % (VOCAB - 3) for j in range(shortest + 3 * i)] for i in range(5)
    ]
    return [
        request(first_rid + i, p, max_new_tokens=23, temperature=0.0 if i % 2 else 0.8, seed=i)
        for i, p in enumerate(prompts)
    ]


def _recorded(engine: Engine) -> list[torch.Tensor]:
    """Every drafting step's drafts, in order, from now on."""
    worker, drafts = engine.loop.runner.worker, []
    draft = worker.draft

    def recording(view: DecodeView) -> Drafts:
        out = draft(view)
        drafts.append(out.tokens.clone())
        return out

    worker.draft = recording  # type: ignore[method-assign]
    return drafts


class EagerCatchUpGraphs(DecodeGraphs):
    """On the CPU, catch-ups in their captured graphs' shape: a "capture" keeps the runner's
    catch-up of scratch rows (running it once, as a capture's warm-up does) and a "replay"
    runs it over the rows staged then; decode batches stay eager."""

    def __init__(self, max_rows: int, capacity: int) -> None:
        super().__init__(max_rows, 4096, 20, max_rows, kv_bounded=False, catch_up_capacity=capacity)

    def key(self, plan: StepPlan, kv_bound: int) -> None:
        return None

    def capture_catch_up(self, key: CatchUpKey, run: Callable[[], None]) -> None:
        run()
        self.catch_ups[key] = run  # type: ignore[assignment]  # kept instead of a graph

    def replay_catch_up(self, key: CatchUpKey) -> None:
        self.catch_ups[key]()  # type: ignore[operator]  # the kept run
        self.catch_up_replays += 1


def _record_splits(deferred: DeferredCatchUp, outcomes: list[bool]) -> None:
    """Append to ``outcomes``, for every catch-up that did not fit a graph whole, whether it
    split into pieces that do."""
    split = deferred.split

    def recorded(catch_up: CatchUp, lengths: list[int]) -> tuple[CatchUp, CatchUp] | None:
        pieces = split(catch_up, lengths)
        outcomes.append(pieces is not None)
        return pieces

    deferred.split = recorded  # type: ignore[method-assign]


DEVICES = [
    pytest.param("cpu", id="cpu"),
    # Every catch-up padded to its graph's shape (rows of the buffer's 3 positions, scratch
    # rows up to a bucket), run eagerly.
    pytest.param("cpu-padded", id="cpu-padded"),
    # The same with buffers of 40 positions (lengths 16, 32 and 40) and prompts of 17 tokens
    # or more: whole requests buffered, caught up in two pieces.
    pytest.param("cpu-split", id="cpu-split"),
    # float32 under CUDA graphs (the plain-step graphs hold the buffer's appends, their padding
    # rows the scratch slot's), every launch under the sync check.
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_deferred_catch_up_leaves_the_draft_where_catching_up_at_once_does(
    speculative_dirs: dict[str, str],
    algorithm: str,
    overlap: bool,
    device: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Buffers of 3 positions against plain stretches of 6 steps: full buffers catch up in
    plain steps, the rest before drafting, and ended requests' slots with the next plan (a
    second wave, then a lone prompt). Drafts agree at every drafting step and the draft's KV
    everywhere."""
    monkeypatch.setenv("OUTRIDER_DEBUG_SYNC_CHECK", "1")
    if device == "cuda":  # the relay check syncs inside a step and keeps graphs off
        monkeypatch.delenv("OUTRIDER_DEBUG_RELAY_CHECK")
    settings = dict(ALGORITHMS[algorithm])
    settings["draft_model"] = speculative_dirs[str(settings["speculative_algorithm"])]
    engines, drafts, tokens = [], [], []
    buffered, shortest = (40, 17) if device == "cpu-split" else (3, 4)
    split_counts: list[bool] = []  # per catch-up that did not fit whole: whether it split
    for capacity in (buffered, 0):
        engine = engine_for(
            speculative_dirs["target"],
            device="cpu" if device.startswith("cpu-") else device,
            no_overlap=not overlap,
            speculative_config=json.dumps({"deferred_catch_up": capacity}),
            **settings,
        )
        runner = engine.loop.runner
        assert (runner.deferred is None) == (capacity == 0)
        if device.startswith("cpu-") and runner.deferred is not None:
            runner.graphs = EagerCatchUpGraphs(8, capacity)
            _record_splits(runner.deferred, split_counts)
        engine.scheduler.use_policy(EveryNth(7, runner.shape.width))
        drafts.append(_recorded(engine))
        tokens.append(tokens_of(run(engine, _workload(shortest=shortest), stagger=2)))
        tokens[-1] |= tokens_of(run(engine, _workload(10, shortest)[:2]))
        # A prompt alone: the plan that catches the second wave's slots up. Longer than the
        # buffer, it runs the draft at once (a shorter one would stay buffered: no plan after
        # reports its end).
        lone = [4 + i % (VOCAB - 4) for i in range(buffered + 1)]
        run(engine, [request(20, lone, max_new_tokens=1)])
        engines.append(engine)
    assert tokens[0] == tokens[1]
    if device == "cpu-split":  # a whole wave buffered (prompts and plain steps) split
        assert split_counts and all(split_counts)
    graphs = engines[0].loop.runner.graphs
    if device != "cpu":  # most catch-ups replayed: the shortest prompt pads no row of 3
        assert graphs is not None and graphs.catch_up_replays > (10 if buffered == 3 else 5)
    if device != "cuda":  # under CUDA graphs the drafting replays without calling the worker
        assert len(drafts[0]) == len(drafts[1]) > 4
        for deferred, at_once in zip(*drafts, strict=True):
            assert torch.equal(deferred, at_once)
    else:
        assert all(e.loop.runner.graphs is not None for e in engines)
    kv = [e.loop.runner.worker.kv for e in engines]  # type: ignore[attr-defined]
    # A batch of positions rounds apart from one position at a time by float32's last bits.
    tolerance = 1e-4 if device == "cuda" else 1e-5
    for cache in ("k", "v"):
        for deferred, at_once in zip(getattr(kv[0], cache), getattr(kv[1], cache), strict=True):
            # Every page but the scratch page (page 0), which padding writes to.
            torch.testing.assert_close(deferred[1:], at_once[1:], rtol=tolerance, atol=tolerance)


def test_plain_steps_buffer_instead_of_running_the_draft(speculative_dirs: dict[str, str]) -> None:
    """With the policy off (no step drafts), the draft runs only over prompt endings longer
    than the buffer and the catch-up batches of ended requests, never once per plain step."""
    settings = {**ALGORITHMS["eagle3 chain"], "draft_model": speculative_dirs["eagle3"]}
    engine = engine_for(
        speculative_dirs["target"],
        speculative_config=json.dumps({"deferred_catch_up": 32}),
        **settings,
    )
    engine.scheduler.use_policy(EveryNth(10**9, engine.loop.runner.shape.width))
    worker = engine.loop.runner.worker
    calls: list[int] = []
    run_draft = worker._run  # type: ignore[attr-defined]

    def counting(tokens: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(tokens.shape[0])
        return run_draft(tokens, *args)

    worker._run = counting  # type: ignore[attr-defined]
    requests = _workload()[:2]
    run(engine, requests)
    # Prompts of 4 and 7 tokens, then 22 plain steps each (23 tokens, the first from the
    # prompt): buffers of 32 hold them all, caught up when the next plan comes.
    assert [len(r.input_ids) for r in requests] == [4, 7] and calls == []
    long_prompt = [3 + i % (VOCAB - 3) for i in range(40)]
    run(engine, [request(10, long_prompt, max_new_tokens=2)])
    # Its plan catches the two ended requests up in one batch first, then runs the draft
    # over its 40 tokens at once.
    assert calls == [4 + 7 + 2 * 22, 40]
