"""Typed step inputs: one field list for the fixed device buffers, their pinned host staging
and the host values a plan yields (ARCHITECTURE.md 4.3).

Each field is a flat 1-D buffer sized by what it counts: query tokens, batch rows or
request-table writes. A step's inputs are the leading views of the device buffers, so every
input keeps its address from step to step (what CUDA graphs need). Staging is double-buffered:
the set filled for step n is refilled for step n + 2, launched only after step n's results
were waited for (the loop processes n before it plans n + 2).

A decode batch's tokens, positions and KV lengths come from the relay on the device, not from
the host: for it ``input_ids``, ``positions`` and ``seq_lens`` are filled in place by the runner
and their host values are empty. A forward over a step's inputs reads them through a
``BatchLayout`` (``batch_layout``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Final, Generic, Literal, TypeVar

import numpy as np
import torch

from outrider.daemon.engine.plan import SlotParams, StepPlan
from outrider.plugins.device import BatchLayout, HostLengths, flat_kv_index
from outrider.protocol.messages import MAX_LOGIT_BIAS

T = TypeVar("T")
Per = Literal["token", "row", "page", "bias"]
# A slot's most committed tokens a step where its request sets no cap: more than any step's.
NO_CAP: Final = 1 << 30


# Each field's dtype and what its capacity counts.
_TOKEN: Final = {"dtype": torch.int64, "per": "token"}
_ROW: Final = {"dtype": torch.int64, "per": "row"}
_ROW_F32: Final = {"dtype": torch.float32, "per": "row"}
_PAGE: Final = {"dtype": torch.int64, "per": "page"}
_PAGE_I32: Final = {"dtype": torch.int32, "per": "page"}
_BIAS: Final = {"dtype": torch.int64, "per": "bias"}
_BIAS_F32: Final = {"dtype": torch.float32, "per": "bias"}


@dataclass(frozen=True)
class StepInputs(Generic[T]):
    """One step's inputs (``T``: a device or staging tensor, or a host array)."""

    input_ids: T = field(metadata=_TOKEN)  # [T] the query tokens
    positions: T = field(metadata=_TOKEN)  # [T] each token's position
    token_slots: T = field(metadata=_TOKEN)  # [T] each token's slot
    q_pad_index: T = field(metadata=_TOKEN)  # [T] row * max_q + offset in the row
    slots: T = field(metadata=_ROW)  # [bs]
    seq_lens: T = field(metadata=_ROW)  # [bs] KV length after the step
    q_start: T = field(metadata=_ROW)  # [bs + 1] cumulative query lengths
    # EXTEND rows whose chunk ends the prompt, and sample there:
    sample_index: T = field(metadata=_ROW)  # [n] flat index of the row's last token
    sample_slots: T = field(metadata=_ROW)  # [n]
    sample_rows: T = field(metadata=_ROW)  # [n]
    sample_positions: T = field(metadata=_ROW)  # [n] output index drawn
    # [bs] EXTEND: the token after each row's chunk (sampled rows: written on the device).
    next_tokens: T = field(metadata=_ROW)
    # EXTEND rows that take their one token from the relay (decoding rows riding the batch):
    relay_index: T = field(metadata=_ROW)  # [n] flat index of the row's token
    relay_slots: T = field(metadata=_ROW)  # [n]
    # Sampling parameters of the slots admitted by this step.
    admit_slots: T = field(metadata=_ROW)
    admit_temperature: T = field(metadata=_ROW_F32)
    admit_top_p: T = field(metadata=_ROW_F32)
    admit_top_k: T = field(metadata=_ROW)
    admit_seed: T = field(metadata=_ROW)
    admit_min_p: T = field(metadata=_ROW_F32)
    admit_presence: T = field(metadata=_ROW_F32)
    admit_frequency: T = field(metadata=_ROW_F32)
    admit_repetition: T = field(metadata=_ROW_F32)
    admit_max_commit: T = field(metadata=_ROW)  # tokens a step commits at most (NO_CAP)
    # [admitted * MAX_LOGIT_BIAS] each admitted slot's logit bias, padded with (0, 0.0)
    admit_bias_ids: T = field(metadata=_BIAS)
    admit_bias_values: T = field(metadata=_BIAS_F32)
    released_slots: T = field(metadata=_ROW)  # debug: relay rows to poison
    page_writes: T = field(metadata=_PAGE)  # flat request-table indices
    page_values: T = field(metadata=_PAGE_I32)
    window_writes: T = field(metadata=_PAGE)  # page ids whose window page changed
    window_values: T = field(metadata=_PAGE_I32)
    window_copies_from: T = field(metadata=_PAGE)  # window pages copied before the step
    window_copies_to: T = field(metadata=_PAGE)


