"""`make test`'s step timer: each step run in order, the first failure stops the
run with its exit status, and the table shows each step beside the last run's."""

from __future__ import annotations

import json
import stat

import pytest

from labkit.cli import steps

# a stand-in for make: `fake STEP` sleeps a little, and step "bad" exits 3
FAKE = """#!/bin/sh
shift  # --no-print-directory
echo "$1" >> "{log}"
sleep 0.05
[ "$1" = bad ] && exit 3
exit 0
"""


@pytest.fixture
def fake_make(tmp_path):
    log = tmp_path / "ran.txt"
    path = tmp_path / "make"
    path.write_text(FAKE.format(log=log))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path), log


@pytest.mark.ranks  # starts processes (the fake make), as conftest.py's mark means
def test_steps_run_in_order_and_times_are_kept_for_the_next_run(
        fake_make, tmp_path, capsys):
    make, log = fake_make
    times = tmp_path / "times.json"
    assert steps.run_steps(["lint", "test-lib"], "make test", make, times) == 0
    assert log.read_text().split() == ["lint", "test-lib"]
    first = json.loads(times.read_text())
    assert set(first) == {"lint", "test-lib"} and all(
        0.04 < t < 30 for t in first.values()), first
    out = capsys.readouterr().out
    assert "make test: each step's time" in out and "of its 10:00 budget" in out
    # the second run shows the first's times and the change
    times.write_text(json.dumps({"lint": 100.0, "test-lib": 200.0}))
    steps.run_steps(["lint", "test-lib"], "make test", make, times)
    out = capsys.readouterr().out
    assert "1:40" in out and "3:20" in out and "-100 s" in out and "-200 s" in out, out


@pytest.mark.ranks
def test_the_first_failing_step_stops_the_run_and_says_so(fake_make, tmp_path,
                                                          capsys):
    make, log = fake_make
    times = tmp_path / "times.json"
    assert steps.run_steps(["lint", "bad", "test-lib"], "make test", make,
                           times) == 3
    assert log.read_text().split() == ["lint", "bad"]
    out = capsys.readouterr().out
    assert "bad  (failed)" in out and "budget" not in out, out
    assert not times.exists()  # a failed run's times are not the next run's baseline


def test_a_run_over_budget_says_by_how_much(fake_make, tmp_path, monkeypatch):
    monkeypatch.setitem(steps.BUDGET, "make test", 0.01)
    text = steps.table({"lint": 30.0, "test-lib": 700.0}, {}, None, "make test")
    assert "12:10 of its 0.0 s budget: 12:10 over" in text, text
    assert "since the last run" not in text, text  # there was none
    text = steps.table({"lint": 0.4}, {"lint": 0.3}, None, "make test")
    assert "0.4 s" in text and "0.3 s" in text and "since the last run" in text, text
