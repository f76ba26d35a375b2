"""The scripts and style sheets `make book` and `make slides` pages load, copied
beside them so the pages work without a network (a lecture hall, an exam room).

    python -m labkit.cli.vendor _build/vendor                    # fetch, once
    python -m labkit.cli.vendor --flags ../vendor _build/vendor  # nbconvert options

Imports labkit.cli.page_assets only; fetches each package with `npm pack`, node's
own client, and keeps the files the pages use under `_build/vendor/<name>/`.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from fnmatch import fnmatch
from pathlib import Path

from labkit.cli.page_assets import DECK_CSS, DECK_JS, SNAPSHOT_JS

# local name -> (npm package@version, the files or folders of it the pages use;
# a name may be a glob). The versions: those nbconvert's templates name (MathJax,
# reveal.js) or its defaults are written for (require.js, jQuery, ipywidgets 8's).
PACKAGES = {
    "mathjax": ("mathjax@2.7.7", [
        "MathJax.js", "config/TeX-AMS_CHTML-full.js", "extensions", "localization",
        "config/Safe.js", "jax/input/TeX", "jax/element", "jax/output/CommonHTML",
        "fonts/HTML-CSS/TeX/woff", "fonts/HTML-CSS/TeX/otf"]),
    "reveal.js": ("reveal.js@4.0.2", ["dist", "plugin/notes"]),
    "requirejs": ("requirejs@2.1.10", ["require.js"]),
    "jquery": ("jquery@3.7.1", ["dist/jquery.min.js"]),
    # ipywidgets 8's state (version_major 2); the standard widgets are bundled in
    "html-manager": ("@jupyter-widgets/html-manager@1.0.15", [
        "dist/embed-amd.js", "dist/*.woff2", "dist/*.woff", "dist/*.ttf"]),
}

# The slides' template imports mermaid from a CDN on every page (the book's only
# where a diagram is); no chapter draws one, so the slides use reveal's template
# without that import.
TEMPLATE = "reveal-offline"
# the deck's own style and scripts (page_assets): code that wraps, a readable size,
# tall slides that scroll from the first, widgets marked as snapshots
_DECK_SCRIPT = DECK_JS % "{{ reveal_url_prefix }}" + SNAPSHOT_JS
assert "{#" not in DECK_CSS + _DECK_SCRIPT  # Jinja would read a comment there
TEMPLATE_FILES = {
    "conf.json": '{"base_template": "reveal", "mimetypes": {"text/html": true}}\n',
    "index.html.j2": "{%- extends 'reveal/index.html.j2' -%}\n"
                     "{%- block html_head_js_mermaidjs -%}{%- endblock -%}\n"
                     "{%- block html_head_css -%}\n<style>\n" + DECK_CSS
                     + "</style>\n{%- endblock html_head_css -%}\n"
                     "{%- block footer_js -%}\n{{ super() }}\n<script>\n"
                     + _DECK_SCRIPT + "</script>\n{%- endblock footer_js -%}\n",
}


def flags(base: str, dest: Path) -> list[str]:
    """nbconvert options loading every script and style sheet from base/<name>
    (a URL relative to the page), with the template written under dest."""
    return [
        f"--HTMLExporter.require_js_url={base}/requirejs/require.js",
        f"--HTMLExporter.jquery_url={base}/jquery/dist/jquery.min.js",
        f"--HTMLExporter.mathjax_url={base}/mathjax/MathJax.js"
        "?config=TeX-AMS_CHTML-full,Safe",  # the configuration nbconvert names
        f"--HTMLExporter.widget_renderer_url={base}/html-manager/dist/embed-amd.js",
        f"--SlidesExporter.reveal_url_prefix={base}/reveal.js",
        # simple, nbconvert's default theme, loads its fonts from Google; white's
        # fonts ship with reveal.js
        "--SlidesExporter.reveal_theme=white",
        f"--TemplateExporter.extra_template_basedirs={dest.resolve() / 'templates'}",
        f"--SlidesExporter.template_name={TEMPLATE}",
    ]


def write_template(dest: Path) -> None:
    folder = dest / "templates" / TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in TEMPLATE_FILES.items():
        (folder / name).write_text(text)


def _wanted(member: str, keep: list[str]) -> bool:
    path = member.removeprefix("package/")
    return any(fnmatch(path, k) or path.startswith(k + "/") for k in keep)


def fetch(dest: Path, name: str) -> bool:
    """Unpack one package's files into dest/name; False if already there."""
    spec, keep = PACKAGES[name]
    stamp, want = dest / name / ".fetched", f"{spec} {' '.join(keep)}"
    if stamp.exists() and stamp.read_text() == want:  # same version, same files
        return False
    if shutil.which("npm") is None:
        raise SystemExit("make book and make slides fetch the pages' scripts with "
                         "npm: install Node.js (Debian/Ubuntu: apt-get install npm; "
                         "conda: conda install nodejs)")
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(["npm", "pack", "--silent", spec, "--pack-destination",
                              tmp], capture_output=True, text=True, check=False)
        if out.returncode:
            raise SystemExit(f"npm pack {spec} failed:\n{out.stderr[-2000:]}")
        tarball = Path(tmp) / out.stdout.split()[-1]
        target = dest / name
        # unpacked beside the target and renamed into place: a run cut short, or
        # two at once (two test workers), never leave a half-unpacked package
        fresh = dest / f".{name}.{os.getpid()}.tmp"
        with tarfile.open(tarball) as tar:
            members = [m for m in tar.getmembers() if _wanted(m.name, keep)]
            for m in members:
                m.name = m.name.removeprefix("package/")
            tar.extractall(fresh, members=members, filter="data")
        (fresh / ".fetched").write_text(want)
        old = dest / f".{name}.{os.getpid()}.old"
        try:
            if target.exists():
                target.rename(old)  # an earlier fetch's package (its stamp differs)
            fresh.rename(target)
        except OSError:  # another process put its copy there first
            if not (stamp.exists() and stamp.read_text() == want):
                raise
            shutil.rmtree(fresh)
        shutil.rmtree(old, ignore_errors=True)
    return True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--flags"]:  # --flags URL-BASE VENDOR-FOLDER
        print(shlex.join(flags(args[1], Path(args[2]))))
        return 0
    dest = Path(args[0] if args else "_build/vendor")
    write_template(dest)
    for name in PACKAGES:
        if fetch(dest, name):
            print(f"{dest / name}: {PACKAGES[name][0]} from npm")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
