"""The systemd notify protocol in plain Python (no libsystemd, no ``sdnotify`` package).

Only the daemon's main process talks to systemd (``NotifyAccess=main``): build one
``Notifier`` from the environment at start, then call ``strip_notify_env(os.environ)`` before
spawning children so that none of them inherits the socket or the watchdog settings.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, MutableMapping

log = logging.getLogger(__name__)

NOTIFY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    """Sends ``KEY=VALUE`` datagrams to ``$NOTIFY_SOCKET``; a no-op when it is unset.

    No send ever raises: the first failure is logged as a warning, later ones are silent.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._address = _socket_address(env.get("NOTIFY_SOCKET", ""))
        self._watchdog_usec = _watchdog_usec(env)
        self._sock: socket.socket | None = None
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *assignments: str) -> bool:
        """Send ``assignments`` (each ``KEY=VALUE``) as one datagram; True if it was sent."""
        if self._address is None:
            return False
        payload = "\n".join(assignments).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.sendto(payload, self._address)
        except OSError as exc:
            if not self._failed:
                self._failed = True
                log.warning("sd_notify to %r failed (ignored from now on): %s", self._address, exc)
            return False
        return True

    def status(self, text: str) -> bool:
        return self.notify(_status(text))

    def extend_timeout(self, usec: int) -> bool:
        """Ask systemd for ``usec`` more microseconds of start (or stop) time from now."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(usec)}")

    def ready(self, status: str | None = None) -> bool:
        """Send only once requests can be served (the client socket is bound)."""
        return self.notify("READY=1", *([_status(status)] if status is not None else []))

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *([_status(status)] if status is not None else []))

    def watchdog(self) -> bool:
        """Send only from the engine loop while it makes progress, never from a side thread."""
        return self.notify("WATCHDOG=1")

    def watchdog_trigger(self) -> bool:
        """Ask systemd for the watchdog action now (the engine is known to be wedged)."""
        return self.notify("WATCHDOG=trigger")

    def watchdog_interval(self) -> float | None:
        """Seconds between ``WATCHDOG=1`` pings (half the period), or None without a watchdog."""
        if self._watchdog_usec is None:
            return None
        return self._watchdog_usec / 2 / 1e6

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def strip_notify_env(environ: MutableMapping[str, str]) -> None:
    """Remove ``NOTIFY_SOCKET`` and ``WATCHDOG_*`` from ``environ`` (``os.environ`` before
    spawning children, or a copy passed as a child's environment)."""
    for key in NOTIFY_ENV:
        environ.pop(key, None)


def _socket_address(raw: str) -> str | None:
    if not raw:
        return None
    if raw.startswith("@"):
        return "\0" + raw[1:]
    if raw.startswith("/"):
        return raw
    log.warning("NOTIFY_SOCKET=%r is not an AF_UNIX address; systemd notifications are off", raw)
    return None


def _watchdog_usec(env: Mapping[str, str]) -> int | None:
    pid = env.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec if usec > 0 else None


def _status(text: str) -> str:
    # NOTE: a newline would end the assignment and start another one in the datagram.
    return "STATUS=" + " ".join(text.splitlines())
