"""The memory ledger reads PyTorch's private MemTracker: on a torch outside the
releases it was tested with, it says so once, naming what may differ."""

import warnings

import pytest
import torch

from labkit.ledger import _torch_memtracker as mt


@pytest.mark.parametrize("version, warns", [
    ("2.13.0", False), ("2.13.0+cpu", False), ("2.14.1+cu130", False),
    ("2.12.1", True), ("2.15.0", True)])
def test_a_torch_outside_the_tested_releases_is_told_once(version, warns,
                                                          monkeypatch):
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(mt, "_WARNED", [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mt.check_torch_version()
        mt.check_torch_version()  # a second ledger: nothing more said
    said = [str(w.message) for w in caught]
    assert len(said) == int(warns), said
    if warns:
        assert f"this is torch {version}" in said[0] and "2.13 and 2.14" in said[0]
        assert "by category" in said[0] and "traffic ledger" in said[0]
