"""SIGTERM and SIGINT while the daemon starts, before its event loop takes them over
(``start.py`` installs ``StartSignals``; ``server.Daemon`` reads what arrived)."""

from __future__ import annotations

import signal
import sys


class StopWhileStarting(BaseException):
    """SIGTERM or SIGINT arrived before the event loop took the signals over. A
    ``BaseException``, as ``KeyboardInterrupt`` is: raised wherever the start happens to be
    (inside the warm-up's step too), it must pass the handlers of ordinary failures (the
    loop's, which would end the step's requests and go on) up to ``start.py``."""


class StartSignals:
    """SIGTERM and SIGINT before the event loop takes them over: the handler raises
    ``StopWhileStarting`` to cut the start short. Where Python cannot propagate an exception
    (the handler ran inside a weakref callback or a finaliser, e.g. importlib's module-lock
    cleanup while the model's code is imported) it reports it as unraisable instead and the
    start goes on: the signal is remembered (``received``), that report silenced, and the
    event loop stops as soon as it has taken the signals over (``Daemon.run``)."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._hook = sys.unraisablehook

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._raise)
        sys.unraisablehook = self._unraisable

    def ignore(self) -> None:
        """Stopping takes a moment (children flush): a second signal must not cut it short."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        sys.unraisablehook = self._hook

    def _raise(self, signum: int, _frame: object) -> None:
        self.received = signal.Signals(signum).name
        raise StopWhileStarting(self.received)

    def _unraisable(self, unraisable: sys.UnraisableHookArgs) -> None:
        if unraisable.exc_type is not StopWhileStarting:
            self._hook(unraisable)
