"""labkit.checks.placement: the check names the wrong state, collective or number."""

import pytest

from labkit.checks.common import ExerciseError
from labkit.checks.placement import check_placement
from labkit.theory import PLACEMENTS, Placement

Z1 = PLACEMENTS["ZeRO-1"]
MEASURED = {"P": 400, "O": 204, "G": 400, "sent": 600}


def test_right_placement_and_bytes(capsys):
    assert check_placement("ZeRO-1", Placement("Replicated", "Sharded"),
                           dict(P=400, O=204, G=400, sent=601), Z1, MEASURED)
    assert "placement and bytes right" in capsys.readouterr().out


def test_bytes_held_must_match_to_the_byte():
    # 1% would forgive the 4-byte step counter; the memory ledger counts it
    with pytest.raises(ExerciseError, match=r"predicted 200 bytes of Optstate "
                       r"\(O\); the ledgers measured 204 \(-4 bytes: .*step counter"
                       r".*must match to the byte"):
        check_placement("ZeRO-1", Z1, dict(P=400, O=200, G=400, sent=600), Z1,
                        MEASURED)


def test_predicted_bytes_not_a_dict():
    with pytest.raises(ExerciseError, match=r"the placement is right; predict the "
                       r"bytes as a dict with keys P, O, G, sent, not 5"):
        check_placement("ZeRO-1", lambda: (Z1, 5), None, Z1, MEASURED)


def test_not_answered_yet(capsys):
    assert not check_placement("ZeRO-1", None, None, Z1, MEASURED)
    assert "not answered yet" in capsys.readouterr().out


def test_right_placement_without_bytes_asks_for_them(capsys):
    assert not check_placement("ZeRO-1", Z1, dict(P=None), Z1, MEASURED)
    assert "now predict P, O, G, sent" in capsys.readouterr().out


def test_not_a_placement():
    with pytest.raises(ExerciseError, match="expected a labkit.theory.Placement"):
        check_placement("ZeRO-1", "ZeRO-1", None, Z1, MEASURED)


def test_names_the_wrong_state():
    with pytest.raises(ExerciseError, match=r"G \(Gradient\) is Replicated in this "
                       r"strategy, not Sharded"):
        check_placement("ZeRO-1", PLACEMENTS["ZeRO-2"], None, Z1, MEASURED)


def test_names_the_wrong_collective():
    trap = Placement("Replicated", "Sharded", grad_sync="all_reduce")
    with pytest.raises(ExerciseError, match="synchronised by all_reduce in this "
                       "strategy, not by reduce_scatter"):
        check_placement("trap", Z1, None, trap, {"sent": 1})
    with pytest.raises(ExerciseError, match="parameters are synchronised by "
                       "all_gather in this strategy, not by nothing"):
        check_placement("ZeRO-1", Placement("Replicated", "Sharded",
                                            param_sync=None), None, Z1, MEASURED)


def test_names_the_wrong_number():
    with pytest.raises(ExerciseError, match=r"predicted 800 bytes of Optstate "
                       r"\(O\); the ledgers measured 204"):
        check_placement("ZeRO-1", Z1, dict(P=400, O=800, G=400, sent=600), Z1,
                        MEASURED)
    with pytest.raises(ExerciseError, match=r"predicted 900 bytes sent per step "
                       r"\(sent\); the ledgers measured 600 \(1.5×\); it must "
                       r"match within 1%"):
        check_placement("ZeRO-1", Z1, dict(P=400, O=204, G=400, sent=900), Z1,
                        MEASURED)
    with pytest.raises(ExerciseError, match="must be a number"):
        check_placement("ZeRO-1", Z1, dict(P="400", O=204, G=400, sent=600), Z1,
                        MEASURED)


