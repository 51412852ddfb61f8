"""Byte sizes as users type them ("8GiB", "64 GB", "512MiB", "8589934592") and as we print them.

Decimal units are powers of 1000 and binary units powers of 1024, as in IEC 80000-13. A bare "G" is
refused: Slurm and Docker read it as GiB, disk vendors as GB, and the two differ by 7 %.
"""

from __future__ import annotations

import re

from orchestrate.errors import Problem, UserError

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40
_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_EXAMPLES = "e.g. 8GiB, 8GB, 512MiB or a byte count such as 8589934592"


def parse_size(value: str | int, where: str) -> int:
    """Bytes in `value`; `where` (the flag or YAML key it came from) labels the error."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise _bad(where, f"{value} is negative")
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise _bad(where, f"{value!r} is not a size")
    number, unit = match.group(1), match.group(2).lower()
    if not unit:
        if "." in number:
            raise _bad(where, f"{value!r} is a fractional number of bytes")
        return int(number)
    if unit not in _UNITS:
        if unit in ("k", "m", "g", "t"):
            upper = unit.upper()
            raise _bad(where, f"{value!r}: unit {upper!r} is ambiguous",
                       f"write {number}{upper}iB (powers of 1024) or {number}{upper}B (powers of 1000)")
        raise _bad(where, f"{value!r}: unknown unit {match.group(2)!r}")
    return round(float(number) * _UNITS[unit])


def format_bytes(n: int | float, digits: int = 2, in_gib: bool = False) -> str:
    """The one way bytes are printed. By default in the largest binary unit that keeps the number
    >= 1 ("7.45 GiB", "512 B"); `in_gib`: always GiB, so a table's column compares at a glance,
    except MiB below 0.1 GiB, so small amounts (an overflow of 30 MiB) do not read "+0.0 GiB"."""
    if in_gib:
        return f"{n / MiB:.0f} MiB" if abs(n) < 0.1 * GiB else f"{n / GiB:.{digits}f} GiB"
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n:.0f} B"


def gib(n: float) -> str:
    """Bytes for the planner's tables and messages: "12.6 GiB" (format_bytes in GiB, 1 digit)."""
    return format_bytes(n, digits=1, in_gib=True)


def parameter_count(n: int) -> str:
    """A parameter count for tables and messages: "8.03B", "124.4M"."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _bad(where: str, message: str, fix: str = _EXAMPLES) -> UserError:
    return UserError("invalid size", [Problem(where, message, fix)])
