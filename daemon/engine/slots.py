"""Per-slot device state: the request table, the relay and the sampling parameters.

The relay holds, per slot, what the next decode batch reads: the next input token (the last
committed one, whose KV is not written yet), the committed KV length (that token's position,
the row's next start) and the output tokens committed (the randomness counter). A decode
batch reads all three, so its positions and draws never come from the host, which plans a
step before it knows how many tokens the previous one committed (speculative decoding).
Sampling parameters and logit adjustments are written when a request is admitted.

Slot ``max_slots`` is the scratch slot: the padding rows of a captured decode batch run there.
Its request-table row stays on the scratch page, and its relay is reset after every padded
step, so padding never reaches a live request's state nor runs past the table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from outrider.daemon.engine.inputs import NO_CAP, StepInputs
from outrider.daemon.engine.penalties import LogitAdjust
from outrider.daemon.engine.plan import StepPlan
from outrider.plugins.device import KVCache, SamplingBatch
from outrider.protocol.messages import MAX_LOGIT_BIAS


@dataclass(frozen=True)
class RelayRows:
    """The relay of a batch's slots, read before the step."""

    roots: torch.Tensor  # [bs] int64: the next input token
    starts: torch.Tensor  # [bs] int64: the committed KV length = the root's position
    out_lens: torch.Tensor  # [bs] int64: output tokens committed


