"""``MaskFills``: a step's grammar mask fills, spread over threads. xgrammar fills a mask
without holding the GIL, and a mask inside a string costs the most (against a 128k
vocabulary 100-300 us, against 1-15 us at a structural place): a tree's verify nodes at 32
rows are hundreds of such fills a step, on the host's path while the verify's forward runs.
The walks to the fills' states (forks, accepted tokens) stay on the caller's thread; each
call returns once every fill of it is done.

A call runs on the caller's thread alone below ``FILLS_A_THREAD`` fills a thread: waking a
worker costs tens of microseconds, more than a structural place's fills."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import xgrammar as xgr

# A job: the matcher whose next mask fills row ``row`` of the call's masks.
Fill = tuple[xgr.GrammarMatcher, int]

FILLS_A_THREAD = 2  # fills a thread takes at least (module docstring)
MAX_FILL_THREADS = 8  # past this a step's fills gained little on a 16-core host


class MaskFills:
    def __init__(self, threads: int = 1) -> None:
        """``threads``: the threads a call may use, the caller's included (1: the caller's
        alone; at most ``MAX_FILL_THREADS``). The workers start on the first call that
        needs them."""
        self.threads = max(1, min(threads, MAX_FILL_THREADS))
        self._pool: ThreadPoolExecutor | None = None

    def run(self, fills: Sequence[Fill], masks: torch.Tensor) -> None:
        """Each ``(matcher, row)`` of ``fills``: row ``row`` of ``masks`` (int32 words
        ``[rows, ceil(V / 32)]``, on the CPU) becomes the matcher's next mask. The matchers
        are distinct (a matcher is not filled twice at once)."""
        parts = min(self.threads, len(fills) // FILLS_A_THREAD)
        if parts <= 1:
            _fill(fills, masks)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="grammar-fill")
        # Interleaved shares: neighbouring rows are often in one string, so costly fills
        # spread over every share.
        helpers = [self._pool.submit(_fill, fills[part::parts], masks) for part in range(1, parts)]
        _fill(fills[::parts], masks)
        for helper in helpers:
            helper.result()


def _fill(fills: Sequence[Fill], masks: torch.Tensor) -> None:
    for matcher, row in fills:
        matcher.fill_next_token_bitmask(masks, row)
