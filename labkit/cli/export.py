"""`python -m labkit export notebooks/NN_x.ipynb --out build/workers/NN_x.py`: a
chapter's worker functions as an importable module, for torchrun on a cluster.

Standard library only (nbformat when exporting).

Kept, per top-level statement of a code cell: imports, `def`, `class` and
constants (`_constant` says which); skipped: cells tagged exercise or solution or
with IPython magics, and whatever starts a Cluster, runs, draws or prints. A
function that uses a name nothing kept defines is listed: it needs an argument.
"""

from __future__ import annotations

import ast
import builtins
import symtable
import sys
from dataclasses import dataclass, field
from pathlib import Path

SKIP_TAGS = {"exercise", "solution"}
_STATIC = (ast.Constant, ast.Name, ast.Attribute, ast.BinOp, ast.UnaryOp,
           ast.BoolOp, ast.Compare, ast.Tuple, ast.List, ast.Set, ast.Dict,
           ast.Subscript, ast.Slice, ast.IfExp, ast.Starred, ast.JoinedStr,
           ast.FormattedValue, ast.Load, ast.Store, ast.operator, ast.unaryop,
           ast.boolop, ast.cmpop, ast.expr_context)


@dataclass
class Export:
    source: str                       # the module's text
    kept: list[tuple[int, str]] = field(default_factory=list)     # (cell, what)
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (cell, why)
    unresolved: dict[str, list[str]] = field(default_factory=dict)  # fn -> names
    functions: list[str] = field(default_factory=list)


def _targets(stmt) -> list[str]:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
    names = []
    for t in targets:
        for node in ast.walk(t):
            if isinstance(node, ast.Name):
                names.append(node.id)
            elif not isinstance(node, (ast.Tuple, ast.List, ast.Store, ast.Starred)):
                return []  # x.a = ..., x[0] = ...: changes an object, not a constant
    return names


def _constant(stmt, defined: set[str]) -> bool:
    """Whether an assignment is a constant to keep: its right-hand side uses only
    literals, operators, names already kept and builtins, and a call or
    comprehension only when every target is upper case (`PSI = sum(...)`)."""
    names = _targets(stmt)
    if not names or stmt.value is None:
        return False
    upper = all(n.isupper() for n in names)
    local: set[str] = set()  # comprehension variables
    for node in ast.walk(stmt.value):
        if isinstance(node, ast.comprehension):
            local |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    for node in ast.walk(stmt.value):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            if node.id not in defined and node.id not in local and not hasattr(
                    builtins, node.id):
                return False
        elif isinstance(node, (ast.Call, ast.GeneratorExp, ast.ListComp,
                               ast.SetComp, ast.DictComp, ast.comprehension,
                               ast.keyword)):
            if not upper:
                return False
        elif isinstance(node, (ast.Lambda, ast.Await, ast.Yield, ast.YieldFrom,
                               ast.NamedExpr)):
            return False
        elif not isinstance(node, _STATIC):
            return False
    return True


def _describe(stmt) -> str:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return f"def {stmt.name}"
    if isinstance(stmt, ast.ClassDef):
        return f"class {stmt.name}"
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return "import"
    return ast.unparse(stmt).splitlines()[0][:60]


def _defines(stmt) -> set[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in stmt.names}
    return set(_targets(stmt))


def _unresolved(source: str, defined: set[str]) -> dict[str, list[str]]:
    """Top-level function -> global names it (or a function inside it) uses that
    nothing in the module defines."""
    out: dict[str, list[str]] = {}

    def walk(table, top):
        if isinstance(table, symtable.Function):
            for name in table.get_globals():
                if name not in defined and not hasattr(builtins, name):
                    out.setdefault(top, [])
                    if name not in out[top]:
                        out[top].append(name)
        for child in table.get_children():
            walk(child, top)

    for child in symtable.symtable(source, "<export>", "exec").get_children():
        walk(child, child.get_name())
    return out


def export_notebook(path) -> Export:
    """The chapter at `path` as an Export: the module's source (what its code
    cells keep, under a `# --- cell N` line each, compiled to check it), what
    each cell kept and skipped, and each function's names nothing kept defines."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    parts = [f'"""Exported from {Path(path).as_posix()} by `python -m labkit '
             'export`: the\nchapter\'s imports, constants, functions and classes. '
             'Do not edit; export again.\n\nRun a worker on many nodes with:\n'
             '    torchrun ... -m labkit.launch THIS_FILE.py:FUNCTION [ARG ...] '
             '--results DIR\n"""\n']
    ex = Export("")
    defined: set[str] = set()
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        tags = SKIP_TAGS & set(cell.metadata.get("tags", []))
        if tags:
            ex.skipped.append((i, f"tagged {', '.join(sorted(tags))}"))
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            ex.skipped.append((i, "not plain Python (IPython magic?)"))
            continue
        keep = []
        for stmt in tree.body:
            ok = isinstance(stmt, (ast.Import, ast.ImportFrom, ast.FunctionDef,
                                   ast.AsyncFunctionDef, ast.ClassDef)) or (
                isinstance(stmt, (ast.Assign, ast.AnnAssign)) and _constant(
                    stmt, defined))
            if ok:
                keep.append(_segment(cell.source, stmt))
                defined |= _defines(stmt)
                ex.kept.append((i, _describe(stmt)))
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    ex.functions.append(stmt.name)
            else:
                ex.skipped.append((i, _describe(stmt)))
        if keep:
            parts.append(f"# --- cell {i}\n" + "\n\n\n".join(keep) + "\n")
    ex.source = "\n\n".join(parts)
    compile(ex.source, "<export>", "exec")  # what we write is valid Python
    ex.unresolved = {k: v for k, v in _unresolved(ex.source, defined).items()
                     if k in ex.functions}
    return ex


def _segment(source: str, stmt) -> str:
    """The statement's own text, decorators included."""
    decorators = getattr(stmt, "decorator_list", [])
    lines = source.splitlines()[min([stmt.lineno] + [d.lineno for d in decorators])
                                - 1:stmt.lineno - 1]
    return "\n".join(lines + [ast.get_source_segment(source, stmt)])


def export(notebook, out) -> int:
    """Write the module; print what was kept, skipped and left unresolved."""
    notebook, out = Path(notebook), Path(out)
    if not notebook.exists():
        print(f"labkit export: no such notebook: {notebook}", file=sys.stderr)
        return 2
    ex = export_notebook(notebook)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(ex.source)
    print(f"wrote {out}: {len(ex.functions)} functions "
          f"({', '.join(ex.functions) or 'none'}), {len(ex.kept)} statements kept, "
          f"{len(ex.skipped)} skipped")
    for fn, names in ex.unresolved.items():
        print(f"  note: {fn} uses {', '.join(names)}, which the export does not "
              "define (computed in a skipped cell): pass it as an argument, or "
              "compute it in a constant cell")
    return 0