_FIELDS = fields(StepInputs)


@dataclass(frozen=True)
class Capacity:
    """What each kind of input buffer holds at most."""

    tokens: int  # query tokens per step
    rows: int  # batch rows per step
    pages: int  # request-table writes per step

    def of(self, per: Per) -> int:
        bias = self.rows * MAX_LOGIT_BIAS
        return {"token": self.tokens, "row": self.rows, "page": self.pages, "bias": bias}[per]


def host_values(plan: StepPlan, *, poison_released: bool) -> StepInputs[np.ndarray]:
    """The host's part of ``plan``'s inputs."""
    q_lens = np.asarray(plan.q_lens, dtype=np.int64)
    starts = np.asarray(plan.starts, dtype=np.int64)
    n_tok, max_q = plan.num_tokens, max(plan.q_lens)
    row_of_token = np.repeat(np.arange(plan.bs, dtype=np.int64), q_lens)
    q_start = np.zeros(plan.bs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=q_start[1:])
    offset = np.arange(n_tok, dtype=np.int64) - q_start[row_of_token]
    slots = np.asarray(plan.slots, dtype=np.int64)
    sample_rows = np.asarray(plan.sample_rows, dtype=np.int64)
    relay_rows = np.asarray(plan.relay_rows, dtype=np.int64)
    admitted = plan.slot_params
    bias_ids = np.zeros((len(admitted), MAX_LOGIT_BIAS), dtype=np.int64)
    bias_values = np.zeros((len(admitted), MAX_LOGIT_BIAS), dtype=np.float32)
    for i, p in enumerate(admitted):
        for j, (token_id, bias) in enumerate(p.sampling.logit_bias):
            bias_ids[i, j], bias_values[i, j] = token_id, bias
    extend = plan.kind == "extend"
    empty = np.zeros(0, dtype=np.int64)
    return StepInputs(
        input_ids=np.asarray(plan.input_ids, dtype=np.int64) if extend else empty,
        positions=starts[row_of_token] + offset if extend else empty,
        token_slots=slots[row_of_token],
        q_pad_index=row_of_token * max_q + offset,
        slots=slots,
        seq_lens=starts + q_lens if extend else empty,
        q_start=q_start,
        sample_index=q_start[sample_rows + 1] - 1 if extend else empty,
        sample_slots=slots[sample_rows] if extend else empty,
        sample_rows=sample_rows if extend else empty,
        sample_positions=np.asarray(plan.sample_positions, dtype=np.int64),
        next_tokens=np.asarray(plan.next_ids, dtype=np.int64),
        relay_index=q_start[relay_rows],
        relay_slots=slots[relay_rows],
        admit_slots=np.asarray([p.slot for p in admitted], dtype=np.int64),
        admit_temperature=np.asarray([p.sampling.temperature for p in admitted], np.float32),
        admit_top_p=np.asarray([p.sampling.top_p for p in admitted], dtype=np.float32),
        admit_top_k=np.asarray([p.sampling.top_k for p in admitted], dtype=np.int64),
        admit_seed=np.asarray([p.sampling.seed for p in admitted], dtype=np.int64),
        admit_min_p=np.asarray([p.sampling.min_p for p in admitted], np.float32),
        admit_presence=np.asarray([p.sampling.presence_penalty for p in admitted], np.float32),
        admit_frequency=np.asarray([p.sampling.frequency_penalty for p in admitted], np.float32),
        admit_repetition=np.asarray([p.sampling.repetition_penalty for p in admitted], np.float32),
        admit_max_commit=np.asarray([_max_commit(p) for p in admitted], dtype=np.int64),
        admit_bias_ids=bias_ids.reshape(-1),
        admit_bias_values=bias_values.reshape(-1),
        released_slots=np.asarray(plan.released_slots if poison_released else [], np.int64),
        page_writes=np.asarray(plan.page_writes, dtype=np.int64),
        page_values=np.asarray(plan.page_values, dtype=np.int32),
        window_writes=np.asarray(plan.window_writes, dtype=np.int64),
        window_values=np.asarray(plan.window_values, dtype=np.int32),
        window_copies_from=np.asarray(plan.window_copies_from, dtype=np.int64),
        window_copies_to=np.asarray(plan.window_copies_to, dtype=np.int64),
    )


