"""Frame codec: ``[kind/version byte][msgpack body]``.

The first byte is ``family << 4 | version``: the family picks the decoder (client requests,
client replies, internal pipes), the version lets any peer be answered
``unsupported_version`` before its body is read. One codec per socket, reused.

A codec decodes the versions ``oldest .. version`` (each a superset of the one before) and
encodes ``version`` unless told another: client requests have two (``REQUEST_REVISIONS``).
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from outrider.protocol.messages import (
    PROTOCOL_VERSION,
    REQUEST_REVISIONS,
    ClientReply,
    ClientRequest,
)

T = TypeVar("T")

FAMILY_CLIENT_REQUEST = 1
FAMILY_CLIENT_REPLY = 2


class FrameError(Exception):
    """A frame that cannot be decoded; ``code`` is the wire error code to answer with."""

    def __init__(self, code: str, message: str, request_id: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


class _IdOnly(msgspec.Struct):
    request_id: str = ""


# NOTE: everything msgspec's msgpack decoder raises for bad input (msgspec 0.22, by experiment
# and from its source): DecodeError (ValidationError included) for bad msgpack and wrong
# types; UnicodeDecodeError, passed through from CPython, for a str that is not UTF-8 (a value,
# a map key, a tag, a Literal); RecursionError past the interpreter's recursion limit, even in
# a value it only skips (an unknown field, a Raw): 1,000 levels on Python 3.11, the C recursion
# limit on 3.12 (1,500 levels on 3.12.1), so a 1,000-deep unknown field decodes there.
# Anything else (MemoryError) is not input.
_UNDECODABLE = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


class FrameCodec(Generic[T]):
    """Encodes and decodes one message type (usually a tagged union) of one family."""

    def __init__(
        self, family: int, type_: Any, version: int = PROTOCOL_VERSION, oldest: int | None = None
    ) -> None:
        self.oldest = version if oldest is None else oldest
        assert 0 < family < 16 and 0 < self.oldest <= version < 16
        self.header = bytes([family << 4 | version])
        self.family = family
        self.version = version
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(type_)
        self._id_decoder = msgspec.msgpack.Decoder(_IdOnly | list[msgspec.Raw])
        self._str_decoder = msgspec.msgpack.Decoder(str)

    def encode(self, msg: T, version: int | None = None) -> bytes:
        """``msg``'s frame, in ``version`` (None: the newest this codec speaks)."""
        if version is None:
            return self.header + self._encoder.encode(msg)
        assert self.oldest <= version <= self.version
        return bytes([self.family << 4 | version]) + self._encoder.encode(msg)

    def decode(self, frame: bytes | memoryview) -> T:
        """Decode one frame. Raises nothing but ``FrameError`` (``malformed``,
        ``unsupported_version`` or ``invalid_request``, with the request id when the body
        still yields one), whatever the bytes."""
        data = memoryview(frame)
        if len(data) == 0:
            raise FrameError("malformed", "empty frame")
        family, version = data[0] >> 4, data[0] & 0x0F
        if family != self.family:
            raise FrameError("malformed", f"unknown frame kind {data[0]:#04x}")
        body = data[1:]
        if not self.oldest <= version <= self.version:
            spoken = (
                f"{self.version}"
                if self.oldest == self.version
                else f"{self.oldest} to {self.version}"
            )
            raise FrameError(
                "unsupported_version",
                f"protocol version {version} is not supported (this peer speaks {spoken})",
                self._request_id(body),
            )
        try:
            return self._decoder.decode(body)
        except msgspec.ValidationError as exc:
            raise FrameError("invalid_request", str(exc), self._request_id(body)) from None
        except _UNDECODABLE as exc:
            message = f"undecodable body: {exc}"
            raise FrameError("malformed", message, self._request_id(body)) from None

    def _request_id(self, body: memoryview) -> str:
        """The request id of a body that failed to decode: field ``request_id`` of a map body
        (requests), the element after the tag of an array body (the ``array_like`` tagged
        replies); "" when none is readable."""
        try:
            head = self._id_decoder.decode(body)
            if isinstance(head, _IdOnly):
                return head.request_id
            return self._str_decoder.decode(head[1]) if len(head) > 1 else ""
        except _UNDECODABLE:
            return ""


def request_codec() -> FrameCodec[ClientRequest]:
    oldest, newest = REQUEST_REVISIONS[0], REQUEST_REVISIONS[-1]
    return FrameCodec(FAMILY_CLIENT_REQUEST, ClientRequest, newest, oldest)


def reply_codec() -> FrameCodec[ClientReply]:
    return FrameCodec(FAMILY_CLIENT_REPLY, ClientReply)
