"""A function shipped to the ranks keeps the name of the file (the notebook cell)
it came from, with the oldest and the newest cloudpickle that pyproject allows:
cloudpickle 3.1.3 renamed every shipped code object "<dynamic-code>", and a rank's
traceback then lost the student's line."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "_build" / "cloudpickle"

# A notebook cell as ipykernel compiles it: a file name that exists nowhere but in
# the kernel's linecache, a helper, a class and a closure reached from the worker.
CELL = "/tmp/ipykernel_4242/1234567.py"
SOURCE = '''\
class Shard:
    def check(self, rank):
        raise ValueError(f"rank {rank} is wrong")


def helper(rank):
    return Shard().check(rank)


def worker(rank, world_size):
    inner = lambda: helper(rank)
    return inner()
'''

# dumps with labkit's pickler, in one process ...
DUMP = f'''
import sys
from labkit.runtime.call import _dumps
ns = {{"__name__": "__main__"}}
exec(compile({SOURCE!r}, {CELL!r}, "exec"), ns)
sys.stdout.buffer.write(_dumps(ns["worker"]))
'''
# ... loads and calls in another, as a rank does, and prints where each frame was
LOAD = '''
import sys, traceback, cloudpickle
fn = cloudpickle.loads(sys.stdin.buffer.read())
try:
    fn(3, 4)
except ValueError as e:
    for f in traceback.extract_tb(e.__traceback__)[1:]:
        print(f"{f.filename}|{f.lineno}|{f.name}")
print("cloudpickle", cloudpickle.__version__)
'''


def _allowed_spec() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    spec = next(d for d in deps["dependencies"] if d.startswith("cloudpickle"))
    return spec.removeprefix("cloudpickle")


def _oldest() -> str:
    m = re.search(r">=\s*([0-9.]+)", _allowed_spec())
    assert m, f"pyproject's cloudpickle range {_allowed_spec()!r} has no lower bound"
    return "==" + m.group(1)


def _install(spec: str) -> Path:
    """cloudpickle{spec} in a folder of its own (cached under _build/)."""
    where = CACHE / re.sub(r"[^0-9A-Za-z.]+", "_", spec).strip("_")
    if not (where / "cloudpickle").is_dir():
        res = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
             "--target", str(where), "--upgrade", f"cloudpickle{spec}"],
            capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            reason = f"cannot install cloudpickle{spec}: {res.stderr.strip()[-300:]}"
            if os.environ.get("CI"):
                pytest.fail(reason)
            pytest.skip(reason)
    return where


def _frames(path: Path | None) -> tuple[list[tuple[str, int, str]], str]:
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), str(ROOT)])
    run = lambda code, data=None: subprocess.run(
        [sys.executable, "-c", code], input=data, env=env, capture_output=True,
        check=True, timeout=120, cwd=ROOT)
    out = run(LOAD, run(DUMP).stdout).stdout.decode().splitlines()
    frames = [(f, int(n), name) for f, n, name in (ln.split("|") for ln in out[:-1])]
    return frames, out[-1]


@pytest.mark.parametrize("which", ["installed", "oldest allowed", "newest allowed"])
def test_shipped_code_keeps_the_cells_file_name(which):
    path = {"installed": lambda: None,
            "oldest allowed": lambda: _install(_oldest()),
            "newest allowed": lambda: _install(_allowed_spec())}[which]()
    frames, version = _frames(path)
    # worker (line 12), its lambda (11), helper (7), Shard.check (3): every frame
    # is the cell's, with its own line, whichever cloudpickle shipped it
    assert frames == [(CELL, 12, "worker"), (CELL, 11, "<lambda>"),
                      (CELL, 7, "helper"), (CELL, 3, "check")], (version, frames)
    if which == "oldest allowed":  # 3.0 and 3.0.0 are one version
        want = [int(x) for x in _oldest().removeprefix("==").split(".")]
        got = [int(x) for x in version.split()[-1].split(".")]
        assert got + [0] * (len(want) - len(got)) == want + [0] * (len(got) - len(
            want)), f"meant to test cloudpickle {want}, ran {version}"