# check_design: any placement that trains correctly, fits the budget and is
# predicted to the byte passes; a fake `run` stands in for the four ranks
PSI, UNIT = 1000, 10
Z2_CKPT = Placement("Replicated", "Sharded", "Sharded", "Materialized")
BYTES = {  # what a fake run "measures" per placement (O + 4: a step counter)
    Z2_CKPT: dict(P=4 * PSI, O=2 * PSI + 4, G=2 * PSI, A=4 * UNIT, sent=6000, pcie=0),
    PLACEMENTS["ZeRO-2"]: dict(P=4 * PSI, O=2 * PSI + 4, G=2 * PSI, A=7 * UNIT,
                               sent=6000, pcie=0),
    PLACEMENTS["ZeRO-Offload"]: dict(P=4 * PSI, O=0, G=2 * PSI, A=7 * UNIT,
                                     sent=6000, pcie=2 * PSI),
}
BUDGET = dict(device=8 * PSI + 5 * UNIT, sent=6000, pcie=0)


def fake_run(pl):
    if pl.P != "Replicated":
        raise ValueError("this chapter runs P Replicated only")
    return BYTES[pl]


def answer(pl, **changes):
    return lambda: (pl, {**BYTES.get(pl, BYTES[Z2_CKPT]), **changes})


def test_design_that_fits_and_is_predicted_passes(capsys):
    from labkit.checks.placement import check_design
    assert check_design("budget", answer(Z2_CKPT), BUDGET, fake_run)
    assert "fits (8,044 of 8,050 bytes on the device)" in capsys.readouterr().out


def test_design_over_the_budget_fails():
    from labkit.checks.placement import check_design
    with pytest.raises(ExerciseError, match=r"holds 8,074 bytes on the device \(P "
                       r"4,000, O 2,004, G 2,000, A 70\); the budget allows 8,050"):
        check_design("budget", answer(PLACEMENTS["ZeRO-2"]), BUDGET, fake_run)
    with pytest.raises(ExerciseError, match=r"moves 2,000 bytes over PCIe per "
                       r"step; the budget allows 0"):
        check_design("budget", answer(PLACEMENTS["ZeRO-Offload"]), BUDGET, fake_run)


def test_design_wrong_prediction_fails():
    from labkit.checks.placement import check_design
    with pytest.raises(ExerciseError, match=r"predicted 70 bytes of Activation "
                       r"\(A\); the ledgers measured 40 .*to the byte"):
        check_design("budget", answer(Z2_CKPT, A=7 * UNIT), BUDGET, fake_run)
    with pytest.raises(ExerciseError, match=r"predicted 2,000 bytes of Optstate "
                       r"\(O\); the ledgers measured 2,004 \(-4 bytes"):
        check_design("budget", answer(Z2_CKPT, O=2 * PSI), BUDGET, fake_run)


def test_design_that_trains_wrong_or_cannot_run_fails():
    from labkit.checks.placement import check_design
    no_gather = Placement("Replicated", "Sharded", "Sharded", "Materialized",
                          param_sync=None)
    with pytest.raises(ExerciseError, match="does not train what one process "
                       "trains: state consistency"):
        check_design("budget", answer(no_gather), BUDGET, fake_run)
    with pytest.raises(ExerciseError, match="P Replicated only"):
        check_design("budget", answer(PLACEMENTS["ZeRO-3"]), BUDGET, fake_run)
    with pytest.raises(ExerciseError, match=r"A \(Activation\) must be Replicated"):
        check_design("budget", answer(Z2_CKPT), BUDGET, fake_run,
                     fixed={"A": "Replicated"})
    with pytest.raises(ExerciseError, match="predict the bytes as a dict with keys "
                       "P, O, G, A, sent, pcie"):
        check_design("budget", lambda: (Z2_CKPT, dict(P=1)), BUDGET, fake_run)


def test_design_not_written_yet():
    from labkit.checks.placement import check_design

    def stub():
        raise NotImplementedError("exercise")
    assert not check_design("budget", stub, BUDGET, fake_run)
