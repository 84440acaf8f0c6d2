"""Byte counts as gdsckpt shows them and reads them: one convention, here only.

Shown in decimal units (B, kB, MB, GB, TB: powers of 1000), as disks and network links are
sold and as GB/s rates are quoted. Read as GNU coreutils read sizes (dd, truncate, head -c):
"4GB" is 4 x 10^9 bytes, "4GiB" and the bare "4G" are 4 x 2^30, "512" is bytes.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["format_bytes", "parse_size", "GB", "GIB"]

GB = 10**9
GIB = 1 << 30

_DECIMAL = ("B", "kB", "MB", "GB", "TB", "PB")
_SIZE = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?:(?P<prefix>[kKmMgGtTpP])(?P<suffix>B|iB|i)?|B)?")
_POWER = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def format_bytes(n: float) -> str:
    """`n` bytes in decimal units with three significant figures: 512 B, 1.50 kB, 3.60 GB, 42.0 TB."""
    if abs(n) < 1000:
        return f"{int(n)} B"
    for unit in _DECIMAL[1:]:
        n /= 1000
        if abs(n) < 999.5 or unit == _DECIMAL[-1]:
            return f"{n:.3g} {unit}" if abs(n) >= 100 else f"{n:#.3g} {unit}"
    raise AssertionError("unreachable")


def parse_size(text: str) -> int:
    """Bytes from a size as coreutils read it: "123", "64K" / "64KiB" (x 1024), "64kB" / "64KB"
    (x 1000), and so on for M, G, T and P; a fraction is allowed ("1.5GiB"). A ValueError that
    names the text for anything else (a negative size, "5XB", "")."""
    m = _SIZE.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"{text!r} is not a size: a byte count with an optional unit, such as 512, 64KiB, "
                         "64K (= 64KiB), 4GB (4 x 10^9) or 4GiB (4 x 2^30)")
    # exact: "4.1GB" is 4.1 x 10^9 bytes, which a float product misses; a large count stays whole
    number, prefix, suffix = Fraction(m["number"]), m["prefix"], m["suffix"]
    if prefix is None:
        scale = 1
    else:
        base = 1000 if suffix == "B" else 1024  # "kB"/"KB": decimal; "K", "Ki", "KiB": binary
        scale = base ** _POWER[prefix.lower()]
    value = number * scale
    if value.denominator != 1:
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return value.numerator
