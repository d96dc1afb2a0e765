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
    """No final answer arrived within the caller's timeout."""

    def __init__(self, message: str, request_id: str = "") -> None:
        super().__init__("timeout", message, request_id)