def _max_commit(params: SlotParams) -> int:
    """The most tokens a step commits for an admitted slot: its drafts and the target's own."""
    return NO_CAP if params.max_drafts is None else params.max_drafts + 1


def batch_layout(
    plan: StepPlan,
    inputs: StepInputs[torch.Tensor],
    page_table: torch.Tensor,
    page_size: int,
    kv_positions: torch.Tensor,
    max_kv: int,
    starts: tuple[int, ...] | None,
    tree_mask: torch.Tensor | None = None,
) -> BatchLayout:
    """The layout of a forward over ``inputs``: token ``i``'s K/V goes to its row's position
    ``kv_positions[i]``; ``starts``: the rows' exact starts, where the host has them
    (``KnownStarts``, slots.py)."""
    host = None
    if starts is not None:
        ends = tuple(start + q for start, q in zip(starts, plan.q_lens, strict=True))
        host = HostLengths(tuple(plan.q_lens), ends)
    out_loc = flat_kv_index(page_table, inputs.token_slots, kv_positions.reshape(-1), page_size)
    return BatchLayout(
        page_table=page_table,
        page_size=page_size,
        slots=inputs.slots,
        positions=inputs.positions,
        out_loc=out_loc,
        q_start=inputs.q_start,
        seq_lens=inputs.seq_lens,
        q_pad_index=inputs.q_pad_index,
        bs=plan.bs,
        max_q=max(plan.q_lens),
        max_kv=max_kv,
        tree_mask=tree_mask,
        host=host,
    )


class InputBuffers:
    """The fixed device buffers of every input and their double-buffered host staging."""

    def __init__(self, capacity: Capacity, device: torch.device) -> None:
        self.capacity = capacity
        pin = device.type == "cuda"
        self.device_buffers = self._allocate(
            lambda n, dtype: torch.zeros(n, dtype=dtype, device=device)
        )
        staging = [
            self._allocate(lambda n, dtype: torch.zeros(n, dtype=dtype, pin_memory=pin))
            for _ in range(2)
        ]
        # Per staging set and field: (name, device buffer, staging tensor, its array view).
        self._bindings = [
            [
                (
                    f.name,
                    getattr(self.device_buffers, f.name),
                    getattr(host, f.name),
                    getattr(host, f.name).numpy(),
                )
                for f in _FIELDS
            ]
            for host in staging
        ]
        self._empty_views = {f.name: getattr(self.device_buffers, f.name)[:0] for f in _FIELDS}
        self._parity = 0

    def stage(self, plan: StepPlan, values: StepInputs[np.ndarray]) -> StepInputs[torch.Tensor]:
        """Copy ``values`` into the next staging set and from there into the device buffers
        (queued on the current stream); returns this step's views of the device buffers."""
        assert plan.num_tokens <= self.capacity.tokens, "plan exceeds the step token budget"
        bindings, self._parity = self._bindings[self._parity], self._parity ^ 1
        views = dict(self._empty_views)
        for name, device, host, host_array in bindings:
            value: np.ndarray = getattr(values, name)
            n = len(value)
            if n:
                host_array[:n] = value
                view = views[name] = device[:n]
                view.copy_(host[:n], non_blocking=True)
        # Filled on the device for a decode batch (module docstring).
        n_tok, bs = plan.num_tokens, plan.bs
        views.update(
            input_ids=self.device_buffers.input_ids[:n_tok],
            positions=self.device_buffers.positions[:n_tok],
            seq_lens=self.device_buffers.seq_lens[:bs],
        )
        return StepInputs(**views)

    def _allocate(self, make: Any) -> StepInputs[torch.Tensor]:
        return StepInputs(
            **{
                f.name: make(self.capacity.of(f.metadata["per"]), f.metadata["dtype"])
                for f in _FIELDS
            }
        )
