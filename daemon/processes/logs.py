"""Log output of the daemon and its children: one record, one line (tracebacks indented).

Log messages carry text that clients chose (request ids, error messages that quote a field):
a newline in it must not start what reads as another record of the daemon's. So control
characters in a message are escaped, and every line of a record after its first (a traceback)
is indented.
"""

from __future__ import annotations

import logging
import sys

# C0 and C1 controls (tab kept), DEL, and the characters that viewers treat as line breaks.
_ESCAPES = {
    code: f"\\x{code:02x}"
    for code in (*range(0x00, 0x09), *range(0x0A, 0x20), 0x7F, *range(0x80, 0xA0))
} | {0x2028: "\\u2028", 0x2029: "\\u2029"}


def escape_controls(text: str) -> str:
    """``text`` with control and line-break characters written as escapes."""
    return text.translate(_ESCAPES)


class OneLineFormatter(logging.Formatter):
    """A ``logging.Formatter`` whose records cannot forge other records."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\n", "\n    ")


def configure_logging(level: str, fmt: str) -> None:
    """Log records at ``level`` and above to stderr, formatted by ``fmt``, one line each."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter(fmt))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
