"""`make newest` and `make test-torch` environments (labkit/cli/newest.py): an
upgrade takes every dependency to its newest allowed release but torch, which stays
at the release asked for (pyproject allows a range; PyPI's newest torch is a CUDA
build of several GB)."""

from labkit.cli import newest


def test_an_upgrade_keeps_torch_at_the_release_asked_for(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(newest, "_pip", lambda venv, *args: calls.append(args))
    newest._upgrade(tmp_path, "torch==2.14.1")
    (args,) = calls
    torches = [a for a in args if newest._name(a) == "torch"]
    assert torches == ["torch==2.14.1"], args
    assert "--upgrade" in args and any(newest._name(a) == "numpy" for a in args)


def test_a_requirements_name():
    assert newest._name("torch>=2.13,<2.15") == "torch"
    assert newest._name("jupyterlab-rise>=0.43") == "jupyterlab-rise"
    assert newest._name("nbval") == "nbval"
    assert newest._name("Cloudpickle[extra]>=3") == "cloudpickle"
