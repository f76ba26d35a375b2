"""Units, explicit: GB = 1e9 bytes (networks, papers' tables), GiB = 2**30 (memory)."""

from __future__ import annotations

KB, MB, GB, TB = 1e3, 1e6, 1e9, 1e12
KiB, MiB, GiB = 2**10, 2**20, 2**30


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, as memory is counted)."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
