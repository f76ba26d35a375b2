"""Argument checks shared by the closed forms (plain errors a student can read)."""

from __future__ import annotations

from labkit.arguments import whole


def check_counts(**counts) -> None:
    """Each a whole number >= 1 (a bool is not one), or an error naming it."""
    for name, v in counts.items():
        whole(v, name)


def check_world_size(world_size) -> int:
    """A process group's size: a whole number >= 1."""
    return whole(world_size, "the number of ranks")



def check_size(size) -> float:
    if size < 0:
        raise ValueError(f"a size in bytes cannot be negative, got {size}")
    return size


def check_params(psi) -> float:
    if isinstance(psi, bool) or not isinstance(psi, (int, float)) or psi < 0:
        raise ValueError(f"a parameter count must be a number >= 0, got {psi!r}")
    return psi
