"""Byte counts as people read them, for messages and progress lines (a leaf module: the weight pass
and the budget both print sizes, and neither should import the other's planning to do it)."""

from __future__ import annotations

GiB = 1 << 30


def human(n: int | None) -> str:
    """`n` bytes in the largest of GiB, MiB and KiB it reaches, two decimals ("-" for None)."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
