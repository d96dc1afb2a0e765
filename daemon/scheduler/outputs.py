"""Step results: tokens appended, speculative counters, streaming, finish with usage, release.

Lifetime rules under overlap (a step of a request may be in flight when the host learns
something about it):

| event                        | when the host acts            | the in-flight step's row      |
|------------------------------|-------------------------------|-------------------------------|
| finished (EOS, stop, length) | processing the step that ends | ignored in the next step      |
| aborted / client vanished    | when the abort arrives        | ignored when processed        |
| retracted (KV ran out)       | planning the next step        | its tokens are still appended |

Pages and slots go back at once in every case (admission.py says why that is safe).
"""

from __future__ import annotations

import logging
import time

from outrider.daemon.engine.plan import StepOutput
from outrider.daemon.grammar.state import COSTLY_STEPS, GrammarState
from outrider.daemon.internal import ErrorInfo, FinishInfo, RequestUpdate
from outrider.daemon.scheduler.admission import Admission
from outrider.daemon.scheduler.counters import SchedulerStats
from outrider.daemon.scheduler.drafting import DraftPolicy
from outrider.daemon.scheduler.finish import Finish, FinishChecker
from outrider.daemon.scheduler.planner import Planned
from outrider.daemon.scheduler.request import Request
from outrider.plugins.api import StepShape
from outrider.protocol.messages import TokenLogprob, Usage

log = logging.getLogger("outrider.scheduler")


class OutputProcessor:
    def __init__(
        self,
        shape: StepShape,
        finish: FinishChecker,
        admission: Admission,
        stats: SchedulerStats,
        policy: DraftPolicy,
    ) -> None:
        self.shape = shape
        self.finish = finish
        self.admission = admission
        self.stats = stats
        self.policy = policy
        self._updates: list[RequestUpdate] = []

    def take_updates(self) -> list[RequestUpdate]:
        updates, self._updates = self._updates, []
        return updates

    def process(self, planned: Planned, out: StepOutput) -> None:
        """Apply one step's committed tokens to its sampled rows (rows of requests that
        already finished are ignored)."""
        rows = [planned.requests[row] for row in planned.plan.sample_rows]
        # The rows the drafting policy observes: an unfed row's drafts had no context, so its
        # commits say nothing of its kind's acceptance.
        drafting = planned.plan.drafting
        observed = sum(not req.finished and req.fed is not False for req in rows) if drafting else 0
        for i, req in enumerate(rows):
            if not req.finished:
                self._apply(req, out, i, planned, observed)

    def _apply(
        self, req: Request, out: StepOutput, i: int, planned: Planned, observed: int
    ) -> None:
        tokens, decode = out.tokens[i], planned.plan.kind == "decode"
        if decode and req.slot >= 0:
            # Take back the part of the bound that was not committed.
            unused = planned.max_commit - len(tokens)
            req.scheduled_len -= unused
            req.scheduled_outputs -= unused
        if planned.plan.drafting:
            drafts = planned.plan.q_lens[0] - 1
            self.stats.verified(drafts, len(tokens) - 1)
            if req.fed is not False:
                offered = drafts if req.max_drafts is None else min(drafts, req.max_drafts)
                ranks = out.path_ranks[i] if out.path_ranks else []
                self.policy.observe(req, len(tokens), offered, ranks, observed)
            req.spec_drafts += 1
            req.spec_accepted_tokens += len(tokens) - 1
        if not req.output_ids:
            req.first_token_time = time.time()
        kept, finish = self.finish.append(req, tokens)
        if req.grammar is not None and not req.grammar.advance(tokens[:kept]):
            self.fail(req, f"the grammar refused a committed token of {tokens[:kept]}")
            return
        if req.grammar is not None and (cost := req.grammar.too_costly()) is not None:
            self._end(req, RequestUpdate(req.rid, [], error=_too_costly(cost, req.grammar)))
            return
        if req.want_logprobs:
            # NOTE: the batch computes the largest top-n any row asked for; trim to ours. No
            # row asked for any: the step output has no top entries at all.
            n = req.sampling.logprobs
            req.logprobs.extend(
                TokenLogprob(
                    tokens[j],
                    out.logprobs[i][j],
                    list(zip(out.top_ids[i][j][:n], out.top_logprobs[i][j][:n], strict=True))
                    if n
                    else [],
                )
                for j in range(kept)
            )
        if finish is not None:
            self.finish_request(req, finish)
        elif req.stream:
            self._stream(req)

    def _stream(self, req: Request) -> None:
        upto = self.finish.streamable(req)
        if upto > req.streamed:
            self._updates.append(
                RequestUpdate(
                    req.rid,
                    req.output_ids[req.streamed : upto],
                    logprobs=req.logprobs[req.streamed : upto] if req.want_logprobs else None,
                )
            )
            req.streamed = upto

    def finish_request(self, req: Request, finish: Finish) -> None:
        """The final update of ``req`` (its unstreamed tokens, the finish and usage); its
        pages are published to the prefix cache."""
        usage = Usage(
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_len,
            spec_drafts=req.spec_drafts,
            spec_accepted_tokens=req.spec_accepted_tokens,
        )
        info = FinishInfo(
            finish.reason, finish.matched_stop, usage, finish.text_cut, req.first_token_time
        )
        update = RequestUpdate(
            req.rid,
            req.output_ids[req.streamed :],
            logprobs=req.logprobs[req.streamed :] if req.want_logprobs else None,
            finish=info,
        )
        self.stats.finished(finish.reason)
        self._log_finished(req, finish)
        self._end(req, update)

    def fail(self, req: Request, message: str) -> None:
        """End ``req`` with the ``internal`` error."""
        self._end(req, RequestUpdate(req.rid, [], error=ErrorInfo("internal", message)))

    def _end(self, req: Request, update: RequestUpdate) -> None:
        req.finished = True
        self._updates.append(update)
        self.finish.forget(req)
        self.admission.remove(req)

    def _log_finished(self, req: Request, finish: Finish) -> None:
        # DEBUG: a line per request would fill a busy service's journal (--log-level debug).
        now = time.time()
        ttft = req.first_token_time - req.arrival if req.first_token_time else -1.0
        log.debug(
            "finished id=%s rid=%d prompt=%d output=%d cached=%d queue=%.4f ttft=%.4f "
            "e2e=%.4f reason=%s",
            req.request_id,
            req.rid,
            len(req.prompt_ids),
            len(req.output_ids),
            req.cached_len,
            (req.admit_time - req.arrival) if req.admit_time else -1.0,
            ttft,
            now - req.arrival,
            finish.reason,
        )


def _too_costly(cost_ms: float, grammar: GrammarState) -> ErrorInfo:
    """The error that ends a request whose grammar's masks cost too much
    (``GrammarState.too_costly``)."""
    return ErrorInfo(
        "invalid_request",
        f"the grammar's masks took {cost_ms:.1f} ms each, on the mean of each of "
        f"{COSTLY_STEPS} steps in a row, over --grammar-mask-limit-ms "
        f"{grammar.mask_limit_ms:g}: every step of the batch waits for them (a long bounded "
        "pattern is the usual cause); simplify the grammar, or raise the limit",
    )
