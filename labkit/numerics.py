"""How close two floating-point runs of the same computation must be, measured in
the run itself, never read off one machine.

Sits under every layer, like `units`: imports torch and the standard library only.

`Oracle` holds the exact answer (the computation in float64) and the errors of
one-process runs that differ from it only in the order of their sums, and allows
a distributed run `FACTOR` times the largest of them. Errors are norm-wise over
everything compared together (`rel_err` says why).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Mapping

import torch

# A distributed run's error may be this many times the largest error of the
# one-process runs. Rounding errors of sums in different orders are draws of the
# same size, not the same value; measured over a whole model, two draws differ by
# well under 2x (the CPU matrix in `make test-cpus` prints the margins), and a
# real bug is >= 100x the allowance (chapters and tests check that their training
# moves the weights by more than that).
FACTOR = 4.0


def flat64(x) -> torch.Tensor:
    """Every element of a tensor, or of a dict, list or tuple of them (nested),
    as one float64 vector; dicts in key order, so two state dicts line up."""
    if isinstance(x, torch.Tensor):
        return x.detach().reshape(-1).to(torch.float64)
    if isinstance(x, Mapping):
        parts = [flat64(x[k]) for k in sorted(x, key=str)]
    elif isinstance(x, (list, tuple)):
        parts = [flat64(v) for v in x]
    elif isinstance(x, (int, float)):
        return torch.tensor([float(x)], dtype=torch.float64)
    else:
        raise TypeError(f"cannot compare a {type(x).__name__}: give tensors, or "
                        "dicts, lists or tuples of them")
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def _same_shape(got, want) -> None:
    if isinstance(want, Mapping):
        if not isinstance(got, Mapping):
            raise ValueError(f"a {type(got).__name__} compared with a dict")
        if set(got) != set(want):
            missing = sorted(map(str, set(want) - set(got)))
            extra = sorted(map(str, set(got) - set(want)))
            raise ValueError(f"different keys: missing {missing}, extra {extra}")
        for k in want:
            _same_shape(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)):  # e.g. a tensor of losses vs a list
            n, m = flat64(got).numel(), flat64(want).numel()
            if n != m:
                raise ValueError(f"{n} values compared with {m}")
            return
        if len(got) != len(want):
            raise ValueError(f"{len(got)} items compared with {len(want)}")
        for g, w in zip(got, want):
            _same_shape(g, w)
    elif isinstance(want, torch.Tensor) and tuple(got.shape) != tuple(want.shape):
        raise ValueError(f"shape {tuple(got.shape)} compared with {tuple(want.shape)}")


def rel_err(got, want) -> float:
    """||got - want|| / ||want||, over every element together, in float64.

    got, want: tensors, or dicts, lists or tuples of them with the same keys and
    shapes (two state dicts, two lists of gradients). Never per tensor: under
    Adam a gradient that is rounding noise (true value 0) becomes a full-size step
    of random sign, so one tensor's relative error can be anything."""
    _same_shape(got, want)
    g, w = flat64(got), flat64(want)
    norm = w.norm().item()
    diff = (g - w).norm().item()
    if norm == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / norm


@dataclass(frozen=True)
class Agreement:
    """One comparison of a run with the exact answer, and what it was allowed."""

    what: str           # 'rank 2's weights after 5 Adam steps'
    error: float        # its relative error against the float64 reference
    allowed: float
    basis: str          # how `allowed` was derived, in words

    @property
    def ok(self) -> bool:
        return self.error <= self.allowed

    @property
    def margin(self) -> float:
        """error / allowed: below 1 passes; the CPU matrix reports the largest."""
        return self.error / self.allowed if self.allowed else float("inf")

    def __str__(self) -> str:
        """One line to print: 'rank 2's weights: 5.2e-07 from float64 (allowed
        2.4e-06)'; the basis of the allowance is in the oracle's own line."""
        return (f"{self.what}: {self.error:.1e} from float64 "
                f"(allowed {self.allowed:.1e})")

    def check(self) -> "Agreement":
        """Raise AssertionError saying what was compared, what was measured and
        what was allowed, and why, if the error is too large."""
        if not self.ok:
            raise AssertionError(
                f"{self.what}: {self.error:.1e} from the float64 reference, more "
                f"than the {self.allowed:.1e} allowed ({self.basis})")
        return self


