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
    with pytest.raises(ExerciseError, match=r"predicted 200 bytes of optimizer state "
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
    with pytest.raises(ExerciseError, match=r"G \(gradients\) is Replicated in this "
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
    with pytest.raises(ExerciseError, match=r"predicted 800 bytes of optimizer state "
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
