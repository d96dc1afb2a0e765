"""The step log (``--step-log FILE``): a JSON line per turn of the loop, for finding where
latency goes (which steps ran, how long, how many requests waited).

A line's fields: ``t``, seconds from the log's opening to the turn's start; ``at``, that
start as Unix time (so that another process places the turn on its own clock); ``turn_ms``, the
whole turn; ``plan_ms``, the scheduling of its step; ``wait_ms``, the time spent waiting for
step results (the device's share of the turn; under overlap the step before's); and, where the
turn launched a step, ``kind`` (``extend`` or ``decode``), ``rows``, ``tokens``, ``width`` (a
decode step's tokens a row: 1 for a plain step), ``riders`` (decoding rows riding a prompt
batch), ``unfed`` (rows that do not feed the draft), ``sampling`` (``greedy``; ``sampled``;
``cut``: a sampled row cuts by top-k or top-p, so the step sorts) and ``waiting`` (requests
queued for admission at the turn's end); where the step took grammar masks from the host,
``mask_fill_ms`` (the host filling them and queueing their copies), ``mask_wait_ms`` (its
waits for the device inside the step) and ``mask_waits`` (how many; on the CPU, those a GPU
would make: engine/token_masks.py's ``HostTimes``). A turn that launched nothing has only the
timings. Where the log counts them (CUDA), a turn in which the caching allocator called the
driver has ``allocator_calls``, how many times (memory mapped or unmapped, a failed allocation
retried): such a call can wait for the whole device, so the turn's launch may hold a wait for
the step before that ``wait_ms`` does not show.

Invariant: the log only observes; nothing the loop decides reads it. Lines are written in turn
order and flushed at least once a second, and when the log closes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TextIO

from outrider.daemon.engine.plan import StepPlan
from outrider.daemon.engine.token_masks import HostTimes
from outrider.daemon.scheduler.planner import Planned

FLUSH_EVERY_S = 1.0


class StepLog:
    def __init__(self, out: TextIO, allocator_calls: Callable[[], int] | None = None) -> None:
        """``allocator_calls``: the allocator's calls to the driver so far (None: not
        counted)."""
        self.out = out
        self.opened = time.perf_counter()
        self.opened_unix = time.time()
        self.flushed = self.opened
        self.allocator_calls = allocator_calls
        self._calls = allocator_calls() if allocator_calls is not None else 0

    @classmethod
    def open(cls, path: str, allocator_calls: Callable[[], int] | None = None) -> StepLog:
        """Append to ``path`` (created if missing)."""
        return cls(open(path, "a", encoding="utf-8"), allocator_calls)  # closed by close()

    def turn(
        self,
        started: float,
        scheduled: float,
        ended: float,
        waited: float,
        planned: Planned | None,
        waiting: int,
        masks: HostTimes | None = None,
    ) -> None:
        """One turn: ``perf_counter`` times of its start, of its plan's return and of its end,
        the seconds it waited for results, the step it launched (None: none), the queue's
        length at its end and the host's mask work inside the launch."""
        line: dict[str, object] = {
            "t": round(started - self.opened, 6),
            "at": round(self.opened_unix + started - self.opened, 6),
            "turn_ms": round((ended - started) * 1e3, 3),
            "plan_ms": round((scheduled - started) * 1e3, 3),
            "wait_ms": round(waited * 1e3, 3),
        }
        if planned is not None:
            plan = planned.plan
            decode = plan.kind == "decode"
            line |= {
                "kind": plan.kind,
                "rows": plan.bs,
                "tokens": plan.num_tokens,
                "width": plan.q_lens[0] if decode else 0,
                "riders": len(plan.relay_rows),
                "unfed": len(plan.unfed),
                "sampling": _sampling(plan),
                "waiting": waiting,
            }
            if masks is not None and (masks.waits or masks.fill_s):
                line |= {
                    "mask_fill_ms": round(masks.fill_s * 1e3, 3),
                    "mask_wait_ms": round(masks.wait_s * 1e3, 3),
                    "mask_waits": masks.waits,
                }
        if self.allocator_calls is not None:
            calls = self.allocator_calls()
            if calls != self._calls:
                line["allocator_calls"] = calls - self._calls
                self._calls = calls
        self.out.write(json.dumps(line) + "\n")
        if ended - self.flushed >= FLUSH_EVERY_S:
            self.out.flush()
            self.flushed = ended

    def close(self) -> None:
        self.out.close()


def _sampling(plan: StepPlan) -> str:
    """The step's sampling kind (module docstring)."""
    if plan.all_greedy:
        return "greedy"
    return "cut" if plan.cuts else "sampled"
