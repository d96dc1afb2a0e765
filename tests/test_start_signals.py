"""SIGTERM and SIGINT while the daemon starts (server.StartSignals): the handler cuts the start
short where Python lets it raise, and where Python cannot (inside a weakref callback, as when
the signal lands in importlib's module-lock cleanup during an import) the signal is
remembered, nothing is printed, and the loop stops once it takes the signals over."""

from __future__ import annotations

import signal
import sys
import weakref
from collections.abc import Iterator

import pytest

from outrider.daemon.processes.start_signals import StartSignals, StopWhileStarting


@pytest.fixture
def reported() -> Iterator[list[type[BaseException]]]:
    """What reaches the unraisable hook in place before the start's (Python's own prints)."""
    seen: list[type[BaseException]] = []
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: seen.append(unraisable.exc_type)
    try:
        yield seen
    finally:
        sys.unraisablehook = hook


@pytest.fixture
def start_signals(reported: list[type[BaseException]]) -> Iterator[StartSignals]:
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    hook = sys.unraisablehook
    signals = StartSignals()
    signals.install()
    try:
        yield signals
    finally:
        signals.ignore()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        assert sys.unraisablehook is hook


def test_a_signal_while_starting_raises_where_it_lands(start_signals: StartSignals) -> None:
    with pytest.raises(StopWhileStarting, match="SIGTERM"):
        signal.raise_signal(signal.SIGTERM)
    assert start_signals.received == "SIGTERM"


def test_a_signal_python_cannot_raise_is_remembered_and_not_printed(
    start_signals: StartSignals, reported: list[type[BaseException]]
) -> None:
    class Module:
        pass

    module = Module()
    # A weakref callback cannot propagate the handler's exception: Python reports it as
    # unraisable and carries on.
    ref = weakref.ref(module, lambda _: signal.raise_signal(signal.SIGINT))
    del module
    assert ref() is None
    assert start_signals.received == "SIGINT"
    assert reported == []


def test_other_unraisable_errors_are_still_reported(
    start_signals: StartSignals, reported: list[type[BaseException]]
) -> None:
    class Module:
        pass

    def broken(_: object) -> None:
        raise ValueError("a real problem")

    module = Module()
    ref = weakref.ref(module, broken)
    del module
    assert ref() is None
    assert start_signals.received is None
    assert reported == [ValueError]
