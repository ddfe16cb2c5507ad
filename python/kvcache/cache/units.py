"""Byte sizes as people write them: ``parse_size("16GiB")``, ``format_size(2**34)``."""

from __future__ import annotations

import math
from fractions import Fraction

__all__ = ["format_size", "parse_size"]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "pb": 1000**5,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
    "p": 1024**5,
}


def parse_size(text: str | int) -> int:
    """Parses a byte count such as ``"80GiB"``, ``"512MiB"``, ``"1.5GB"`` or ``"1e9"``.

    Units (case-insensitive, optional space before them): ``B``; decimal ``KB MB GB TB PB``
    (powers of 1000); binary ``KiB MiB GiB TiB PiB`` and the short ``K M G T P`` (powers of
    1024). A number without a unit is bytes. A fractional result is rounded down to whole
    bytes.

    Args:
        text: The size text, or an int that is returned as is.

    Returns:
        Bytes, >= 0.

    Raises:
        ValueError: Empty text, an unknown unit, a negative, NaN or infinite number.

    Example:
        >>> parse_size("80GiB"), parse_size("512 MiB"), parse_size("1.5GB"), parse_size("1e9")
        (85899345920, 536870912, 1500000000, 1000000000)
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"invalid size {text!r}: must be positive (or 0)")
        return text
    if not isinstance(text, str):
        raise ValueError(f"invalid size {text!r}: expected text such as '80GiB'")
    s = text.strip()
    i = len(s)
    while i > 0 and s[i - 1].isalpha():
        i -= 1
    number, unit = s[:i].strip(), s[i:].lower()
    # "1e9" ends in a digit, but "1e" would be split as number "1" and unit "e": reject.
    if unit not in _UNITS:
        raise ValueError(
            f"invalid size {text!r}: unknown unit {s[i:]!r} "
            "(use B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB or PiB)"
        )
    try:
        value = Fraction(number)
    except (ValueError, ZeroDivisionError):
        raise ValueError(
            f"invalid size {text!r}: expected a number and a unit, e.g. '80GiB'"
        ) from None
    if value < 0:
        raise ValueError(f"invalid size {text!r}: must be positive (or 0), e.g. '80GiB'")
    return math.floor(value * _UNITS[unit])


def format_size(nbytes: int) -> str:
    """Human-readable binary size with three significant digits.

    Example:
        >>> format_size(85899345920), format_size(1536), format_size(100)
        ('80.0 GiB', '1.50 KiB', '100 B')
    """
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            if unit == "B":
                return f"{int(value)} B"
            digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
            return f"{value:.{digits}f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover
