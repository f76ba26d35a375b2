"""Grading: how a graded notebook runs its checks (`graded()`, `intact()`).

Imports nothing of labkit at import time (labkit.checks.common and the guarded
modules only when called).

Answer cells run in the interpreter the checks run in: `intact()` guards labkit's
own names (checks, closed forms, the Cluster class), not Python's import
machinery (docs/teaching.md).
"""

from __future__ import annotations

import copy
import importlib
import os
import pkgutil
import sys
import types

_graded = False
_snapshot: dict[str, tuple[types.ModuleType, dict]] = {}
# modules whose names a graded notebook's checks rely on: the checks, the closed
# forms they compare with, and what both use (units, conventions, numerics)
GUARDED = ("labkit.checks", "labkit.theory", "labkit.units", "labkit.conventions",
           "labkit.numerics")
# and the one class of the runtime a check runs answers through
GUARDED_CLASSES = (("labkit.runtime.cluster", "Cluster"),)
_STATE = {(__name__, "_graded"), (__name__, "_snapshot"),
          (__name__, "_classes")}  # may change: ours
_classes: dict[tuple[str, str], tuple[type, tuple]] = {}


def graded(on: bool = True) -> None:
    """Grade, from now on in this kernel: an exercise left as its stub (or its
    answer as None) fails its check, so nbgrader gives it no points. Once on it
    stays on: `graded(False)` raises. `make nbgrader`'s assignments call it in
    their first code cell."""
    global _graded
    if not on and is_graded():
        from labkit.checks.common import ExerciseError

        raise ExerciseError("grading is on in this notebook and stays on: "
                            "graded(False) cannot switch it off")
    _graded = bool(on)
    remember()


def is_graded() -> bool:
    """True once `graded()` ran in this kernel, or under nbgrader's autograde or
    validate (NBGRADER_EXECUTION in the environment)."""
    return _graded or os.environ.get("NBGRADER_EXECUTION") in ("autograde",
                                                                "validate")


# --------------------------------------------------------- the checks' names


def _modules() -> list[types.ModuleType]:
    """Every guarded module, imported (a package's submodules too)."""
    out = []
    for name in GUARDED:
        mod = importlib.import_module(name)
        out.append(mod)
        for info in pkgutil.walk_packages(getattr(mod, "__path__", []),
                                          prefix=name + "."):
            out.append(importlib.import_module(info.name))
    return out


def _guarded(obj) -> bool:
    return getattr(obj, "__module__", "").startswith(GUARDED)


def _record(value, ours: bool = False):
    """What is kept of one module attribute, to compare and put back: a function's
    code and defaults, a class's own attributes, a copy of a mutable constant
    (`ours`: the value is guarded wherever it was defined)."""
    if isinstance(value, types.FunctionType) and (ours or _guarded(value)):
        return ("function", value.__code__, value.__defaults__,
                copy.copy(value.__kwdefaults__))
    if isinstance(value, type) and (ours or _guarded(value)):
        return ("class", {k: (v, _record(getattr(v, "__func__", v), ours))
                          for k, v in vars(value).items()
                          if k not in ("__dict__", "__weakref__")})
    if isinstance(value, (list, dict, set)):
        return ("data", copy.copy(value))  # its items, themselves
    return None


def _same_items(a, b) -> bool:
    """A container holds the very items it held (identity, not equality: an
    object that compares by identity would otherwise look changed)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(a[k] is b[k] for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b))
    return a == b


def remember() -> None:
    """Keep every guarded module's names as they are now (once per kernel: the
    first call; labkit.checks makes it when it is imported)."""
    if _snapshot:
        return
    for module, name in GUARDED_CLASSES:
        cls = getattr(importlib.import_module(module), name)
        _classes[module, name] = (cls, _record(cls, ours=True))
    for mod in _modules():
        names = {k: (v, _record(v)) for k, v in vars(mod).items()
                 if (mod.__name__, k) not in _STATE and k != "__builtins__"}
        _snapshot[mod.__name__] = (mod, names)


def _restore(where: str, value, kept, changed: list[str]) -> None:
    """Put back what `kept` says of `value`, naming each difference in `changed`."""
    if kept is None:
        return
    kind = kept[0]
    if kind == "function":
        _, code, defaults, kwdefaults = kept
        if (value.__code__, value.__defaults__, value.__kwdefaults__) != (
                code, defaults, kwdefaults):
            value.__code__, value.__defaults__ = code, defaults
            value.__kwdefaults__ = kwdefaults
            changed.append(f"{where} (its code or defaults)")
    elif kind == "class":
        for k, (v, inner) in kept[1].items():
            if vars(value).get(k, _MISSING) is not v:
                setattr(value, k, v)
                changed.append(f"{where}.{k}")
            _restore(f"{where}.{k}", getattr(v, "__func__", v), inner, changed)
    elif kind == "data" and not _same_items(value, kept[1]):
        value.clear()
        if isinstance(value, list):
            value.extend(kept[1])
        else:
            value.update(kept[1])
        changed.append(f"{where} (its contents)")


_MISSING = object()


def tampered() -> list[str]:
    """Put back every guarded name an answer cell changed since `remember()`, and
    switch grading on again if it was switched off; what was changed, one entry
    each ("labkit.checks.ring.check_crossover", ...)."""
    global _graded
    remember()
    changed: list[str] = []
    for name, (mod, names) in _snapshot.items():
        if sys.modules.get(name) is not mod:
            sys.modules[name] = mod
            changed.append(f"sys.modules[{name!r}]")
        parent, _, leaf = name.rpartition(".")
        if parent in _snapshot and getattr(sys.modules[parent], leaf, mod) is not mod:
            setattr(sys.modules[parent], leaf, mod)
            changed.append(f"{parent}.{leaf}")
        here = vars(mod)
        for k, (v, kept) in names.items():
            if here.get(k, _MISSING) is not v:
                here[k] = v
                changed.append(f"{name}.{k}")
            _restore(f"{name}.{k}", v, kept, changed)
    for (module, name), (cls, kept) in _classes.items():
        mod = sys.modules[module]
        if getattr(mod, name, None) is not cls:
            setattr(mod, name, cls)
            changed.append(f"{module}.{name}")
        _restore(f"{module}.{name}", cls, kept, changed)
    if not _graded:
        _graded = True
        changed.append("grading (switched off with labkit.checks.graded or its flag)")
    return changed


def intact() -> None:
    """The first line of a graded notebook's locked test cell: ExerciseError if
    an answer cell changed labkit's checks or closed forms or switched grading
    off (all put back first), so that such a notebook scores nothing."""
    changed = tampered()
    if changed:
        from labkit.checks.common import ExerciseError

        shown = ", ".join(changed[:6]) + (f" and {len(changed) - 6} more"
                                          if len(changed) > 6 else "")
        raise ExerciseError(
            f"a cell changed what grading relies on: {shown}. It is put back, but "
            "this test gives no points: a graded notebook's checks run as "
            "labkit's files define them")
