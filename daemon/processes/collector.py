"""Python's cyclic garbage collector in the processes that run steps (the daemon and its
tensor-parallel ranks).

After start-up such a process holds hundreds of thousands of objects that live as long as it
does: imported modules, the model's modules and parameters, the captured graphs and their
inputs. A full collection walks every tracked object, about 125 ms for the 350,000 objects of
a daemon serving a tiny model on a CPU of today, and it runs in the middle of whatever step
the loop is in (a decode step's inter-token latency; under tensor parallelism every rank
waits in its next collective). So once the engine is built and warm, ``freeze_start_up``
collects what start-up left behind and moves everything else to the permanent generation,
which collections skip.

Hazard: a reference cycle among frozen objects that later becomes garbage is never collected.
Only start-up objects are frozen, and they live until the process exits; an engine built in
a test process is never frozen (the process entry points call this, not the engine builders).
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("outrider.daemon")


def freeze_start_up() -> int:
    """Collect start-up's garbage, then freeze every object left; returns how many."""
    started = time.perf_counter()
    gc.collect()
    walked_ms = (time.perf_counter() - started) * 1e3
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info(
        "garbage collector: %d start-up objects frozen (a full collection walked them in "
        "%.0f ms)", frozen, walked_ms,
    )  # fmt: skip
    return frozen
