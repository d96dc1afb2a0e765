"""A follower rank's loop: rank r > 0 runs rank 0's plans, received over its ``RankChannel``
(ranks.py), in rank 0's order."""

from __future__ import annotations

from dataclasses import dataclass

from outrider.daemon.engine.ranks import RankChannel
from outrider.daemon.engine.results import Launched
from outrider.daemon.engine.runner import ModelRunner


def follow(runner: ModelRunner, channel: RankChannel, *, overlap: bool) -> int:
    """A follower's loop: run rank 0's plans in its order until it stops, collecting each
    step where rank 0's loop does (one step later with ``overlap``). Returns the steps run."""
    assert not channel.leader, "rank 0 runs the scheduler's loop"
    in_flight: Launched | None = None
    steps = 0
    while (plan := channel.receive()) is not None:
        launched = runner.launch(plan)
        steps += 1
        if overlap:
            previous, in_flight = in_flight, launched
            if previous is not None:
                runner.collect(previous)
        else:
            runner.collect(launched)
    if in_flight is not None:
        runner.collect(in_flight)
    return steps


@dataclass
class Follower:
    """Rank r > 0 of an engine's tensor-parallel ranks, built (build.py's ``build_follower``)
    and ready to run rank 0's plans."""

    runner: ModelRunner
    channel: RankChannel
    overlap: bool

    def run(self) -> int:
        """Run rank 0's plans until it stops the ranks; returns the steps run."""
        return follow(self.runner, self.channel, overlap=self.overlap)
