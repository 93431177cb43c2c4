"""Parsing and printing byte sizes, rates and durations, and the package chunk size."""

import math
import re
import sys
from decimal import Decimal
from fractions import Fraction

# Chunk size of a package's per-chunk digests: the unit peers verify (relays pass it on in pieces as it arrives).
DEFAULT_CHUNK_BYTES = 1 << 20

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3, "ti": 1024**4,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, *, allow_zero: bool = False) -> int:
    """Parse "64MB", "4MiB", "1.5GB" or "1048576" into bytes (a fraction of a unit above a byte rounds down); raise
    ValueError naming the text. Zero is refused unless ``allow_zero`` (a size whose 0 means "none")."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 4MiB, 64MB, 1GB or a byte count)")
    # exact (a float rounds 18446744073709551615, a uint64's maximum, up to 2**64); Decimal parses any length
    number = Fraction(Decimal(match.group(1))) * _UNITS[unit]
    if number > sys.float_info.max:  # hundreds of digits: no size anything holds
        raise ValueError(f"size is too large: {text!r}")
    if _UNITS[unit] == 1 and number.denominator != 1:  # "1.5" bytes: no size; a fraction of a KiB rounds down
        raise ValueError(f"not a whole number of bytes: {text!r}")
    value = int(number)
    if value <= 0 and not (allow_zero and value == 0):
        raise ValueError(f"size must be positive: {text!r}")
    return value


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|)\s*$")
_SECONDS = {"ms": 0.001, "s": 1.0, "": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Parse "2s", "500ms", "5m", "1h" or "1.5" (seconds) into seconds; raise ValueError naming the text."""
    match = _DURATION.match(str(text))
    if not match:
        raise ValueError(f"not a duration: {text!r} (use e.g. 500ms, 2s, 5m, 1h or a number of seconds)")
    seconds = float(match.group(1)) * _SECONDS[match.group(2)]
    if not math.isfinite(seconds):  # hundreds of digits: float() says inf, a timeout that never ends
        raise ValueError(f"duration is too long: {text!r}")
    return seconds


def format_bytes(n: float) -> str:
    """Print a byte count with a binary unit, e.g. 256.0 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
