"""The in-process executor: runs a ``StepPlan`` on the device without a host sync.

Buffers (DESIGN.md 4.3):
- fixed-address device buffers for every per-step input (what CUDA graphs need), filled in
  place from host staging buffers (pinned on CUDA). Staging is double-buffered: the set used by
  step n is refilled by step n + 2, which is launched only after step n's result event was
  waited (the loop processes n before it plans n + 2).
- the per-slot relay buffer: the token sampled for a slot, read as the slot's next input.
- per-slot sampling parameters, written when a request is admitted.
Input copies, the forward, sampling and relay writes run on the compute stream; only the result
copy (device -> host) runs on a side stream, gated by an event.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from outrider.daemon.engine.forward import ForwardBatch, KVCache
from outrider.daemon.engine.plan import StepPlan
from outrider.daemon.engine.sampling import SamplingBatch, sample
from outrider.plugins.api import Phase
from outrider.plugins.attention.base import AttentionBackend

MAX_LOGPROBS = 20


class CausalLM(Protocol):
    def forward(self, input_ids: torch.Tensor, fb: ForwardBatch) -> torch.Tensor: ...
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class RunnerLimits:
    max_slots: int
    max_pages: int  # per request: ceil((context_length + reservation) / page_size)
    max_tokens: int  # per step
    vocab_limit: int  # sampled ids stay below this (the tokenizer's length)


@dataclass
class StepOutput:
    """Host results of one step, one entry per sampled row (``plan.sample_rows`` order)."""

    tokens: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class Launched:
    plan: StepPlan
    event: Any  # torch.cuda.Event | None
    host: dict[str, torch.Tensor]


# name -> (dtype, capacity class): "token" entries per query token, "row" per batch row,
# "page" per request-table write.
_INPUTS: dict[str, tuple[torch.dtype, str]] = {
    "input_ids": (torch.int64, "token"),
    "positions": (torch.int64, "token"),
    "token_slots": (torch.int64, "token"),
    "q_pad_index": (torch.int64, "token"),
    "slots": (torch.int64, "row"),
    "seq_lens": (torch.int64, "row"),
    "q_start": (torch.int64, "row"),
    "sample_index": (torch.int64, "row"),
    "sample_slots": (torch.int64, "row"),
    "sample_positions": (torch.int64, "row"),
    "admit_slots": (torch.int64, "row"),
    "admit_temperature": (torch.float32, "row"),
    "admit_top_p": (torch.float32, "row"),
    "admit_top_k": (torch.int64, "row"),
    "admit_seed": (torch.int64, "row"),
    "released_slots": (torch.int64, "row"),
    "page_writes": (torch.int64, "page"),
    "page_values": (torch.int32, "page"),
}


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        backends: Mapping[Phase, AttentionBackend],
        limits: RunnerLimits,
        device: torch.device,
    ) -> None:
        self.model = model
        self.sync_check = False
        # Debug: released slots' relay rows are poisoned (-1) and every STEP asserts (with a
        # host sync) that it reads only rows rewritten since.
        self.relay_check = False
        self.kv = kv
        self.backends = backends
        self.limits = limits
        self.device = device
        cuda = device.type == "cuda"
        n_slots = limits.max_slots
        row_cap = n_slots + 1
        capacity = {
            "token": limits.max_tokens,
            "row": row_cap,
            # A step can at most rewrite the whole request table.
            "page": n_slots * limits.max_pages,
        }

        def dev(n: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=device)

        def host(n: int, dtype: torch.dtype, cols: int = 0) -> torch.Tensor:
            shape = (n, cols) if cols else (n,)
            return torch.zeros(shape, dtype=dtype, pin_memory=cuda)

        # Page 0 is scratch: empty table entries point there.
        self.page_table = torch.zeros(
            (n_slots, limits.max_pages), dtype=torch.int32, device=device
        )  # [max_slots, max_pages]
        self.relay_tokens = dev(n_slots)  # [max_slots]
        self.slot_temperature = dev(n_slots, torch.float32)
        self.slot_top_p = dev(n_slots, torch.float32)
        self.slot_top_k = dev(n_slots)
        self.slot_seed = dev(n_slots)
        self.inputs = {name: dev(capacity[cls], dtype) for name, (dtype, cls) in _INPUTS.items()}
        self.staging = [
            {name: host(capacity[cls], dtype) for name, (dtype, cls) in _INPUTS.items()}
            for _ in range(2)
        ]
        self.results = [
            {
                "tokens": host(row_cap, torch.int64),
                "logprob": host(row_cap, torch.float32),
                "top_ids": host(row_cap, torch.int64, MAX_LOGPROBS),
                "top_logprobs": host(row_cap, torch.float32, MAX_LOGPROBS),
            }
            for _ in range(2)
        ]
        self._parity = 0
        self.copy_stream = torch.cuda.Stream(device) if cuda else None

    def enable_sync_check(self, on: bool) -> None:
        """Debug: make any host synchronisation inside ``launch`` raise (CUDA only)."""
        self.sync_check = on and self.device.type == "cuda"

    def enable_relay_check(self) -> None:
        """Debug: poison every relay row now (all slots must be free) and on each release."""
        self.relay_check = True
        self.relay_tokens.fill_(-1)

    # --- the step ------------------------------------------------------------------------

    def launch(self, plan: StepPlan) -> Launched:
        """Queue ``plan`` on the device and return a handle for ``collect``. With
        ``sync_check`` (CUDA), any host synchronisation inside raises."""
        if not self.sync_check:
            return self._launch(plan)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return self._launch(plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def _launch(self, plan: StepPlan) -> Launched:
        parity, self._parity = self._parity, self._parity ^ 1
        lengths = self._stage(plan, self.staging[parity])
        inp = {name: self.inputs[name][:n] for name, n in lengths.items()}
        self._apply_admissions(inp)
        if plan.kind == "step":
            # input_ids: [bs] from the relay (the CPU does not know them yet)
            torch.index_select(self.relay_tokens, 0, inp["slots"], out=inp["input_ids"])
            if self.relay_check and not bool((inp["input_ids"] >= 0).all()):
                raise AssertionError("a STEP read a relay row that was not rewritten")
        ps = self.kv.page_size
        page_idx = torch.div(inp["positions"], ps, rounding_mode="floor")
        out_loc = self.page_table[inp["token_slots"], page_idx].to(torch.int64) * ps + (
            inp["positions"] % ps
        )  # [T]
        phase: Phase = "extend" if plan.kind == "extend" else "decode"
        backend = self.backends[phase]
        fb = ForwardBatch(
            backend=backend,
            kv=self.kv,
            page_table=self.page_table,
            slots=inp["slots"],
            positions=inp["positions"],
            out_loc=out_loc,
            q_start=inp["q_start"],
            seq_lens=inp["seq_lens"],
            q_pad_index=inp["q_pad_index"],
            bs=plan.bs,
            max_q=max(plan.q_lens),
            max_kv=max(s + q for s, q in zip(plan.starts, plan.q_lens, strict=True)),
        )
        backend.prepare(fb)
        hidden = self.model.forward(inp["input_ids"], fb)  # [T, H]
        results = self.results[parity]
        event = None
        if plan.sample_rows:
            logits = self.model.compute_logits(hidden[inp["sample_index"]])  # [n, V]
            sample_slots = inp["sample_slots"]
            batch = SamplingBatch(
                temperature=self.slot_temperature[sample_slots],
                top_p=self.slot_top_p[sample_slots],
                top_k=self.slot_top_k[sample_slots],
                seed=self.slot_seed[sample_slots],
                all_greedy=plan.all_greedy,
                max_logprobs=plan.max_logprobs,
            )
            out = sample(
                logits,
                batch,
                inp["sample_positions"],
                vocab_limit=self.limits.vocab_limit,
            )
            self.relay_tokens.index_copy_(0, sample_slots, out.tokens)
            event = self._copy_results(
                results,
                {
                    "tokens": out.tokens,
                    "logprob": out.logprob,
                    "top_ids": out.top_ids,
                    "top_logprobs": out.top_logprobs,
                },
            )
        return Launched(plan=plan, event=event, host=results)

    def collect(self, launched: Launched) -> StepOutput:
        """Wait for ``launched``'s results and return them on the host."""
        if launched.event is not None:
            launched.event.synchronize()
        n = len(launched.plan.sample_rows)
        k = launched.plan.max_logprobs
        host = launched.host
        return StepOutput(
            tokens=host["tokens"][:n].tolist(),
            logprobs=host["logprob"][:n].tolist(),
            top_ids=host["top_ids"][:n, :k].tolist() if k else [[] for _ in range(n)],
            top_logprobs=host["top_logprobs"][:n, :k].tolist() if k else [[] for _ in range(n)],
        )

    # --- helpers -------------------------------------------------------------------------

    def _stage(self, plan: StepPlan, staging: dict[str, torch.Tensor]) -> dict[str, int]:
        """Fill host staging from ``plan``, copy it into the fixed device buffers and return
        each input's length for this step."""
        q_lens = np.asarray(plan.q_lens, dtype=np.int64)
        starts = np.asarray(plan.starts, dtype=np.int64)
        n_tok = int(q_lens.sum())
        assert n_tok <= self.limits.max_tokens, "plan exceeds the step token budget"
        max_q = int(q_lens.max())
        row_of_token = np.repeat(np.arange(plan.bs, dtype=np.int64), q_lens)
        q_start = np.zeros(plan.bs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=q_start[1:])
        offset = np.arange(n_tok, dtype=np.int64) - q_start[row_of_token]
        slots = np.asarray(plan.slots, dtype=np.int64)
        sample_rows = np.asarray(plan.sample_rows, dtype=np.int64)
        admitted = plan.slot_params
        values: dict[str, np.ndarray | list[int] | list[float]] = {
            "input_ids": plan.input_ids if plan.kind == "extend" else [],
            "positions": starts[row_of_token] + offset,
            "token_slots": slots[row_of_token],
            "q_pad_index": row_of_token * max_q + offset,
            "slots": slots,
            "seq_lens": starts + q_lens,
            "q_start": q_start,
            "sample_index": q_start[sample_rows + 1] - 1,
            "sample_slots": slots[sample_rows],
            "sample_positions": plan.sample_positions,
            "admit_slots": [p.slot for p in admitted],
            "admit_temperature": [p.temperature for p in admitted],
            "admit_top_p": [p.top_p for p in admitted],
            "admit_top_k": [p.top_k for p in admitted],
            "admit_seed": [p.seed for p in admitted],
            "released_slots": plan.released_slots if self.relay_check else [],
            "page_writes": plan.page_writes,
            "page_values": plan.page_values,
        }
        lengths = {}
        for name, value in values.items():
            n = len(value)
            lengths[name] = n
            if n:
                staging[name].numpy()[:n] = value
                self.inputs[name][:n].copy_(staging[name][:n], non_blocking=True)
        # A STEP's input_ids come from the relay, one per row.
        lengths["input_ids"] = n_tok
        return lengths

    def _apply_admissions(self, inp: dict[str, torch.Tensor]) -> None:
        """Relay poisoning (debug), request-table writes and the sampling parameters of newly
        admitted slots; released slots are poisoned before an admission may reuse them."""
        self.relay_tokens.index_fill_(0, inp["released_slots"], -1)
        self.page_table.view(-1).index_copy_(0, inp["page_writes"], inp["page_values"])
        slots = inp["admit_slots"]
        self.slot_temperature.index_copy_(0, slots, inp["admit_temperature"])
        self.slot_top_p.index_copy_(0, slots, inp["admit_top_p"])
        self.slot_top_k.index_copy_(0, slots, inp["admit_top_k"])
        self.slot_seed.index_copy_(0, slots, inp["admit_seed"])

    def _copy_results(
        self, results: dict[str, torch.Tensor], values: dict[str, torch.Tensor]
    ) -> Any:
        stream = self.copy_stream
        if stream is None:
            for name, value in values.items():
                self._copy_into(results[name], value)
            return None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for name, value in values.items():
                # NOTE: the source was produced on the compute stream; keep it alive until the
                # side stream has read it.
                value.record_stream(stream)
                self._copy_into(results[name], value)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    @staticmethod
    def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
        if src.dim() == 2:
            dst[: src.shape[0], : src.shape[1]].copy_(src, non_blocking=True)
        else:
            dst[: src.shape[0]].copy_(src, non_blocking=True)