class SlotState:
    def __init__(
        self,
        max_slots: int,
        max_pages: int,
        device: torch.device,
        kv: KVCache | None = None,
    ) -> None:
        """``kv``: the target's cache, whose window pages (``KVCache.window_map``) the plans'
        window writes and copies change; None: a cache without them."""
        rows = max_slots + 1  # the scratch slot last
        self.kv = kv

        def zeros(dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(rows, dtype=dtype, device=device)

        self.scratch_slot = max_slots
        # Page 0 is scratch: empty table entries point there.
        self.page_table = torch.zeros(
            (rows, max_pages), dtype=torch.int32, device=device
        )  # [max_slots + 1, max_pages]
        self.relay_tokens = zeros()  # [max_slots + 1]
        self.relay_starts = zeros()  # [max_slots + 1]
        self.relay_out_lens = zeros()  # [max_slots + 1]
        self.temperature = zeros(torch.float32)
        self.top_p = zeros(torch.float32)
        self.top_k = zeros()
        self.seed = zeros()
        self.min_p = zeros(torch.float32)
        self.presence = zeros(torch.float32)
        self.frequency = zeros(torch.float32)
        self.repetition = zeros(torch.float32)
        # The most tokens a step commits for each slot (a request's draft cap; NO_CAP: none,
        # the scratch slot's too).
        self.max_commit = torch.full((rows,), NO_CAP, dtype=torch.int64, device=device)
        self.bias_ids = torch.zeros((rows, MAX_LOGIT_BIAS), dtype=torch.int64, device=device)
        self.bias_values = torch.zeros((rows, MAX_LOGIT_BIAS), dtype=torch.float32, device=device)
        # Debug: released slots' relay rows are poisoned (-1) and every decode batch asserts
        # (with a host sync) that it reads only rows rewritten since.
        self.relay_check = False

    def enable_relay_check(self) -> None:
        """Debug: poison every relay row now (all slots must be free) and on each release."""
        self.relay_check = True
        self.relay_tokens.fill_(-1)

    def apply(self, inputs: StepInputs[torch.Tensor]) -> None:
        """Relay poisoning (debug), request-table and window-map writes, window page copies
        and the sampling parameters of newly admitted slots; released slots are poisoned
        before an admission may reuse them. Most decode steps have none of these: nothing is
        queued then."""
        if inputs.released_slots.numel():
            self.relay_tokens.index_fill_(0, inputs.released_slots, -1)
        if inputs.page_writes.numel():
            self.page_table.view(-1).index_copy_(0, inputs.page_writes, inputs.page_values)
        if inputs.window_writes.numel() or inputs.window_copies_to.numel():
            assert self.kv is not None and self.kv.window_map is not None, "no window pages"
            self.kv.window_map.index_copy_(0, inputs.window_writes, inputs.window_values)
            self.kv.copy_window_pages(inputs.window_copies_from, inputs.window_copies_to)
        slots = inputs.admit_slots
        if not slots.numel():
            return
        self.temperature.index_copy_(0, slots, inputs.admit_temperature)
        self.top_p.index_copy_(0, slots, inputs.admit_top_p)
        self.top_k.index_copy_(0, slots, inputs.admit_top_k)
        self.seed.index_copy_(0, slots, inputs.admit_seed)
        self.min_p.index_copy_(0, slots, inputs.admit_min_p)
        self.presence.index_copy_(0, slots, inputs.admit_presence)
        self.frequency.index_copy_(0, slots, inputs.admit_frequency)
        self.repetition.index_copy_(0, slots, inputs.admit_repetition)
        self.max_commit.index_copy_(0, slots, inputs.admit_max_commit)
        self.bias_ids.index_copy_(0, slots, inputs.admit_bias_ids.view(-1, MAX_LOGIT_BIAS))
        self.bias_values.index_copy_(0, slots, inputs.admit_bias_values.view(-1, MAX_LOGIT_BIAS))

    def read(self, slots: torch.Tensor) -> RelayRows:
        rows = RelayRows(
            self.relay_tokens[slots], self.relay_starts[slots], self.relay_out_lens[slots]
        )
        if self.relay_check and not bool((rows.roots >= 0).all()):
            raise AssertionError("a decode batch read a relay row that was not rewritten")
        return rows

    def write(
        self,
        slots: torch.Tensor,
        tokens: torch.Tensor,
        starts: torch.Tensor,
        out_lens: torch.Tensor,
    ) -> None:
        """Seed or advance the relay of ``slots``."""
        self.relay_tokens.index_copy_(0, slots, tokens)
        self.relay_starts.index_copy_(0, slots, starts)
        self.relay_out_lens.index_copy_(0, slots, out_lens)

    def reset_scratch(self) -> None:
        """The scratch slot's relay back to position 0 (after a step with padding rows)."""
        for relay in (self.relay_tokens, self.relay_starts, self.relay_out_lens):
            relay.narrow(0, self.scratch_slot, 1).zero_()

    def sampling(self, row_slots: torch.Tensor, plan: StepPlan) -> SamplingBatch:
        """The sampling parameters of slot ``row_slots[r]`` for each row."""
        return SamplingBatch(
            temperature=self.temperature[row_slots],
            top_p=self.top_p[row_slots],
            top_k=self.top_k[row_slots],
            seed=self.seed[row_slots],
            all_greedy=plan.all_greedy,
            max_logprobs=plan.max_logprobs,
            min_p=self.min_p[row_slots] if plan.adjusts else None,
            cuts=plan.cuts,
        )

    def adjust(self, row_slots: torch.Tensor) -> LogitAdjust:
        """The logit adjustments of slot ``row_slots[r]`` for each row."""
        return LogitAdjust(
            presence=self.presence[row_slots],
            frequency=self.frequency[row_slots],
            repetition=self.repetition[row_slots],
            bias_ids=self.bias_ids[row_slots],
            bias_values=self.bias_values[row_slots],
        )


class HostStarts:
    """A host copy of every slot's committed KV length (the relay's starts), refreshed after
    each launch: for a verify backend that plans on the host from exact lengths
    (``AttentionCapabilities.host_plans``). Reading it waits for the last refresh, that is
    for the whole previous step on the device: the one host sync of such a configuration."""

    def __init__(self, starts: torch.Tensor) -> None:
        self.starts = starts  # [max_slots + 1] int64, on the device
        cuda = starts.device.type == "cuda"
        # On the CPU the relay itself is on the host, and every launch has run when it returns.
        self.host = torch.zeros_like(starts, device="cpu").pin_memory() if cuda else starts
        self.copied: torch.cuda.Event | None = None

    def refresh(self) -> None:
        """Queue the copy of the relay's starts as they will be after the queued work."""
        if self.host is self.starts:
            return
        self.host.copy_(self.starts, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()

    def read(self, slots: list[int]) -> list[int]:
        if self.copied is not None:
            self.copied.synchronize()
        values: list[int] = self.host[slots].tolist()
        return values


@dataclass(frozen=True)
class KnownStarts:
    """The rows' exact starts where the host knows them, for backends that plan on the host
    (``HostLengths``): prompt chunks, and plain decode (whose ``starts`` are exact: every step
    commits one token a row). A speculative cycle's starts (the accepted lengths) exist only on
    the device: the host has them only by waiting for the previous cycle (``copies``)."""

    speculative: bool
    cuda: bool
    copies: HostStarts | None  # exact cycle lengths: the relay's starts after each launch

    def of_plan(self, plan: StepPlan) -> tuple[int, ...] | None:
        """``plan``'s rows' starts, or None; None under a graph's capture, which must not wait
        (its backends were planned beforehand)."""
        if self.cuda and torch.cuda.is_current_stream_capturing():
            return None
        if plan.kind == "decode" and self.speculative:
            return None if self.copies is None else tuple(self.copies.read(plan.slots))
        return tuple(plan.starts)

    def of_slots(self, slots: list[int]) -> list[int] | None:
        """The exact starts of ``slots`` where a backend plans on the host (the first read
        waits for the previous step), else None."""
        return None if self.copies is None else self.copies.read(slots)
