"""Tensor-parallel ranks of one engine: rank 0 plans, every rank runs the plan.

```
rank 0 (the leader: scheduler + loop)           rank r > 0 (a follower: runner only)
plan = scheduler.schedule()
runner.launch(plan):  channel.send(plan) ────►  plan = channel.receive()
                      run plan                  runner.launch(plan)   (the same collectives,
runner.collect(step n - 1 or n)                 runner.collect(...)    in the same order)
...
engine.stop_ranks():  channel.stop()     ────►  follow() returns (follower.py)
```
Every rank builds the same engine over its shard (build.py): the same KV pool (its page
count agreed with ``agree_min``), the same graphs captured in the same order, the same
per-slot state. Sampling is counter-based and every rank gets the full logits, so every rank
computes the same tokens and relay writes; only rank 0 reads results (followers collect
theirs only to keep the double-buffered host copies in step).

Plans travel as msgspec bytes over a gloo group of their own (CPU tensors even where the
model's collectives run on NCCL): a header ``[op, length]`` then the bytes. A follower waits
in that broadcast for as long as rank 0 idles: the group's timeout is ``IDLE_TIMEOUT``.

NOTE: a plan that raises on rank 0 after it was sent leaves the followers inside collectives
rank 0 never joins: under tensor parallelism a failed step ends the process (the loop's
``StepFailed``), it is never skipped.
"""

from __future__ import annotations

from datetime import timedelta

import msgspec
import torch

from outrider.daemon.engine.plan import StepPlan
from outrider.plugins.models.parallel import TPGroup

_LAUNCH, _STOP = 1, 2
_SOURCE = 0
IDLE_TIMEOUT = timedelta(days=30)


class RankChannel:
    """Rank 0's plans to the other ranks, and the small agreements the build needs."""

    def __init__(self, tp: TPGroup) -> None:
        """Collective: every rank of ``tp`` constructs its channel at the same point."""
        import torch.distributed as dist

        assert tp.size > 1, "a world of one has no channel"
        self.tp = tp
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(StepPlan)
        self._header = torch.zeros(2, dtype=torch.int64)  # [op, length]

    @property
    def leader(self) -> bool:
        return self.tp.rank == _SOURCE

    def send(self, plan: StepPlan) -> None:
        """Rank 0: ``plan`` to every other rank."""
        payload = self._encoder.encode(plan)
        self._broadcast_header(_LAUNCH, len(payload))
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        torch.distributed.broadcast(data, _SOURCE, group=self.group)

    def stop(self) -> None:
        """Rank 0: the followers' ``follow`` returns."""
        self._broadcast_header(_STOP, 0)

    def receive(self) -> StepPlan | None:
        """Another rank: rank 0's next plan; None once it stopped."""
        torch.distributed.broadcast(self._header, _SOURCE, group=self.group)
        op, length = self._header.tolist()
        if op == _STOP:
            return None
        assert op == _LAUNCH, f"unknown rank message {op}"
        data = torch.empty(length, dtype=torch.uint8)
        torch.distributed.broadcast(data, _SOURCE, group=self.group)
        return self._decoder.decode(data.numpy().tobytes())

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (collective): sizes derived from each rank's
        free memory, which every rank must share."""
        reduced = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(reduced, torch.distributed.ReduceOp.MIN, group=self.group)
        return int(reduced.item())

    def _broadcast_header(self, op: int, length: int) -> None:
        assert self.leader, "only rank 0 sends"
        self._header[0], self._header[1] = op, length
        torch.distributed.broadcast(self._header, _SOURCE, group=self.group)
