"""The engine's per-step host work: input staging, per-slot writes and result copies (CPU)."""

from __future__ import annotations

import torch

from outrider.daemon.engine.inputs import Capacity, InputBuffers, host_values
from outrider.daemon.engine.plan import SlotParams, StepPlan
from outrider.daemon.engine.results import ResultCopies, StepResults
from outrider.daemon.engine.slots import SlotState
from outrider.plugins.sampling_spec import SamplingSpec

CPU = torch.device("cpu")
ADMITTED = SlotParams(1, SamplingSpec(0.5, 0.9, 4, 11))


def _plan(kind: str = "decode", **fields: object) -> StepPlan:
    values: dict[str, object] = {
        "kind": kind,
        "slots": [2, 0],
        "starts": [7, 3],
        "q_lens": [2, 2],
        "input_ids": [],
        "sample_rows": [0, 1],
        "sample_positions": [],
        "page_writes": [],
        "page_values": [],
        "slot_params": [],
        "max_logprobs": 0,
        "all_greedy": True,
    }
    values.update(fields)
    return StepPlan(**values)  # type: ignore[arg-type]


def test_stage_copies_the_plan_and_leaves_unused_inputs_empty() -> None:
    buffers = InputBuffers(Capacity(tokens=16, rows=4, pages=8), CPU)
    plan = _plan(page_writes=[5], page_values=[9])
    staged = buffers.stage(plan, host_values(plan, poison_released=False))
    assert staged.slots.tolist() == [2, 0]
    assert staged.token_slots.tolist() == [2, 2, 0, 0]
    assert staged.q_start.tolist() == [0, 2, 4]
    assert staged.q_pad_index.tolist() == [0, 1, 2, 3]
    assert staged.page_writes.tolist() == [5] and staged.page_values.tolist() == [9]
    # Views of the fixed buffers: their addresses never change (CUDA graphs).
    assert staged.slots.data_ptr() == buffers.device_buffers.slots.data_ptr()
    assert staged.admit_slots.numel() == 0 and staged.released_slots.numel() == 0
    # Decode: tokens, positions and KV lengths are filled on the device, sized to the batch.
    assert staged.input_ids.numel() == 4 and staged.seq_lens.numel() == 2
    # The next step (the other staging set) sees its own values only.
    extend = _plan(
        "extend", slots=[1], starts=[0], q_lens=[3], input_ids=[4, 5, 6], sample_rows=[0],
        sample_positions=[0], next_ids=[0], slot_params=[ADMITTED],
    )  # fmt: skip
    staged = buffers.stage(extend, host_values(extend, poison_released=False))
    assert staged.input_ids.tolist() == [4, 5, 6]
    assert staged.positions.tolist() == [0, 1, 2]
    assert staged.seq_lens.tolist() == [3]
    assert staged.admit_slots.tolist() == [1] and staged.admit_top_k.tolist() == [4]
    assert staged.page_writes.numel() == 0


def test_apply_writes_only_what_the_step_carries() -> None:
    slots = SlotState(max_slots=3, max_pages=2, device=CPU)
    buffers = InputBuffers(Capacity(tokens=16, rows=4, pages=8), CPU)
    admit = _plan(slot_params=[ADMITTED], page_writes=[2, 3], page_values=[6, 7])
    slots.apply(buffers.stage(admit, host_values(admit, poison_released=False)))
    assert slots.page_table.view(-1).tolist() == [0, 0, 6, 7, 0, 0, 0, 0]
    assert slots.temperature.tolist() == [0.0, 0.5, 0.0, 0.0]
    assert slots.top_k.tolist() == [0, 4, 0, 0] and slots.seed.tolist() == [0, 11, 0, 0]
    plain = _plan()
    slots.apply(buffers.stage(plain, host_values(plain, poison_released=False)))
    assert slots.page_table.view(-1).tolist() == [0, 0, 6, 7, 0, 0, 0, 0]
    assert slots.top_k.tolist() == [0, 4, 0, 0]


def _results(rows: int, m: int, k: int) -> StepResults:
    return StepResults(
        tokens=torch.arange(rows * m).view(rows, m),
        commit_lens=torch.tensor([2, 1][:rows]),
        logprob=-torch.arange(rows * m, dtype=torch.float32).view(rows, m),
        top_ids=torch.arange(rows * m * k).view(rows, m, k),
        top_logprobs=-torch.ones(rows, m, k),
    )


def test_collect_cuts_each_row_to_its_commit_length() -> None:
    copies = ResultCopies(max_rows=4, max_commit=2, device=CPU)
    out = copies.collect(copies.copy(_plan(), _results(2, 2, 3)))
    assert out.tokens == [[0, 1], [2]]
    assert out.logprobs == [[0.0, -1.0], [-2.0]]
    # No row asked for top logprobs: none are copied or returned.
    assert out.top_ids == [] and out.top_logprobs == []
    out = copies.collect(copies.copy(_plan(max_logprobs=2), _results(2, 2, 3)))
    assert out.top_ids == [[[0, 1], [3, 4]], [[6, 7]]]
    assert out.top_logprobs == [[[-1.0, -1.0], [-1.0, -1.0]], [[-1.0, -1.0]]]


def test_results_land_contiguous_in_the_shape_sampled() -> None:
    # A plain step of a speculative engine samples one column into buffers of max_commit:
    # a strided destination would make the device -> host copy wait for the step.
    copies = ResultCopies(max_rows=4, max_commit=3, device=CPU)
    launched = copies.copy(_plan(max_logprobs=2), _results(2, 1, 3))
    landed = launched.results
    for value in (landed.tokens, landed.logprob, landed.top_ids, landed.top_logprobs):
        assert value.is_contiguous() and value.shape[:2] == (2, 1)
    assert landed.commit_lens is not None and landed.commit_lens.shape == (2,)
    out = copies.collect(launched)
    assert out.tokens == [[0], [1]] and out.top_ids == [[[0, 1]], [[3, 4]]]
    nothing = _plan(kind="extend", sample_rows=[], max_logprobs=2)
    assert copies.collect(copies.copy(nothing, None)).top_ids == []
