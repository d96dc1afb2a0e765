"""``StepPlan``: what the scheduler hands the executor for one step (msgspec-encodable, so a
tensor-parallel rank's executor can receive the same plan over a pipe), and ``StepOutput``:
what the executor hands back."""

from __future__ import annotations

from typing import Literal

from msgspec import Struct

from outrider.plugins.sampling_spec import SamplingSpec

StepKind = Literal["extend", "decode"]


class SlotParams(Struct, array_like=True, frozen=True, gc=False):
    """A request's sampling parameters, written into its slot's device buffers when it is
    admitted."""

    slot: int
    sampling: SamplingSpec
    max_drafts: int | None = None  # the most drafts a step commits for it; None: no cap


class StepPlan(Struct, array_like=True, frozen=True):
    """One batch. EXTEND rows carry their tokens; decode rows start from the token read from the
    relay buffer. Row ``r`` computes positions ``starts[r] .. starts[r] + q_lens[r] - 1``."""

    kind: StepKind
    slots: list[int]
    starts: list[int]
    q_lens: list[int]
    input_ids: list[int]  # EXTEND: flat, row after row; decode: empty
    # Rows whose last query token is sampled, with the output index of each draw.
    sample_rows: list[int]
    sample_positions: list[int]
    page_writes: list[int]  # flat request-table indices: slot * max_pages + page index
    page_values: list[int]
    slot_params: list[SlotParams]
    max_logprobs: int
    all_greedy: bool
    # A sampled row cuts its vocabulary by top-k or top-p: the step sorts each sampled row to
    # find the cuts (plugins/sampling.py); False: no row does, and nothing is sorted.
    cuts: bool = True
    # Slots released since the previous plan: their deferred catch-ups run before this plan
    # (engine/deferred.py); under the relay check (debug) their relay rows are poisoned.
    released_slots: list[int] = []
    # EXTEND: per row, the token after its chunk when the host knows it (0 where the chunk
    # ends the prompt: that token is sampled on the device).
    next_ids: list[int] = []
    # EXTEND: decoding rows riding the batch (``SchedulerLimits.mixed_batches``): one query
    # token each, the slot's relay root (its ``input_ids`` entry a placeholder), sampled.
    relay_rows: list[int] = []
    # Slots of rows whose requests do not feed the draft (scheduler/drafting.py): their
    # draft's state is never caught up.
    unfed: list[int] = []
    # A sampled row adjusts its logits or cuts by min_p (penalties.py): the step runs
    # eagerly, never from a graph.
    adjusts: bool = False
    # Sampled rows (indices into sample_rows) that draw under a grammar, and their masks:
    # int32 [len(masked_rows), ceil(vocab / 32)], row after row, bit t set where token t may
    # come (daemon/grammar/). Only plain steps carry masks, and only where the host cannot
    # compute them mid-step (tensor-parallel ranks, EXTEND rows); a drafting step's come from
    # the host mid-step (engine/token_masks.py).
    masked_rows: list[int] = []
    masks: bytes = b""
    # Where the sliding layers keep only their windows (scheduler/window_pages.py): page ids
    # whose window page changed, and their new ones (0: the scratch page, none).
    window_writes: list[int] = []
    window_values: list[int] = []
    # Window pages copied before the step, source to destination: a prefix's window, given
    # to the prefix cache's pages from a request that computed it again.
    window_copies_from: list[int] = []
    window_copies_to: list[int] = []

    @property
    def bs(self) -> int:
        return len(self.slots)

    @property
    def drafting(self) -> bool:
        """A decode batch whose rows verify drafts (width > 1); False: a plain decode step,
        one token a row, on any engine (a speculative engine's drafting policy chooses)."""
        return self.kind == "decode" and self.q_lens[0] > 1

    @property
    def target_only(self) -> bool:
        """No row feeds the draft, and the batch does not draft: it is the target's alone (no
        captured layers, no catch-up, nothing buffered)."""
        return len(self.unfed) == self.bs and not self.drafting

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


class StepOutput(Struct, frozen=True):
    """Host results of one step, one entry per sampled row (``plan.sample_rows`` order): the
    tokens the row committed (one for EXTEND; accepted drafts plus the bonus for a
    speculative decode batch), each with its logprob and top logprobs (``top_ids`` and
    ``top_logprobs`` are empty when the plan asks for none: ``max_logprobs`` 0)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    top_ids: list[list[list[int]]]
    top_logprobs: list[list[list[float]]]
    # A ranked tree's step: per row, the worst rank by score on its accepted path up to each
    # accepted draft (verify.py's ``Verified.path_ranks``); empty for any other step.
    path_ranks: list[list[int]] = []
