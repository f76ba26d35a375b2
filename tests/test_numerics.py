"""labkit.numerics: errors measured over whole models, bounds from the run's own
one-process rounding, messages that say what was compared."""

import json

import pytest
import torch

from labkit import numerics
from labkit.numerics import Oracle, rel_err


def test_rel_err_is_norm_wise_over_everything_together():
    f64 = dict(dtype=torch.float64)
    want = {"a": torch.tensor([3.0, 0.0], **f64), "b": torch.tensor([[4.0]])}
    got = {"a": torch.tensor([3.0, 1e-3], **f64), "b": torch.tensor([[4.0]])}
    # ||(0, 1e-3, 0)|| / ||(3, 0, 4)|| = 1e-3 / 5
    assert rel_err(got, want) == pytest.approx(2e-4, rel=1e-12)
    assert rel_err([torch.ones(2), 2.0], [torch.ones(2), 2.0]) == 0.0
    assert rel_err(torch.zeros(2), torch.zeros(2)) == 0.0
    assert rel_err(torch.tensor([1.0, 2.0]), [1.0, 2.0]) == 0.0  # losses, two ways
    assert rel_err(torch.ones(2), torch.zeros(2)) == float("inf")


def test_rel_err_is_computed_in_float64():
    # 1 + 2^-30 is 1 in float32; kept in float64, the difference is seen
    want = torch.ones(4, dtype=torch.float64)
    got = want + 2.0 ** -30
    assert rel_err(got, want) == pytest.approx(2.0 ** -30, rel=1e-9)


@pytest.mark.parametrize("got, want, message", [
    ({"a": torch.ones(2)}, {"a": torch.ones(2), "b": torch.ones(1)},
     r"missing \['b'\]"),
    (torch.ones(3), torch.ones(2), r"shape \(3,\) compared with \(2,\)"),
    ([torch.ones(1)], [torch.ones(1)] * 2, "1 items compared with 2"),
    ([torch.ones(1)], {"a": torch.ones(1)}, "a list compared with a dict"),
    (torch.ones(3), [1.0, 2.0], "3 values compared with 2"),
])
def test_rel_err_refuses_what_does_not_line_up(got, want, message):
    with pytest.raises(ValueError, match=message):
        rel_err(got, want)


def _oracle():
    # runs given in float64, so that their errors are exactly 0 and 2e-7
    exact = torch.linspace(1, 2, 100, dtype=torch.float64)
    return exact, Oracle(exact, {"whole": exact.clone(), "parts": exact * (1 + 2e-7)})


def test_the_allowance_is_factor_times_the_largest_one_process_error():
    exact, oracle = _oracle()
    assert oracle.errors == {"whole": 0.0, "parts": pytest.approx(2e-7, rel=1e-6)}
    assert oracle.allowed == numerics.FACTOR * oracle.errors["parts"]
    assert "allowed 4 x the larger" in str(oracle)


def test_one_unit_of_rounding_is_the_floor():
    exact = torch.ones(5, dtype=torch.float64)
    oracle = Oracle(exact, {"exact too": exact.float()})  # 1.0 is exact in fp32
    assert oracle.scale == 2.0 ** -24 and oracle.allowed == 4 * 2.0 ** -24
    assert "one unit of rounding" in str(oracle)
    bf16 = Oracle(exact, {"exact too": exact.bfloat16()}, dtype=torch.bfloat16)
    assert bf16.scale == 2.0 ** -8


def test_check_passes_within_and_says_everything_when_not():
    exact, oracle = _oracle()
    ok = oracle.check(exact * (1 + 5e-7), "rank 1's weights")
    assert ok.ok and 0 < ok.margin < 1
    assert str(ok).startswith("rank 1's weights: 5.0e-07 from float64 (allowed")
    with pytest.raises(AssertionError) as err:
        oracle.check(exact * (1 + 1e-5), "rank 2's weights")
    msg = str(err.value)
    assert msg.startswith("rank 2's weights: 1.0e-05 from the float64 reference, "
                          "more than the 8.0e-07 allowed (4 x the largest error of "
                          "one process in float32: whole 0.0e+00, parts 2.0e-07)")


def test_resolves_refuses_a_comparison_that_could_not_fail():
    exact, oracle = _oracle()
    assert oracle.resolves(exact * 1.01, "untrained") == pytest.approx(0.01)
    with pytest.raises(AssertionError, match="could not tell a wrong result"):
        oracle.resolves(exact * (1 + 1e-5), "barely moved")


def test_an_oracle_needs_a_one_process_run():
    with pytest.raises(ValueError, match="at least one one-process run"):
        Oracle(torch.ones(1), {})


def test_margins_are_recorded_where_asked(tmp_path, monkeypatch):
    log = tmp_path / "m.jsonl"
    monkeypatch.setenv("LABKIT_MARGINS", str(log))
    exact, oracle = _oracle()
    oracle.compare(exact * (1 + 4e-7), "half the allowance")
    (row,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert row["where"] == "tests/test_numerics.py"
    assert row["what"] == "half the allowance"
    assert row["margin"] == pytest.approx(0.5, rel=1e-6)
