"""One rule for labkit's modules, beside the layers contract and the public
faces: a module uses no other module's private names. A `_name` is its
module's own: another module neither imports it, nor reads it off an
imported module, nor reads or sets it on an object of a class defined
elsewhere in labkit (`cluster._pids`). A `_module` is its package's own.
Python's and torch's private names are not labkit's to police here."""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "labkit"


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _resolve(mod: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _own_attributes(tree) -> set[str]:
    """Private names a module defines on its objects: `self._x = ...`, and
    methods and class attributes named `_x`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) \
                        else [item.target]
                    names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return {n for n in names if _private(n)}


def uses_of_private_names() -> list[str]:
    modules = _modules()
    trees = {m: ast.parse(p.read_text(encoding="utf-8")) for m, p in modules.items()}
    defined_in = defaultdict(set)  # private attribute -> modules defining it
    for m, tree in trees.items():
        for name in _own_attributes(tree):
            defined_in[name].add(m)
    found = []
    for m, tree in trees.items():
        path, own = modules[m], _own_attributes(trees[m])
        where = f"{path.relative_to(ROOT)}"
        aliases = {}  # local name -> labkit module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                src = _resolve(m, path, node)
                if not src.startswith("labkit"):
                    continue
                for a in node.names:
                    full = f"{src}.{a.name}"
                    if full in modules:
                        aliases[a.asname or a.name] = full
                    if _private(a.name) and full not in modules:
                        found.append(f"{where}:{node.lineno} imports {full}")
                    pkg = full.rsplit(".", 1)[0]
                    if _private(a.name) and full in modules and not (
                            m == pkg or m.startswith(pkg + ".")):
                        found.append(f"{where}:{node.lineno} imports the private "
                                     f"module {full}")
                for part in src.split(".")[1:]:
                    if _private(part) and not m.startswith(
                            src.rsplit(".", 1)[0]):
                        found.append(f"{where}:{node.lineno} imports from the "
                                     f"private module {src}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("labkit") and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            v = node.value
            if isinstance(v, ast.Name) and v.id in aliases:
                found.append(f"{where}:{node.lineno} reads {aliases[v.id]}."
                             f"{node.attr}")
            elif not (isinstance(v, ast.Name) and v.id in ("self", "cls")) and \
                    node.attr not in own and defined_in.get(node.attr):
                others = ", ".join(sorted(defined_in[node.attr]))
                found.append(f"{where}:{node.lineno} uses {ast.unparse(node)}, "
                             f"private to {others}")
    return sorted(set(found))


def test_no_module_uses_another_modules_private_names():
    found = uses_of_private_names()
    assert not found, ("private names used across labkit's modules (make the "
                       "name public, or move the code to its module):\n"
                       + "\n".join(found))
