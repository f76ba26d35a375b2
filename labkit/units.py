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


def si_bytes(n: float) -> str:
    """12_300 -> '12.3 kB': decimal units (networks, papers' GB), as many as it
    takes that no figure of bytes reads 0.0."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TB", TB), ("GB", GB), ("MB", MB), ("kB", KB)):
        if n >= size:
            v = n / size
            return f"{sign}{v:,.0f} {unit}" if v >= 100 else f"{sign}{v:.1f} {unit}"
    return f"{sign}{n:.0f} B"


def percent(x: float) -> str:
    """0.41 -> '41%', 0.034 -> '3.4%', 0.0025 -> '0.25%': a share that is not
    zero never reads 0%."""
    if x == 0 or abs(x) >= 0.1:
        return f"{x:.0%}"
    if abs(x) >= 0.01:
        return f"{x:.1%}"
    return f"{x * 100:.2g}%"


def seconds(t: float) -> str:
    """1.234 -> '1.23 s', 0.0123 -> '0.0123 s': three significant digits below
    a second, so a short step never reads 0.00 s."""
    return f"{t:,.2f} s" if t >= 1 else f"{t:.3g} s"
