"""One public face per layer: a chapter imports labkit's names from the layer's
package (`from labkit.parallel import FullyShardedDataParallel`), never from the
module inside it, and every name it takes is in that package's __all__; inside
labkit, a layer uses another layer's names only where that layer exports them,
and never through one of its private (`_name`) modules."""

from __future__ import annotations

import ast
import importlib
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ("runtime", "ledger", "theory", "comm", "parallel", "viz", "checks", "cli")
# the layer packages, and the modules the layers stand on
FACES = {"labkit", "labkit.units", "labkit.numerics", "labkit.conventions",
         *(f"labkit.{layer}" for layer in LAYERS)}
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _imports(tree: ast.AST):
    """(line, module, [names]) of every labkit import in `tree`, nested too."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "labkit":
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "labkit":
                    yield node.lineno, a.name, []


def _exported(module: str) -> set[str]:
    """A layer package's __all__; a plain module's (units, numerics) public names."""
    mod = importlib.import_module(module)
    if hasattr(mod, "__all__"):
        names = set(mod.__all__)
    else:
        names = {n for n in vars(mod) if not n.startswith("_")}
    if module == "labkit":  # the runtime's names, the layers and the base modules
        names |= set(LAYERS) | {f.split(".")[1] for f in FACES if "." in f}
    return names


def _chapter_imports():
    for path in CHAPTERS:
        cells = json.loads(path.read_text())["cells"]
        for i, cell in enumerate(cells):
            if cell["cell_type"] != "code":
                continue
            src = "".join(cell["source"])
            try:
                tree = ast.parse(src)
            except SyntaxError:  # a cell magic (%%ranks ...): plain Python after it
                lines = src.split("\n")
                tree = ast.parse("\n".join(lines[1:]) if lines[0].startswith("%%")
                                 else "")
            for line, module, names in _imports(tree):
                yield f"{path.name} cell {i} line {line}", module, names


def test_chapters_import_only_from_a_layers_face():
    wrong = [f"{where}: from {module} import {', '.join(names)}"
             for where, module, names in _chapter_imports() if module not in FACES]
    assert not wrong, ("chapters must import from a layer's package (labkit.<layer>), "
                       "not a module inside it:\n" + "\n".join(wrong))


def test_every_name_a_chapter_takes_is_exported():
    missing = [f"{where}: {module}.{name}"
               for where, module, names in _chapter_imports() if module in FACES
               for name in names if name not in _exported(module)]
    assert not missing, ("names chapters import that the layer's __all__ does not "
                         "list:\n" + "\n".join(missing))


def _library_modules():
    for path in sorted((ROOT / "labkit").rglob("*.py")):
        rel = path.relative_to(ROOT / "labkit")
        yield (rel.parts[0] if len(rel.parts) > 1 else None), path


@pytest.mark.parametrize("layer", LAYERS)
def test_layers_use_each_others_faces(layer):
    """A module of `layer` that imports from another layer's module imports a name
    that layer exports, and never from a `_private` module of it."""
    wrong = []
    for own, path in _library_modules():
        if own != layer:
            continue
        tree = ast.parse(path.read_text())
        for line, module, names in _imports(tree):
            parts = module.split(".")
            if len(parts) < 3 or parts[1] not in LAYERS or parts[1] == own:
                continue  # its own layer, a face, or a module under labkit itself
            where = f"{path.relative_to(ROOT)}:{line}"
            face = ".".join(parts[:2])
            if any(p.startswith("_") for p in parts[2:]):
                wrong.append(f"{where}: imports private {module}")
            for name in names:
                if name not in _exported(face):
                    wrong.append(f"{where}: {module}.{name} is not in {face}.__all__")
    assert not wrong, "\n".join(wrong)
