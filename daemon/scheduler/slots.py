"""Request slots: a running request's row in the device's per-slot buffers (page table, relay,
sampling parameters)."""

from __future__ import annotations

from outrider.daemon.scheduler.request import Request


class SlotTable:
    """Free slots, the owner of each taken slot, and the slots released since the last plan
    (a plan carries them: debug mode poisons their relay rows)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: the lowest slot goes first
        self._owners: dict[int, Request] = {}
        self._released: list[int] = []

    @property
    def has_free(self) -> bool:
        return bool(self._free)

    def take(self, req: Request) -> None:
        req.slot = self._free.pop()
        self._owners[req.slot] = req

    def give_back(self, req: Request) -> None:
        del self._owners[req.slot]
        self._free.append(req.slot)
        self._released.append(req.slot)
        req.slot = -1

    def take_released(self) -> list[int]:
        """Slots released since the previous call (one call per plan)."""
        released, self._released = self._released, []
        return released

    def check(self, running: list[Request]) -> None:
        """Every running request owns its slot alone; every other slot is free, once."""
        used = {r.slot for r in running}
        assert len(used) == len(running), "two requests share a slot"
        assert all(self._owners.get(r.slot) is r for r in running), "a slot's owner is stale"
        assert len(self._owners) == len(running), "a slot is owned by no running request"
        assert not used & set(self._free), "a running request's slot is free"
        assert len(set(self._free)) == len(self._free), "a slot is free twice"
        assert len(used) + len(self._free) == self.num_slots, "a slot leaked"
