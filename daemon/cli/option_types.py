"""The type of a plugin option as ``outrider plugins`` prints it: what the option's JSON may
hold, in words (``int (0 to 64)``, ``one of: coupled, rejection``), not a Python repr.

Every type is read through ``msgspec.inspect``, the validator's own view, so the bounds
printed are the bounds the options parser enforces.
"""

from __future__ import annotations

from typing import Any

import msgspec.inspect as mi


def option_type_text(tp: Any) -> str:
    """``tp`` (an options struct field's annotation) in words."""
    return _text(mi.type_info(tp))


def _text(info: mi.Type) -> str:
    match info:
        case mi.BoolType():
            return "bool"
        case mi.IntType():
            return "int" + _bounds(info)
        case mi.FloatType():
            return "float" + _bounds(info)
        case mi.StrType():
            pattern = f" matching {info.pattern}" if info.pattern is not None else ""
            return "str" + _lengths(info.min_length, info.max_length) + pattern
        case mi.LiteralType():
            return "one of: " + ", ".join(_literal(value) for value in info.values)
        case mi.EnumType():
            return "one of: " + ", ".join(_literal(member.value) for member in info.cls)
        case mi.NoneType():
            return "null"
        case mi.UnionType():
            return " or ".join(_text(member) for member in info.types)
        case mi.ListType() | mi.SetType() | mi.FrozenSetType() | mi.VarTupleType():
            lengths = _lengths(info.min_length, info.max_length)
            return f"list of {_text(info.item_type)}{lengths}"
        case mi.TupleType():
            return "[" + ", ".join(_text(item) for item in info.item_types) + "]"
        case mi.DictType():
            return f"object of {_text(info.key_type)} to {_text(info.value_type)}"
        case mi.AnyType():
            return "any"
    # Structs, dates and the like: msgspec's name for the kind, e.g. ``datetime``.
    return type(info).__name__.removesuffix("Type").lower()


def _bounds(info: mi.IntType | mi.FloatType) -> str:
    if info.ge is not None and info.le is not None:
        text = f" ({info.ge} to {info.le})"
    else:
        limits = [(">=", info.ge), (">", info.gt), ("<=", info.le), ("<", info.lt)]
        comparisons = [f"{op} {value}" for op, value in limits if value is not None]
        text = " " + " and ".join(comparisons) if comparisons else ""
    if info.multiple_of is not None:
        text += f", a multiple of {info.multiple_of}"
    return text


def _lengths(least: int | None, most: int | None) -> str:
    if least is not None and most is not None:
        return f" (length {least} to {most})"
    if least is not None:
        return f" (length >= {least})"
    return f" (length <= {most})" if most is not None else ""


def _literal(value: str | int | None) -> str:
    return "null" if value is None else str(value)
