"""labkit.checks.failures_hangs (chapter 13's exercise 3, the hung rank): the
check passes a right answer on the dumps it draws and on a real hang's, says "not
written yet" for a stub, names the usual slips, and fails every shortcut:
labkit's find_mismatch or the check's reference, a rule that reads one group
only, answers written down, NaN. Its reference is held to find_mismatch and to
the flight recorders of a real hang on the ranks."""

import pytest

from labkit.checks import failures_hangs
from labkit.checks.common import ExerciseError
from labkit.checks.failures_hangs import check_hung
from labkit.runtime import find_mismatch


def _stub(*args):
    raise NotImplementedError("exercise")


# ------------------------------------------------------------------ my_hung


def _op(log, seq):
    return next(((e.op, e.sizes, e.dtypes) for e in log.last if e.seq == seq),
                None)


def _hung(records):  # the notebook's solution
    for gid in {g for rec in records.values() if rec for g in rec}:
        logs = {r: rec[gid] for r, rec in records.items() if rec and gid in rec}
        for r, mine in logs.items():
            others = [log for q, log in logs.items() if q != r]
            top = min((log.entered for log in others), default=0)
            seq = min(mine.entered + 1, top)
            theirs = {_op(log, seq) for log in others}
            if seq and len(theirs) == 1 and (mine.entered < seq
                                             or _op(mine, seq) not in theirs):
                return r, gid, seq


def _fewest_in_default(records):  # section 2's reading, as a rule
    counts = {r: rec["0"].entered for r, rec in records.items() if "0" in rec}
    r = min(counts, key=lambda q: (counts[q], q))
    return r, "0", counts[r] + 1


def _fewest_anywhere(records):  # the fewest entries in any group
    r, g, n = min(((r, g, log.entered) for r, rec in records.items()
                   for g, log in rec.items()), key=lambda x: (x[2], x[0]))
    return r, g, n + 1


def _counts_only(records):  # who entered fewer, never what
    for gid in sorted({g for rec in records.values() for g in rec}):
        logs = {r: rec[gid] for r, rec in records.items() if gid in rec}
        top = max(log.entered for log in logs.values())
        for r, log in sorted(logs.items()):
            others = [o for q, o in logs.items() if q != r]
            if log.entered < top and all(o.entered == top for o in others):
                return r, gid, log.entered + 1
    return 0, "0", 1


def _last_entered(records):  # the right rank and group, the last it entered
    r, g, s = _hung(records)
    return r, g, records[r][g].entered


def _a_waiting_rank(records):  # a rank stuck inside the collective
    r, g, s = _hung(records)
    return next(q for q, rec in records.items() if q != r and g in rec), g, s


def test_hung_right_answer_passes_on_drawn_dumps_and_a_real_hang(cluster, capsys):
    assert check_hung(cluster, _hung)
    out = capsys.readouterr().out
    assert "correct: you found the hung rank in 5 dumps drawn this run and in a " \
           "real hang's" in out, out


def test_hung_stub_is_not_written_yet(cluster, capsys):
    assert not check_hung(cluster, _stub)
    assert "not written yet" in capsys.readouterr().out


def test_hung_real_hang_is_what_the_plan_ran(cluster):
    # the flight recorders of a real hang against the check's simulation of
    # the same program: every rank's collectives entered, group by group
    plan = failures_hangs._hang_plan(12345, cluster.world_size)
    records, want, _ = failures_hangs._real_hang(cluster, 12345)
    members = plan["members"]
    ids = {"world": "0", "outer": "1", "inner": "2"}  # fresh ranks: in order
    groups = {ids[k]: tuple(v) for k, v in members.items()}
    program = [(ids[g], (op, ((n,),) if op != "barrier" else (),
                         ("Float",) if op != "barrier" else ()))
               for g, op, n in plan["program"]]
    sim = failures_hangs._simulate(cluster.world_size, groups, program, plan["skip"],
                             plan["skipper"], ahead=False)
    got = {r: {g: log.entered for g, log in rec.items()}
           for r, rec in records.items()}
    assert got == {r: {g: log.entered for g, log in rec.items()}
                   for r, rec in sim.items()}, (got, plan)
    assert failures_hangs._missed(sim) == [want], (failures_hangs._missed(sim), want)


@pytest.mark.parametrize("seed", range(40))
def test_hung_reference_agrees_with_find_mismatch(seed):
    # labkit's find_mismatch says every disagreement; the check's one answer
    # is among them: the rank that did not enter, or the op that differs
    for records, (r, gid, seq), what in failures_hangs._dump_cases(seed):
        said = find_mismatch(records)
        name = records[r][gid].name
        if "stopped" in what:
            assert any(s.startswith(f"rank {r} did not enter ") and f" #{seq} " in
                       s and f"of the {name}," in s for s in said), (said, r, gid)
        else:
            assert any(s.startswith(f"collective #{seq} of the {name} differs")
                       for s in said), (said, r, gid, seq)
        assert _hung(records) == (r, gid, seq), (seed, what)


def test_hung_dumps_are_drawn_fresh_and_defeat_one_group_rules():
    for seed in range(60):
        cases = failures_hangs._dump_cases(seed)
        wants = [w for _, w, _ in cases]
        assert sum(g != "0" for _, g, _ in wants) >= 2, wants
        assert sum("went on" in what for *_, what in cases) >= 2
        for rule in (_fewest_in_default, _fewest_anywhere, _counts_only):
            assert any(rule(rec) != want for rec, want, _ in cases), (seed, rule)
    assert len({str([w for _, w, _ in failures_hangs._dump_cases(s)])
                for s in range(30)}) == 30


@pytest.mark.parametrize("answer, hint", [
    (_fewest_in_default, "the rank with the fewest collectives in the default "
                         "group"),
    (_fewest_anywhere, "Hint:"),
    (_counts_only, "Hint:"),
    (_last_entered, "Hint:"),
    (_a_waiting_rank, "the ranks stuck in a collective are the healthy ones"),
    (lambda records: (2, "0", 4), "Hint:"),  # section 2's answer, written down
    (lambda records: None, "return (rank, group id, seq)"),
    (lambda records: (float("nan"), "0", 1), "whole numbers"),
])
def test_hung_shortcuts_fail_on_the_drawn_dumps(cluster, answer, hint):
    with pytest.raises(ExerciseError, match="my_hung") as e:
        check_hung(cluster, answer)
    assert hint in str(e.value), str(e.value)


def test_hung_slips_are_named():
    # each hint, on a dump drawn to show it
    for seed in range(20):
        for records, want, what in failures_hangs._dump_cases(seed):
            r, g, s = want
            if "stopped" in what:
                hint = failures_hangs._hung_hint(records, (r, g, s - 1), want)
                assert "is the last collective rank" in hint, hint
            else:
                hint = failures_hangs._hung_hint(records, (r, g, s + 1), want)
                assert "but under #" in hint and "another op" in hint, hint
            if g != "0":
                other = failures_hangs._hung_hint(records, (r, "0", s), want)
                assert ("in another group" in other or "fewest" in other), other


def test_hung_labkits_find_mismatch_is_refused(cluster):
    def told(records):
        find_mismatch(records)
        return _hung(records)

    with pytest.raises(ExerciseError, match=r"calls labkit.runtime.flight."
                                            r"find_mismatch, labkit's own"):
        check_hung(cluster, told)
    with pytest.raises(ExerciseError, match=r"failures_hangs._missed"):
        check_hung(cluster, lambda rec: failures_hangs._missed(rec)[0])
