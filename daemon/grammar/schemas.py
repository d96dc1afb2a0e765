"""JSON schemas (a request's, or its tools' parameters) as the daemon compiles them: through
xgrammar's own grammar of the schema, with its length-bounded strings made strict JSON.

xgrammar (0.2.9) writes a string bounded by ``minLength`` / ``maxLength`` as a repetition of
one character rule, ``[^"\\\\\\r\\n]``, which lets raw control characters through (U+0000 to
U+001F but CR and LF); RFC 8259 forbids them inside a string, so a model that picks a tab there
produces JSON that strict parsers refuse. Such a rule is narrowed to the characters the
grammar's unbounded strings take unescaped; everything else, the bounds and the speed of its
masks included, is xgrammar's. Such a string still takes no escape (a quotation mark, a
newline): a character rule of two forms, escaped or not, costs xgrammar about a second for a
step's 32 masks. (Its ``pattern`` strings refuse control characters already, but a bound
written as a pattern can cost a hundred milliseconds a mask.)
"""

from __future__ import annotations

import re

import xgrammar as xgr

# A rule whose whole body is the loose character class of a length-bounded string.
_LOOSE = re.compile(r'^(\S+ ::= )\(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
# The unescaped characters of xgrammar's unbounded strings (its ``basic_string_sub``).
_STRICT = r"(([^\0-\x1f\"\\\r\n]))"


def strict_json(grammar: xgr.Grammar) -> str:
    """``grammar`` (xgrammar's, of a JSON schema or of a structural tag holding schemas) as
    EBNF text, each length-bounded string's characters kept from control characters."""
    return _LOOSE.sub(lambda loose: loose.group(1) + _STRICT, str(grammar))
