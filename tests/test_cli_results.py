"""python -m labkit results: a torchrun run's rank files merged and summarized;
a file it cannot read is named, with its own exit status (3), apart from a rank
that failed (1) and files missing or stale (2)."""

import subprocess
import sys

import pytest

from labkit.runtime.results_io import ResultsError, load_results, save_rank_result


def _results(*args):
    return subprocess.run([sys.executable, "-m", "labkit", "results", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("damage", ["truncated", "not a zip"])
def test_a_damaged_rank_file_is_named_with_its_own_exit_status(tmp_path, damage):
    for r in range(2):
        save_rank_result(tmp_path, r, 2, {"rank": r}, run_id="run1")
    path = tmp_path / "rank1.pt"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2] if damage == "truncated" else b"junk")
    with pytest.raises(ResultsError, match="rank1.pt cannot be read") as e:
        load_results(tmp_path)
    assert e.value.kind == "unreadable", e.value.kind
    cmd = _results(str(tmp_path))
    assert cmd.returncode == 3, (cmd.returncode, cmd.stdout + cmd.stderr)
    assert f"{path} cannot be read" in cmd.stdout, cmd.stdout + cmd.stderr
    assert "Traceback" not in cmd.stderr, cmd.stderr


def test_exit_statuses_tell_a_failed_rank_from_missing_files(tmp_path):
    save_rank_result(tmp_path, 0, 2, 1.0, run_id="r")
    save_rank_result(tmp_path, 1, 2, error=ValueError("no"), run_id="r")
    assert _results(str(tmp_path)).returncode == 1
    assert _results(str(tmp_path / "nothing")).returncode == 2
    (tmp_path / "rank1.pt").unlink()
    assert _results(str(tmp_path)).returncode == 2
    help_text = _results("--help").stdout
    assert all(f"{code}:" in help_text for code in (0, 1, 2, 3)), help_text
