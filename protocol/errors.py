"""Exceptions raised by the client library."""

from __future__ import annotations


class RequestError(Exception):
    """A request ended with a typed error; ``code`` is one of ``messages.ERROR_CODES``."""

    def __init__(self, code: str, message: str, request_id: str = "") -> None:
        super().__init__(f"{code}: {message}" + (f" (request {request_id})" if request_id else ""))
        self.code = code
        self.message = message
        self.request_id = request_id


class Timeout(RequestError, TimeoutError):
    """No final answer arrived within the caller's timeout. A plain ``Timeout``: the client
    was connected to a daemon that did not answer in time; ``NotListening``: it was not."""

    def __init__(self, message: str, request_id: str = "") -> None:
        super().__init__("timeout", message, request_id)


class NotListening(Timeout):
    """A ``Timeout`` while the client had no connection to the endpoint: no daemon listens
    there (none was started, it has not bound yet, or one that exited left its socket file
    behind), or this process may not connect to it; the message says which. Still code
    ``timeout``: ``except Timeout`` catches it too."""
