"""Whether the daemon behind the HTTP front is still loading the model, told without waiting.

The front serves from the start; the daemon's front door binds the client socket only once the
model is loaded. An ``ipc://PATH`` daemon holds ``PATH.lock`` with its pid in it from before it
loads (protocol/endpoints.py), so a live pid there and no socket file is a daemon loading: told
at once, with no call that would wait for a socket nobody binds yet. Where no lock file can
tell (``tcp://``, abstract ``ipc://@name``), nothing listening before the daemon's first answer
is taken for loading (the daemon is the front's parent: it exists). Once the daemon has
answered, nothing listening is a lost daemon, whatever the endpoint.
"""

from __future__ import annotations

from outrider.protocol.endpoints import ipc_path, loading_daemon_pid


class LoadingWatch:
    """What the HTTP front's ``/health`` knows of the daemon at ``endpoint`` before asking."""

    def __init__(self, endpoint: str) -> None:
        self._socket_path = ipc_path(endpoint)
        self._answered = False

    def answered(self) -> None:
        """The daemon answered: it has loaded, and is never taken for loading again."""
        self._answered = True

    def loading(self) -> bool:
        """Loading, as the lock file tells: a live daemon that has not bound its socket."""
        if self._answered or self._socket_path is None:
            return False
        return loading_daemon_pid(self._socket_path) is not None

    def loading_if_not_listening(self) -> bool:
        """Whether finding nothing listening means loading: before the daemon's first answer,
        on an endpoint no lock file tells of (an ``ipc://`` one without a live daemon's lock
        has no daemon)."""
        return not self._answered and self._socket_path is None
