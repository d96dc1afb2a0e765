"""Result copies: a step's committed tokens and logprobs, device -> pinned host.

Only these copies run on a side stream, gated by an event; everything else of a step runs on
the compute stream. Host buffers are double-buffered like the input staging: step n's results
are read before step n + 2 is launched.

Hazard: a copy to the host overlaps the device's work only when its destination is pinned and
contiguous; into a strided view torch copies through a pageable temporary and waits for the
stream, that is for the whole step just queued (the overlap lost). So each result lands at
the start of a flat pinned buffer, viewed in the shape of what the step sampled (one column a
row for a plain step of a speculative engine, whose buffers hold ``max_commit`` columns).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from outrider.daemon.engine.plan import StepOutput, StepPlan
from outrider.plugins.sampling import SampleResult

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class StepResults:
    """Per sampled row: up to ``max_commit`` committed tokens with their logprobs."""

    tokens: torch.Tensor  # [n, m] int64
    commit_lens: torch.Tensor | None  # [n] int64; None for EXTEND (every row commits one)
    logprob: torch.Tensor  # [n, m] float32
    top_ids: torch.Tensor  # [n, m, k] int64
    top_logprobs: torch.Tensor  # [n, m, k] float32
    # A ranked tree's worst rank on the accepted path up to each draft (verify.py's
    # ``Verified.path_ranks``): [n, m - 1] int64; None for any other step.
    path_ranks: torch.Tensor | None = None

    @classmethod
    def one_a_row(cls, out: SampleResult, commit_lens: torch.Tensor | None) -> StepResults:
        """``out``'s draws, one committed token a row (m = 1)."""
        return cls(
            tokens=out.tokens.unsqueeze(1),
            commit_lens=commit_lens,
            logprob=out.logprob.unsqueeze(1),
            top_ids=out.top_ids.unsqueeze(1),
            top_logprobs=out.top_logprobs.unsqueeze(1),
        )


@dataclass(frozen=True)
class Launched:
    """A step queued on the device: its plan, where its results land and when."""

    plan: StepPlan
    results: StepResults  # pinned host buffers
    done: torch.cuda.Event | None  # None: the copies already ran (CPU)


class ResultCopies:
    def __init__(self, max_rows: int, max_commit: int, device: torch.device) -> None:
        cuda = device.type == "cuda"

        def host(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=cuda)

        rows, m, k = max_rows, max_commit, MAX_LOGPROBS
        # Flat buffers: every copy lands contiguous at a buffer's start (module docstring).
        self._host = [
            StepResults(
                tokens=host(rows * m),
                commit_lens=host(rows),
                logprob=host(rows * m, dtype=torch.float32),
                top_ids=host(rows * m * k),
                top_logprobs=host(rows * m * k, dtype=torch.float32),
                path_ranks=host(rows * m),
            )
            for _ in range(2)
        ]
        self._parity = 0
        self._device = device
        self._stream = torch.cuda.Stream(device) if cuda else None

    def copy(self, plan: StepPlan, values: StepResults | None) -> Launched:
        """Queue the copy of ``values`` (None: nothing sampled) to the next host set."""
        flat, self._parity = self._host[self._parity], self._parity ^ 1
        if values is None:
            return Launched(plan, flat, None)
        host = _landings(flat, values)
        pairs = self._pairs(host, values, top=plan.max_logprobs > 0)
        stream = self._stream
        if stream is None:
            self._copy_all(pairs)
            return Launched(plan, host, None)
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            for src, _ in pairs:
                # NOTE: the source was produced on the compute stream; keep it alive until the
                # side stream has read it.
                src.record_stream(stream)
            self._copy_all(pairs)
            done = torch.cuda.Event()
            done.record(stream)
        return Launched(plan, host, done)

    @staticmethod
    def collect(launched: Launched) -> StepOutput:
        """Wait for ``launched``'s results and return them on the host."""
        if launched.done is not None:
            launched.done.synchronize()
        plan, host = launched.plan, launched.results
        n, k = len(plan.sample_rows), plan.max_logprobs
        if n == 0:  # nothing sampled: ``host`` holds the flat buffers, unread
            return StepOutput(tokens=[], logprobs=[], top_ids=[], top_logprobs=[])
        lens = host.commit_lens
        counts = [1] * n if plan.kind == "extend" or lens is None else lens[:n].tolist()
        top_ids: list[list[list[int]]] = []
        top_logprobs: list[list[list[float]]] = []
        if k:
            top_ids = _cut(host.top_ids[:n, :, :k].tolist(), counts)
            top_logprobs = _cut(host.top_logprobs[:n, :, :k].tolist(), counts)
        path_ranks: list[list[int]] = []
        if host.path_ranks is not None:
            path_ranks = _cut(host.path_ranks[:n].tolist(), [c - 1 for c in counts])
        return StepOutput(
            tokens=_cut(host.tokens[:n].tolist(), counts),
            logprobs=_cut(host.logprob[:n].tolist(), counts),
            top_ids=top_ids,
            top_logprobs=top_logprobs,
            path_ranks=path_ranks,
        )

    @staticmethod
    def _pairs(
        host: StepResults, values: StepResults, *, top: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(source, host buffer) of every result the step's rows are read for: the top
        logprobs only when the plan asks for some (``top``)."""
        pairs = [(values.tokens, host.tokens), (values.logprob, host.logprob)]
        if values.commit_lens is not None and host.commit_lens is not None:
            pairs.append((values.commit_lens, host.commit_lens))
        if values.path_ranks is not None and host.path_ranks is not None:
            pairs.append((values.path_ranks, host.path_ranks))
        if top:
            pairs += [(values.top_ids, host.top_ids), (values.top_logprobs, host.top_logprobs)]
        return pairs

    @staticmethod
    def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for src, dst in pairs:
            dst.copy_(src, non_blocking=True)


def _landings(flat: StepResults, values: StepResults) -> StepResults:
    """Where ``values`` land in the host set ``flat``: each buffer's start, viewed
    contiguous in the shape of its value (module docstring)."""

    def land(buffer: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return buffer[: value.numel()].view(value.shape)

    lens, ranks = values.commit_lens, values.path_ranks
    if lens is not None:
        assert flat.commit_lens is not None, "every host set holds commit lengths"
        lens = land(flat.commit_lens, lens)
    if ranks is not None:
        assert flat.path_ranks is not None, "every host set holds path ranks"
        ranks = land(flat.path_ranks, ranks)
    return StepResults(
        tokens=land(flat.tokens, values.tokens),
        commit_lens=lens,
        logprob=land(flat.logprob, values.logprob),
        top_ids=land(flat.top_ids, values.top_ids),
        top_logprobs=land(flat.top_logprobs, values.top_logprobs),
        path_ranks=ranks,
    )


def _cut(rows: list[list[Any]], counts: list[int]) -> list[list[Any]]:
    """Row ``i``'s first ``counts[i]`` entries, for each row."""
    return [row[:c] for row, c in zip(rows, counts, strict=True)]
