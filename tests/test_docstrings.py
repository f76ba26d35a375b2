"""Docstrings stay short and present (issue 39): every labkit module has one of at
most MAX_MODULE_LINES lines, every public function or method longer than
MAX_UNDOCUMENTED_BODY lines has one, and the design essays live in
docs/design.md, which README.md links."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "labkit"
MAX_MODULE_LINES = 10  # what it is, what it may import, its one non-obvious fact
MAX_UNDOCUMENTED_BODY = 15  # lines (def to last line) a public function may run bare



def _modules() -> list[tuple[str, ast.Module]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if "__pycache__" in path.parts:
            continue
        out.append((rel, ast.parse(path.read_text(encoding="utf-8"), rel)))
    return out


def _functions(node, public: bool = True):
    """(function node, public) for every function in a module or class body,
    through if/try/with blocks; functions nested in functions are left out."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield child, public and not child.name.startswith("_")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, public and not child.name.startswith("_"))
        elif isinstance(child, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            yield from _functions(child, public)


def test_there_are_modules_to_check():
    modules = _modules()
    assert len(modules) > 50, (
        f"walked labkit/ for modules: found "
        f"{len(modules)}, expected more than 50 (is ROOT {ROOT} right?)")


def test_every_module_has_a_docstring():
    missing = [rel for rel, tree in _modules() if not ast.get_docstring(tree)]
    assert not missing, (
        f"every labkit module needs a docstring (what it is, what it may import, "
        f"its one non-obvious fact); {len(missing)} have none: {missing}")


def test_module_docstrings_are_short():
    long = {}
    for rel, tree in _modules():
        doc = ast.get_docstring(tree, clean=False)
        if doc and len(doc.splitlines()) > MAX_MODULE_LINES:
            long[rel] = len(doc.splitlines())
    assert not long, (
        f"module docstrings may have at most {MAX_MODULE_LINES} lines (the design "
        f"essay goes to docs/design.md, a fact about one line next to it); "
        f"{len(long)} are longer (path: lines): {long}")


def test_long_public_functions_have_docstrings():
    bare = []
    for rel, tree in _modules():
        for fn, public in _functions(tree):
            lines = fn.end_lineno - fn.lineno + 1
            if public and lines > MAX_UNDOCUMENTED_BODY and not ast.get_docstring(fn):
                bare.append(f"{rel}:{fn.lineno} {fn.name} ({lines} lines)")
    assert not bare, (
        f"a public function or method over {MAX_UNDOCUMENTED_BODY} lines needs a "
        f"docstring (what it does, what it returns); {len(bare)} have none: {bare}")


def test_the_design_notes_exist_and_the_readme_links_them():
    design = ROOT / "docs" / "design.md"
    assert design.is_file(), f"checked {design}: not found; the design notes live there"
    text = design.read_text(encoding="utf-8")
    sections = [ln[3:].strip() for ln in text.splitlines() if ln.startswith("## ")]
    for package in ("theory", "runtime", "viz", "cli", "checks", "comm", "numerics"):
        assert package in sections, (
            f"docs/design.md's `## ` sections: expected one for {package!r}, "
            f"found {sections}")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "](docs/design.md)" in readme, (
        "README.md: expected a markdown link to docs/design.md "
        "(`[docs/design.md](docs/design.md)`), found none")
