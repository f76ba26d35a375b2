"""Argument checks shared by the closed forms (plain errors a student can read)."""

from __future__ import annotations


def check_counts(**counts) -> None:
    """Each a whole number >= 1 (a bool is not one), or a ValueError naming it."""
    for name, v in counts.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")


def check_n(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of ranks must be an integer >= 1, got {n!r}")
    return n



def check_size(size) -> float:
    if size < 0:
        raise ValueError(f"a size in bytes cannot be negative, got {size}")
    return size


def check_params(psi) -> float:
    if isinstance(psi, bool) or not isinstance(psi, (int, float)) or psi < 0:
        raise ValueError(f"a parameter count must be a number >= 0, got {psi!r}")
    return psi
