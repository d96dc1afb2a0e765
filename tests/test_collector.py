"""The start-up freeze of the processes that run steps (daemon/processes/collector.py), in a
fresh interpreter: a test process must not freeze its own objects."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import gc, logging, weakref
from outrider.daemon.processes.collector import freeze_start_up

logging.basicConfig(level=logging.INFO, format="%(message)s")


class Node:
    pass


first, second = Node(), Node()
first.other, second.other = second, first  # a cycle: garbage once unnamed
dead = weakref.ref(first)
del first, second
kept = [Node() for _ in range(5000)]
frozen = freeze_start_up()
assert dead() is None, "start-up's garbage is collected, not frozen"
assert frozen == gc.get_freeze_count() > len(kept)
after = len(gc.get_objects())
assert after < 100, after  # a full collection walks what came after start-up only
print(frozen, after)
"""


def test_start_up_objects_are_frozen_after_its_garbage_is_collected() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60
    )
    frozen, after = (int(n) for n in done.stdout.split())
    assert frozen > 5000 and after < 100
    logged = done.stderr.strip().splitlines()
    assert len(logged) == 1 and logged[0].startswith(
        f"garbage collector: {frozen} start-up objects frozen (a full collection walked them in "
    ), logged
