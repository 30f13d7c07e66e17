"""Parsing and formatting of sizes, rates and durations given on the command line."""

from __future__ import annotations

import re

from livemig.errors import UsageError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*$")
_MULT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str, what: str = "size") -> int:
    """Parse ``512M``, ``4K``, ``1G``, ``4096`` (binary units) into bytes."""
    m = _SIZE_RE.match(text)
    if not m:
        raise UsageError(f"bad {what} {text!r}: expected a number with optional K/M/G suffix")
    value = float(m.group(1)) * _MULT[m.group(2).lower()]
    return int(value)


_LINK_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)\s*$", re.IGNORECASE)
_LINK_MULT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
# below 1 Mbit/s no guest RAM moves in useful time; above 400 Gbit/s tc's rate
# field (64-bit bytes/s, but tbf's burst math) is out of its tested range
MIN_LINK_BITS = 10**6
MAX_LINK_BITS = 400 * 10**9


def parse_link_rate(text: str) -> int | None:
    """Parse a link rate such as ``100mbit`` or ``1gbit`` into bits/s; ``none`` → None."""
    if text.strip().lower() in ("none", "unlimited", "0"):
        return None
    m = _LINK_RE.match(text)
    if not m:
        raise UsageError(f"bad link rate {text!r}: expected e.g. 100mbit, 1gbit, 10gbit or none")
    bits = int(float(m.group(1)) * _LINK_MULT[m.group(2).lower()])
    if not MIN_LINK_BITS <= bits <= MAX_LINK_BITS:
        raise UsageError(f"bad link rate {text!r}: between 1mbit and 400gbit, or none")
    return bits


def fmt_bytes(n: float | None) -> str:
    """Human-readable binary size: ``1.5 GiB``."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_rate(bytes_per_s: float | None) -> str:
    return "-" if bytes_per_s is None else f"{fmt_bytes(bytes_per_s)}/s"
