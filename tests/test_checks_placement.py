"""labkit.checks.placement (chapter 08): the checks name the wrong state,
collective, number or limit; check_design runs the student's placement on the
ranks, at the chapter's shape and two drawn each run, and fails the shortcuts:
numbers read off the chapter's runs, labkit's calculator, measuring instead of
predicting, NaN."""

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


def test_nan_is_no_prediction():
    with pytest.raises(ExerciseError, match=r"ZeRO-1: O: nan is not a number an "
                       r"answer can be"):
        check_placement("ZeRO-1", Z1, dict(P=400, O=float("nan"), G=400, sent=600),
                        Z1, MEASURED)


# check_design: any placement that trains correctly, fits the budget at the
# chapter's shape and is predicted right at it and at two shapes drawn each run
# passes; the check runs it on the ranks itself


def _no_host(width, rows, n):  # ZeRO-2 + checkpointing
    layer = width * width + width
    psi, unit = 4 * layer, rows * width * 4
    return (Placement("Replicated", "Sharded", "Sharded", "Materialized"),
            dict(P=4 * psi, O=8 * psi // n + 4, G=4 * psi // n + 4 * layer,
                 A=4 * unit, sent=2 * (n - 1) / n * 4 * psi, pcie=0))


def _no_recompute(width, rows, n):  # ZeRO-Offload
    layer = width * width + width
    psi, unit = 4 * layer, rows * width * 4
    return (Placement("Replicated", "Offloaded", "Sharded", "Replicated"),
            dict(P=4 * psi, O=0, G=4 * psi // n + 4 * layer, A=7 * unit,
                 sent=2 * (n - 1) / n * 4 * psi, pcie=(4 + 4) * psi // n))


def _changed(answer, **changes):
    """`answer` with some predictions replaced: a value, or a function of
    (width, rows, n, the right prediction)."""
    def fn(width, rows, n):
        pl, pred = answer(width, rows, n)
        return pl, {**pred, **{k: v(width, rows, n, pred[k]) if callable(v) else v
                               for k, v in changes.items()}}
    return fn


def _placed(pl, answer=_no_host):
    return lambda w, r, n: (pl, answer(w, r, n)[1])


NO_HOST = dict(device_mib=8.1, pcie=0)
NO_RECOMPUTE = dict(device_mib=6.2, fixed={"A": "Replicated"})


def _todo(width, rows, n):
    raise NotImplementedError("exercise")


def test_right_designs_pass_and_the_line_says_what_was_measured(cluster, capsys):
    from labkit.checks.placement import check_design

    assert not check_design("no host", cluster, _todo, **NO_HOST)
    assert "not written yet" in capsys.readouterr().out
    assert check_design("no host", cluster, _no_host, **NO_HOST)
    out = capsys.readouterr().out
    assert ("no host: fits (8,470,532 of 8,493,466 bytes on the device at width "
            "512), and every byte you predicted is what the ledgers measured, there "
            "and at widths") in out
    assert ("at width 512: P 4,202,496, O 2,101,252, G 2,101,248, A 65,536, sent "
            "6,303,744, pcie 0") in out
    assert check_design("no recompute", cluster, _no_recompute, **NO_RECOMPUTE)
    assert "pcie 2,101,248" in capsys.readouterr().out


@pytest.mark.parametrize("answer, kw, message", [
    (_placed(Placement("Replicated", "Sharded", "Sharded")), NO_HOST,
     r"measured on the ranks, your placement holds 8,519,684 bytes on the device "
     r"\(P 4,202,496, O 2,101,252, G 2,101,248, A 114,688\); the budget allows "
     r"8,493,466 \(8.1 MiB\): which state could live elsewhere\?"),
    (_no_recompute, NO_HOST, r"your placement moves 2,101,248 bytes over PCIe per "
                             r"step; the budget allows 0"),
    (_placed(Placement("Replicated", "Offloaded", "Replicated"), _no_recompute),
     NO_RECOMPUTE, r"holds 8,519,680 bytes on the device"),
    (_no_host, NO_RECOMPUTE, r"A \(Activation\) must be Replicated here, not "
                             r"Materialized"),
    (_placed(Placement("Replicated", "Sharded", "Sharded", "Materialized",
                       param_sync=None)), NO_HOST,
     r"does not train what one process trains: state consistency"),
    (_placed(Placement("ShardedWithGather", "Sharded", "Sharded")), NO_HOST,
     r"this chapter cannot run P ShardedWithGather, O Sharded, G Sharded, A "
     r"Replicated"),
])
def test_designs_that_do_not_fit_or_cannot_run_fail(cluster, answer, kw, message):
    from labkit.checks.placement import check_design

    with pytest.raises(ExerciseError, match=message):
        check_design("budget", cluster, answer, **kw)


@pytest.mark.parametrize("answer, message", [
    (_changed(_no_host, A=lambda w, r, n, a: 7 * r * w * 4),
     r"width 512, 8 rows a rank: you predicted 114,688 bytes of Activation \(A\); "
     r"the ledgers measured 65,536; checkpointing per layer keeps the 4 layer "
     r"outputs"),
    (_changed(_no_host, O=lambda w, r, n, o: o - 4),
     r"predicted 2,101,248 bytes of Optstate \(O\); the ledgers measured "
     r"2,101,252; count every small tensor too \(a step counter is 4 bytes\)"),
    (_changed(_no_host, G=lambda w, r, n, g: g - 4 * (w * w + w)),
     r"bytes of Gradient \(G\); the ledgers measured 2,101,248; the gradient "
     r"bucket in flight"),
    (_changed(_no_host, O=lambda w, r, n, o: 12 * 4 * (w * w + w) // n),
     r"fp32 Adam keeps m and v, 8 bytes a parameter"),
    (_changed(_no_host, sent=lambda w, r, n, s: s / 2),
     r"bytes sent per step \(sent\); the ledgers measured 6,303,744; a "
     r"reduce-scatter and an all-gather"),
    (_changed(_no_recompute, pcie=lambda w, r, n, p: p / 2),
     r"bytes over PCIe per step \(pcie\); the ledgers measured 2,101,248; the "
     r"gradient slice goes down"),
    (_changed(_no_host, P=float("nan")), r"width 512, 8 rows a rank: P: nan is not "
                                         r"a number an answer can be"),
    (_changed(_no_host, pcie=float("inf")), r"pcie: inf is not a number"),
    (_changed(_no_host, P="4 MiB"), r"P must be a number of bytes, got '4 MiB'"),
    (lambda w, r, n: (_no_host(w, r, n)[0], dict(P=1)),
     r"predict the bytes as a dict with keys P, O, G, A, sent, pcie"),
    (lambda w, r, n: _no_host(w, r, n)[0],
     r"return a pair \(Placement\(...\), dict of predicted bytes\)"),
])
def test_wrong_predictions_are_named(cluster, answer, message):
    from labkit.checks.placement import check_design

    kw = NO_RECOMPUTE if "PCIe" in message else NO_HOST
    with pytest.raises(ExerciseError, match=message):
        check_design("budget", cluster, answer, **kw)


def test_numbers_read_off_the_chapters_runs_fail_the_next_shape(cluster):
    """The chapter measured ZeRO-2 and ZeRO-2 + offload + checkpointing at width
    512: their bytes, written down, are right there and nowhere else."""
    from labkit.checks.placement import check_design

    def written_down(width, rows, n):
        return _no_host(512, 8, 4)

    with pytest.raises(ExerciseError, match=r"width \d+, \d+ rows a rank: you "
                       r"predicted 4,202,496 bytes of Parameter \(P\); the ledgers "
                       r"measured [\d,]+; that is the P measured at width 512: the "
                       r"prediction must follow width, rows and n"):
        check_design("budget", cluster, written_down, **NO_HOST)


def test_the_design_may_not_change_with_the_shape(cluster):
    from labkit.checks.placement import check_design

    def zero2_elsewhere(width, rows, n):
        pl, pred = _no_host(width, rows, n)
        return (pl if width == 512 else Placement("Replicated", "Sharded",
                                                  "Sharded"), pred)

    with pytest.raises(ExerciseError, match=r"at width \d+, \d+ rows your design is "
                       r".*the budget picks one design"):
        check_design("budget", cluster, zero2_elsewhere, **NO_HOST)


def test_the_calculator_and_measuring_are_refused(cluster):
    from labkit.checks.placement import check_design

    def calculator(width, rows, n):
        pl, pred = _no_host(width, rows, n)
        pl.cost(4 * (width * width + width), n, k=8, param_bytes=4, grad_bytes=4)
        return pl, pred

    def measures(width, rows, n):
        from labkit.checks.placement import _measure

        pl, _ = _no_host(width, rows, n)
        got = cluster.run(_measure, ("Replicated", "Sharded", "Sharded",
                                     "Materialized"), "reduce_scatter", width, rows)
        return pl, got[0]

    with pytest.raises(ExerciseError, match=r"width 512, 8 rows a rank: your answer "
                       r"calls labkit.theory.placement.Placement.cost, labkit's own "
                       r"calculator"):
        check_design("budget", cluster, calculator, **NO_HOST)
    with pytest.raises(ExerciseError, match=r"your answer calls labkit.runtime."
                       r"cluster.Cluster.run, labkit's own runner or ledgers \(a "
                       r"prediction is computed before anything runs"):
        check_design("budget", cluster, measures, **NO_HOST)
