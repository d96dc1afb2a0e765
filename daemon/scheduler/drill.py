"""Debug drills, off in production: the retraction drill (``OUTRIDER_DEBUG_RETRACT_EVERY``)
retracts a running request every N plans, so that tests and soaks run retraction and
re-admission without running out of pages. Its knob is read here only."""

from __future__ import annotations

from dataclasses import dataclass

from outrider.plugins.debug import debug_knob


@dataclass(frozen=True)
class RetractDrill:
    """Retract the youngest running request (never the only one) every ``every`` plans."""

    every: int

    def due(self, plans: int) -> bool:
        """Whether the ``plans``-th plan (counting from 1) retracts first."""
        return plans % self.every == 0


def retract_drill() -> RetractDrill | None:
    """The drill the debug knob asks for; None when it is off."""
    every = debug_knob("OUTRIDER_DEBUG_RETRACT_EVERY")
    return RetractDrill(every) if every else None
