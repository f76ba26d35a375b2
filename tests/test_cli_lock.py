"""The lock file: written from an environment, read back, compared."""

import pytest
import torch

from labkit.cli import lock


def test_write_then_read_pins_every_installed_package(tmp_path):
    path = tmp_path / "requirements.lock"
    assert lock.write(path) == 0
    pins = lock.read(path)
    assert pins == lock.installed()
    assert "labkit" not in pins and "setuptools" not in pins
    # the build's label (+cpu, +cu130) is dropped: a pin names the release
    assert pins["torch"] == torch.__version__.split("+")[0], pins["torch"]
    assert path.read_text().startswith("# Every package")


def test_read_refuses_what_is_not_a_pin(tmp_path):
    path = tmp_path / "bad.lock"
    path.write_text("# a comment\nnumpy==2.0.0\ncloudpickle>=3.0\n")
    with pytest.raises(ValueError, match=r"not a pin \(name==version\): "
                                         r"'cloudpickle>=3.0'"):
        lock.read(path)


def test_diff_names_what_changed_since_the_lock(tmp_path, capsys, monkeypatch):
    path = tmp_path / "requirements.lock"
    path.write_text("numpy==1.0.0\nOld_Name==2\n")
    monkeypatch.setattr(lock, "installed", lambda: {"numpy": "2.4.6", "old-name": "2",
                                                    "tqdm": "4.70.1"})
    assert lock.diff(path) == 0
    out = capsys.readouterr().out
    assert "numpy 1.0.0 -> 2.4.6" in out and "tqdm 4.70.1 (not in the lock)" in out
    assert "old-name" not in out


def test_installed_is_what_an_import_finds_not_a_vendored_copy():
    # setuptools, once imported (nbgrader imports it), appends setuptools/_vendor
    # to sys.path, with its own older zipp, packaging, platformdirs and
    # importlib_metadata: the copies an import finds come first
    import importlib.metadata as md

    import setuptools  # noqa: F401

    have = lock.installed()
    for name in ("zipp", "packaging", "platformdirs", "importlib-metadata"):
        if name in have:
            assert have[name] == md.version(name).split("+")[0], (
                f"{name}: installed() says {have[name]}, an import finds "
                f"{md.version(name)}")
