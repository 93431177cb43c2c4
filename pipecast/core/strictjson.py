"""Decoding untrusted JSON strictly: one error type for everything that can go wrong.

``json.loads`` alone lets through what the protocols here do not want (duplicate keys, where the last
one silently wins; ``NaN``/``Infinity``; ``1e400``, which becomes ``inf``) and raises more than
``JSONDecodeError`` on hostile input: ``RecursionError`` on deep nesting (``[`` x 100000),
``ValueError`` on an integer of more than 4300 digits, ``MemoryError``; an escaped lone surrogate
(``"\\ud800"``) decodes to a string that cannot be encoded again. :func:`loads` turns all of
them into :class:`JSONInputError`, which each parser wraps in its own typed error.
"""

import json
import math
import re
import reprlib
from typing import Any

_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


class JSONInputError(ValueError):
    """Bytes that are not acceptable JSON; the message says why."""


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONInputError(f"number {text[:40]} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise JSONInputError(f"{name} is not a JSON number")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise JSONInputError(f"duplicate key {key[:80]!r}")
            seen.add(key)
    return out


_DECODER = json.JSONDecoder(object_pairs_hook=_unique, parse_float=_finite, parse_constant=_no_constant)


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """Decode ``data`` (UTF-8 bytes or text) as one JSON value; :class:`JSONInputError` if it is not valid
    JSON, nests deeper than the interpreter can decode, repeats a key in an object, holds a non-finite
    number or a string with a lone surrogate. Values nested a few hundred levels deep still decode:
    describe them with :func:`describe`, never ``repr``, in messages."""
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
        if isinstance(data, str):  # text decoded with surrogateescape (e.g. an HTTP header) holds raw halves
            data.encode("utf-8")
    except UnicodeDecodeError as exc:
        raise JSONInputError(f"not UTF-8 ({exc})") from None
    except UnicodeEncodeError as exc:
        raise JSONInputError(f"text holds a lone surrogate at {exc.start}") from None
    try:
        value = _DECODER.decode(text)
    except JSONInputError:
        raise
    except json.JSONDecodeError as exc:
        raise JSONInputError(str(exc)) from None
    except RecursionError:
        raise JSONInputError("nested too deeply") from None
    except MemoryError:
        raise JSONInputError("too large to decode") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise JSONInputError(str(exc)) from None
    if _ESCAPED_SURROGATE.search(text):  # rare: a pair is fine, a lone half cannot be encoded again
        _check_strings(value)
    return value


def _check_strings(value: Any) -> None:
    """Every string in ``value`` (keys too) is valid Unicode: no lone surrogate (iterative, any depth)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise JSONInputError(f"string {describe(item)} holds a lone surrogate") from None


def loads_object(data: bytes | bytearray | memoryview | str) -> dict[str, Any]:
    """:func:`loads`, and the value must be a JSON object."""
    value = loads(data)
    if not isinstance(value, dict):
        raise JSONInputError(f"expected a JSON object, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 60, 60


def describe(value: Any) -> str:
    """A short ``repr`` of an untrusted decoded value for an error message (bounded depth and length)."""
    return _SHORT.repr(value)
