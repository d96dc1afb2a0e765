"""The drafting policy's host time a decode step: ``AdaptiveDrafting.width`` over a batch of
observed greedy rows, and the step's ``observe`` calls, for an engine of 3 drafts cut to 2 and
1 (the break-evens and acceptances are made up: the cost does not depend on them).

    python benchmarks/drafting_policy.py --rows 1 32 256
"""

from __future__ import annotations

import argparse
import json
import time

from outrider.daemon.internal import TokenizedRequest
from outrider.daemon.scheduler.acceptance import BreakEven
from outrider.daemon.scheduler.drafting import AdaptiveDrafting, AdaptiveSettings
from outrider.daemon.scheduler.request import Request
from outrider.plugins.sampling_spec import SamplingSpec

WIDTH = 4  # a root and 3 drafts
REPEATS = 200


def _row(rid: int) -> Request:
    message = TokenizedRequest(
        rid=rid, request_id=str(rid), input_ids=[1], sampling=SamplingSpec(0.0),
        max_new_tokens=None, stop=[], stop_token_ids=[], ignore_eos=True, stream=False,
        want_logprobs=False, arrival=0.0,
    )  # fmt: skip
    return Request.from_message(message)


def _policy() -> AdaptiveDrafting:
    taus = (1.5, 2.6)
    break_even = BreakEven(
        (1, 256), taus, taus, cut_drafts=(2, 1), cut_greedy=((1.35, 2.0), (1.2, 1.5)),
        cut_sampled=((1.35, 2.0), (1.2, 1.5)),
    )  # fmt: skip
    return AdaptiveDrafting(AdaptiveSettings(break_even), WIDTH)


def measure(rows: int) -> dict[str, float]:
    """Microseconds of one ``width`` decision and of one step's ``observe`` calls."""
    policy, batch = _policy(), [_row(i) for i in range(rows)]
    for i, req in enumerate(batch):
        policy.observe(req, 1 + i % WIDTH, WIDTH - 1)
    started = time.perf_counter()
    for _ in range(REPEATS):
        policy.width(batch)
    decide = (time.perf_counter() - started) / REPEATS
    started = time.perf_counter()
    for _ in range(REPEATS):
        for i, req in enumerate(batch):
            policy.observe(req, 1 + i % 2, 1)
    observe = (time.perf_counter() - started) / REPEATS
    return {"rows": rows, "width_us": round(decide * 1e6, 1), "observe_us": round(observe * 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256])
    args = parser.parse_args()
    for rows in args.rows:
        print(json.dumps(measure(rows)))


if __name__ == "__main__":
    main()
