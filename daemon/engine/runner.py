"""The in-process executor: runs a ``StepPlan`` on the device without a host sync.

Buffers (DESIGN.md 4.3):
- fixed-address device buffers for every per-step input (what CUDA graphs need), filled in
  place from host staging buffers (pinned on CUDA). Staging is double-buffered: the set used by
  step n is refilled by step n + 2, which is launched only after step n's result event was
  waited (the loop processes n before it plans n + 2).
- the per-slot relay: the slot's next input token (the last committed one, whose KV is not
  written yet), its KV length on the device and its output count. A STEP reads all three, so
  its positions and randomness counters never come from the host, which plans a step before
  it knows how many tokens the previous one committed (speculative decoding).
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

from outrider.daemon.engine.accept import (
    accept_chain,
    accept_sampled,
    accept_tree,
    check_tree,
    tree_geometry,
)
from outrider.daemon.engine.forward import ForwardBatch, KVCache, flat_kv_index
from outrider.daemon.engine.plan import StepOutput, StepPlan
from outrider.daemon.engine.sampling import (
    SampleResult,
    SamplingBatch,
    processed_probs,
    sample,
    token_logprobs,
)
from outrider.plugins.api import Phase
from outrider.plugins.attention.base import AttentionBackend
from outrider.plugins.speculative.base import (
    Accepted,
    Drafts,
    ExtendView,
    SpeculativeWorker,
    StepView,
)

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
    "sample_rows": (torch.int64, "row"),
    "next_tokens": (torch.int64, "row"),
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
        # Set by attach_worker: STEP rows then verify ``width`` tokens, write KV over
        # ``kv_span`` positions and commit up to ``max_commit``; without a worker all are 1.
        self.worker: SpeculativeWorker | None = None
        self.width = 1
        self.kv_span = 1
        self.max_commit = 1
        self.sync_check = False
        # Debug: released slots' relay rows are poisoned (-1) and every STEP asserts (with a
        # host sync) that it reads only rows rewritten since, and that a worker's trees are
        # well formed.
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

        def host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=cuda)

        # Page 0 is scratch: empty table entries point there.
        self.page_table = torch.zeros(
            (n_slots, limits.max_pages), dtype=torch.int32, device=device
        )  # [max_slots, max_pages]
        self.relay_tokens = dev(n_slots)  # [max_slots]: the next input token
        self.relay_seq_len = dev(n_slots)  # [max_slots]: KV length (the next input's position)
        self.relay_out_len = dev(n_slots)  # [max_slots]: output tokens committed
        self.slot_temperature = dev(n_slots, torch.float32)
        self.slot_top_p = dev(n_slots, torch.float32)
        self.slot_top_k = dev(n_slots)
        self.slot_seed = dev(n_slots)
        self.inputs = {name: dev(capacity[cls], dtype) for name, (dtype, cls) in _INPUTS.items()}
        self.staging = [
            {name: host((capacity[cls],), dtype) for name, (dtype, cls) in _INPUTS.items()}
            for _ in range(2)
        ]
        self._host = host
        self._allocate_results()
        self._parity = 0
        self.copy_stream = torch.cuda.Stream(device) if cuda else None

    def attach_worker(self, worker: SpeculativeWorker) -> None:
        """Speculative STEPs from now on (before the first step)."""
        self.worker = worker
        self.width, self.max_commit = worker.width, worker.max_commit
        self.kv_span = worker.kv_span
        self._allocate_results()

    def _allocate_results(self) -> None:
        rows, m = self.limits.max_slots + 1, self.max_commit
        # Double-buffered like the staging: step n's results are read before step n + 2.
        self.results = [
            {
                "tokens": self._host((rows, m), torch.int64),
                "commit_lens": self._host((rows,), torch.int64),
                "logprob": self._host((rows, m), torch.float32),
                "top_ids": self._host((rows, m, MAX_LOGPROBS), torch.int64),
                "top_logprobs": self._host((rows, m, MAX_LOGPROBS), torch.float32),
            }
            for _ in range(2)
        ]
        self.step_offsets = torch.arange(self.width, device=self.device)  # [W]

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
        results = self.results[parity]
        if plan.kind == "extend":
            event = self._extend(plan, inp, results)
        else:
            event = self._step(plan, inp, results)
        return Launched(plan=plan, event=event, host=results)

    def _extend(
        self, plan: StepPlan, inp: dict[str, torch.Tensor], results: dict[str, torch.Tensor]
    ) -> Any:
        """Prompt chunks: the forward, then one sampled token per finishing row, which seeds
        the row's relay (next input, KV length, output count)."""
        fb = self._forward_batch(plan, inp, "extend")
        hidden = self.model.forward(inp["input_ids"], fb)  # [T, H]
        sample_slots = inp["sample_slots"]
        if not plan.sample_rows:
            self._after_extend(fb, inp)
            return None
        logits = self.model.compute_logits(hidden[inp["sample_index"]])  # [n, V]
        out = self._sample(logits, sample_slots, inp["sample_positions"], plan)
        self.relay_tokens.index_copy_(0, sample_slots, out.tokens)
        self.relay_seq_len.index_copy_(0, sample_slots, inp["positions"][inp["sample_index"]] + 1)
        self.relay_out_len.index_copy_(0, sample_slots, inp["sample_positions"] + 1)
        inp["next_tokens"].index_copy_(0, inp["sample_rows"], out.tokens)
        self._after_extend(fb, inp)
        return self._copy_results(
            results,
            {
                "tokens": out.tokens.unsqueeze(1),
                "logprob": out.logprob.unsqueeze(1),
                "top_ids": out.top_ids.unsqueeze(1),
                "top_logprobs": out.top_logprobs.unsqueeze(1),
            },
        )

    def _after_extend(self, fb: ForwardBatch, inp: dict[str, torch.Tensor]) -> None:
        if self.worker is not None:
            view = ExtendView(
                fb, inp["input_ids"], inp["next_tokens"], inp["sample_rows"], inp["sample_slots"]
            )
            self.worker.after_extend(view)

    def _step(
        self, plan: StepPlan, inp: dict[str, torch.Tensor], results: dict[str, torch.Tensor]
    ) -> Any:
        """Every row verifies ``width`` tokens (root + drafts) at positions taken from the
        relay, and commits ``commit_len`` of them (accept.py)."""
        bs, width = plan.bs, self.width
        slots = inp["slots"]
        seq = self.relay_seq_len[slots]  # [bs]
        out_len = self.relay_out_len[slots]  # [bs]
        roots = self.relay_tokens[slots]  # [bs]
        if self.relay_check and not bool((roots >= 0).all()):
            raise AssertionError("a STEP read a relay row that was not rewritten")
        tokens = inp["input_ids"].view(bs, width)
        tokens[:, 0] = roots
        offsets = self.step_offsets.expand(bs, width)  # [bs, W]
        depth, visible, drafts, view = offsets, None, None, None
        if self.worker is not None:
            view = StepView(
                slots, roots, seq, out_len, self._sampling(slots, plan), self._max_kv(plan)
            )
            drafts = self.worker.draft(view)
            tokens[:, 1:] = drafts.tokens  # [bs, W - 1]
            if drafts.parents is not None:
                if self.relay_check:
                    check_tree(drafts.tokens, drafts.parents)
                depth, visible = tree_geometry(drafts.parents, self.max_commit - 1)
        torch.add(seq.unsqueeze(1), depth, out=inp["positions"].view(bs, width))
        torch.add(seq, width, out=inp["seq_lens"])
        phase: Phase = "verify" if self.worker is not None else "decode"
        fb = self._forward_batch(plan, inp, phase, seq.unsqueeze(1) + offsets, visible)
        hidden = self.model.forward(inp["input_ids"], fb)  # [bs * W, H]
        logits = self.model.compute_logits(hidden)  # [bs * W, V]
        out, choices, commit_lens, path = self._accept(
            plan, inp, logits, drafts, (seq, out_len, depth)
        )
        committed = choices.gather(1, path)  # [bs, max_commit]
        bonus = committed.gather(1, (commit_lens - 1).unsqueeze(1)).squeeze(1)
        self.relay_tokens.index_copy_(0, slots, bonus)
        self.relay_seq_len.index_copy_(0, slots, seq + commit_lens)
        self.relay_out_len.index_copy_(0, slots, out_len + commit_lens)
        if self.worker is not None and view is not None:  # a worker always made a view
            self.worker.after_accept(view, fb, Accepted(committed, commit_lens, path))
        k = out.top_ids.shape[-1]
        node = path.unsqueeze(2).expand(bs, self.max_commit, k)
        return self._copy_results(
            results,
            {
                "tokens": committed,
                "commit_lens": commit_lens,
                "logprob": out.logprob.view(bs, width).gather(1, path),
                "top_ids": out.top_ids.view(bs, width, k).gather(1, node),
                "top_logprobs": out.top_logprobs.view(bs, width, k).gather(1, node),
            },
        )

    def _accept(
        self,
        plan: StepPlan,
        inp: dict[str, torch.Tensor],
        logits: torch.Tensor,
        drafts: Drafts | None,
        rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> tuple[SampleResult, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the target's choice at every node with its logprobs, ``choices`` [bs, W],
        ``commit_lens`` [bs], ``path`` [bs, max_commit]) of a verify: the chain, tree or
        sampled-draft rule (accept.py). ``rows``: each row's ``seq``, ``out_len`` [bs] and its
        nodes' depths [bs, W]. A tree's accepted KV is moved to the front here."""
        bs, width, limit = plan.bs, self.width, self.limits.vocab_limit
        seq, out_len, depth = rows
        slots = inp["slots"]
        batch = self._sampling(inp["token_slots"], plan)  # per token
        path = self.step_offsets[: self.max_commit].expand(bs, -1)  # a chain: 0, 1, ..
        if drafts is not None and drafts.probs is not None:
            target_probs = processed_probs(logits, batch, vocab_limit=limit).view(bs, width, -1)
            seed = self.slot_seed[slots]
            commit_lens, choices = accept_sampled(
                drafts.tokens, drafts.probs, target_probs, seed, out_len
            )
            out = token_logprobs(logits, choices.view(-1), plan.max_logprobs, vocab_limit=limit)
            return out, choices, commit_lens, path
        # The target's own draw at each node: output index out_len + depth.
        draw_positions = (out_len.unsqueeze(1) + depth).view(-1)  # [bs * W]
        out = sample(logits, batch, draw_positions, vocab_limit=limit)
        choices = out.tokens.view(bs, width)  # [bs, W]
        if drafts is not None and drafts.parents is not None:
            commit_lens, path = accept_tree(
                drafts.tokens, drafts.parents, choices, self.max_commit - 1
            )
            self._compact(slots, seq, path)
        else:
            tokens = inp["input_ids"].view(bs, width)
            commit_lens = accept_chain(tokens[:, 1:], choices)  # [bs]; 1 without drafts
        return out, choices, commit_lens, path

    def _compact(self, slots: torch.Tensor, seq: torch.Tensor, path: torch.Tensor) -> None:
        """Move the KV of a tree's accepted path (node ``path[:, j]`` at ``seq + path[:, j]``)
        to ``seq + j``, so that committed positions stay contiguous. Entries past a row's
        commit length move KV that is never read."""
        table, page_size = self.page_table, self.kv.page_size
        rows = slots.unsqueeze(1)
        src = flat_kv_index(table, rows, seq.unsqueeze(1) + path, page_size)
        dst = flat_kv_index(
            table, rows, seq.unsqueeze(1) + self.step_offsets[: path.shape[1]], page_size
        )
        self.kv.move(src.view(-1), dst.view(-1))

    def _forward_batch(
        self,
        plan: StepPlan,
        inp: dict[str, torch.Tensor],
        phase: Phase,
        kv_slots: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """``kv_slots``: where each token's K/V goes (default: its position); a tree's nodes
        share positions but not slots."""
        positions = inp["positions"]
        where = positions if kv_slots is None else kv_slots.reshape(-1)
        out_loc = flat_kv_index(self.page_table, inp["token_slots"], where, self.kv.page_size)
        backend = self.backends[phase]
        fb = ForwardBatch(
            backend=backend,
            kv=self.kv,
            page_table=self.page_table,
            slots=inp["slots"],
            positions=positions,
            out_loc=out_loc,
            q_start=inp["q_start"],
            seq_lens=inp["seq_lens"],
            q_pad_index=inp["q_pad_index"],
            bs=plan.bs,
            max_q=max(plan.q_lens),
            max_kv=self._max_kv(plan),
            tree_mask=tree_mask,
            capture_layers=self.worker.capture_layers if self.worker is not None else (),
        )
        backend.prepare(fb)
        return fb

    def _max_kv(self, plan: StepPlan) -> int:
        """The host's bound on any row's KV length during ``plan``; STEP starts are upper
        bounds on the committed lengths."""
        if plan.kind == "extend":
            return max(s + q for s, q in zip(plan.starts, plan.q_lens, strict=True))
        return max(plan.starts) + self.kv_span

    def _sample(
        self,
        logits: torch.Tensor,
        row_slots: torch.Tensor,
        positions: torch.Tensor,
        plan: StepPlan,
    ) -> SampleResult:
        """Sample each row of ``logits`` with the parameters of slot ``row_slots[r]`` and the
        randomness counter ``positions[r]`` (the output index drawn)."""
        batch = self._sampling(row_slots, plan)
        return sample(logits, batch, positions, vocab_limit=self.limits.vocab_limit)

    def _sampling(self, row_slots: torch.Tensor, plan: StepPlan) -> SamplingBatch:
        """The sampling parameters of slot ``row_slots[r]`` for each row."""
        return SamplingBatch(
            temperature=self.slot_temperature[row_slots],
            top_p=self.slot_top_p[row_slots],
            top_k=self.slot_top_k[row_slots],
            seed=self.slot_seed[row_slots],
            all_greedy=plan.all_greedy,
            max_logprobs=plan.max_logprobs,
        )

    def collect(self, launched: Launched) -> StepOutput:
        """Wait for ``launched``'s results and return them on the host."""
        if launched.event is not None:
            launched.event.synchronize()
        plan = launched.plan
        n, k = len(plan.sample_rows), plan.max_logprobs
        host = launched.host
        counts = [1] * n if plan.kind == "extend" else host["commit_lens"][:n].tolist()
        tokens = host["tokens"][:n].tolist()
        logprobs = host["logprob"][:n].tolist()
        top_ids = host["top_ids"][:n, :, :k].tolist()
        top_logprobs = host["top_logprobs"][:n, :, :k].tolist()
        return StepOutput(
            tokens=[row[:c] for row, c in zip(tokens, counts, strict=True)],
            logprobs=[row[:c] for row, c in zip(logprobs, counts, strict=True)],
            top_ids=[row[:c] for row, c in zip(top_ids, counts, strict=True)],
            top_logprobs=[row[:c] for row, c in zip(top_logprobs, counts, strict=True)],
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
        extend = plan.kind == "extend"
        empty: list[int] = []
        # A STEP's tokens, positions and KV lengths come from the relay (filled on the device).
        values: dict[str, np.ndarray | list[int] | list[float]] = {
            "input_ids": plan.input_ids if extend else empty,
            "positions": starts[row_of_token] + offset if extend else empty,
            "token_slots": slots[row_of_token],
            "q_pad_index": row_of_token * max_q + offset,
            "slots": slots,
            "seq_lens": starts + q_lens if extend else empty,
            "q_start": q_start,
            "sample_index": q_start[sample_rows + 1] - 1 if extend else empty,
            "sample_slots": slots[sample_rows] if extend else empty,
            "sample_rows": sample_rows if extend else empty,
            "next_tokens": plan.next_ids,
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
        lengths.update(input_ids=n_tok, positions=n_tok, seq_lens=plan.bs)
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
        dst[tuple(slice(0, n) for n in src.shape)].copy_(src, non_blocking=True)