@dataclass(frozen=True)
class Oracle:
    """The exact answer (float64) and how far one process's own runs are from it.

    exact: the computation in float64. one_process: name -> the same computation
    in the working precision by one process, in one or more summation orders
    ({"whole batch": ..., "4 quarters": ...}). A run that only adds in another
    order may be `factor` times the largest of their errors from `exact` (at
    least `factor` units of rounding of `dtype`, for a computation one process
    happens to get exactly)."""

    exact: object
    one_process: Mapping[str, object]
    dtype: torch.dtype = torch.float32
    factor: float = FACTOR
    errors: dict = field(init=False)

    def __post_init__(self):
        if not self.one_process:
            raise ValueError("give at least one one-process run to measure rounding")
        object.__setattr__(self, "errors", {
            name: rel_err(run, self.exact) for name, run in self.one_process.items()})

    @property
    def unit(self) -> float:
        """The unit roundoff of `dtype`: half the distance from 1 to the next value."""
        return torch.finfo(self.dtype).eps / 2

    @property
    def scale(self) -> float:
        """The largest one-process error (or one unit roundoff, if larger)."""
        return max(max(self.errors.values()), self.unit)

    @property
    def allowed(self) -> float:
        return self.factor * self.scale

    @property
    def basis(self) -> str:
        runs = ", ".join(f"{name} {err:.1e}" for name, err in self.errors.items())
        return (f"{self.factor:g} x the largest error of one process in "
                f"{_dtype_name(self.dtype)}: {runs}")

    def compare(self, got, what: str) -> Agreement:
        agreement = Agreement(what, rel_err(got, self.exact), self.allowed,
                              self.basis)
        _record(agreement)
        return agreement

    def check(self, got, what: str) -> Agreement:
        """compare(), raising AssertionError with the numbers if it is too far."""
        return self.compare(got, what).check()

    def resolves(self, other, what: str, times: float = 100.0) -> float:
        """Assert that `other` (e.g. the untrained weights) is more than `times`
        the allowance away from the exact answer, so that the check could fail:
        a step that did nothing, or half of what it should, cannot pass."""
        err = rel_err(other, self.exact)
        if not err > times * self.allowed:
            raise AssertionError(
                f"{what} is only {err:.1e} from the float64 reference, not more "
                f"than {times:g} x the {self.allowed:.1e} allowed: this comparison "
                "could not tell a wrong result from rounding")
        return err

    def __str__(self) -> str:
        """'one process in float32, from float64: whole batch 6.0e-07, 4 quarters
        5.3e-07; allowed 4 x the larger: 2.4e-06'"""
        runs = ", ".join(f"{n} {e:.1e}" for n, e in self.errors.items())
        which = "the larger" if len(self.errors) == 2 else "the largest"
        if self.scale > max(self.errors.values()):
            which = "one unit of rounding"
        return (f"one process in {_dtype_name(self.dtype)}, from float64: {runs}; "
                f"allowed {self.factor:g} x {which}: {self.allowed:.1e}")


def _record(a: Agreement) -> None:
    """With LABKIT_MARGINS=FILE, append each comparison to FILE (one JSON line):
    `make test-cpus` reports the largest error/allowed per chapter and test file.
    Where it ran: pytest's current test (a notebook's kernel inherits it from
    nbval: 'notebooks/05_data_parallel.ipynb::Cell 0')."""
    path = os.environ.get("LABKIT_MARGINS")
    if not path:
        return
    where = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0]
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"where": where, "what": a.what, "error": a.error,
                            "allowed": a.allowed, "margin": a.margin}) + "\n")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
