"""labkit.checks.failures (chapter 13): each check passes a right answer on the
cases it draws, says "not written yet" for a stub, names the usual slips, and
fails every shortcut: labkit's own function (theory's closed forms,
diloco_traffic, find_mismatch, save_train_state) or the check's reference,
answers written down, a rule that reads one group only, grading switched off,
NaN. Its references are held to labkit.theory, the traffic ledger, find_mismatch
and a real hang on the ranks."""

import math
import os
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from labkit import theory
from labkit.checks import failures, grading
from labkit.checks.common import ExerciseError, NotAnswered
from labkit.checks.failures import (
    check_diloco_bytes,
    check_hung,
    check_interval,
    check_resume,
)
from labkit.runtime import find_mismatch


def _stub(*args):
    raise NotImplementedError("exercise")


# ------------------------------------------------------------- my_interval


def _interval(c, gpus, gpu_mtbf_h):
    return math.sqrt(2 * c * gpu_mtbf_h * 3600 / gpus)


def test_interval_right_answer_passes(capsys):
    for _ in range(3):
        assert check_interval(_interval)
    assert ("correct: Young's interval for Llama 3's cluster (a one-minute save: "
            "every 19.3 min) and for 6 clusters drawn this run"
            ) in capsys.readouterr().out


def test_interval_stub_is_not_written_yet(capsys):
    assert not check_interval(_stub)
    assert "not written yet" in capsys.readouterr().out


def test_interval_reference_is_theorys_on_every_draw():
    # theory's young_interval and job_mtbf are held to Young (1974) and to
    # Llama 3's published counts in tests/test_theory_failures.py
    for seed in range(30):
        for c, n, m in failures._interval_cases(seed):
            want = theory.young_interval(c, theory.job_mtbf(m * theory.HOUR, n))
            assert failures._young(c, n, m) == pytest.approx(want, rel=1e-12), (
                seed, c, n, m)


def test_interval_llama3_case_is_the_published_count():
    # Llama 3 (arXiv 2407.21783) sec. 3.3.4: 419 unexpected stops in 54 days
    c, n, m = failures._LLAMA3
    job = m * theory.HOUR / n
    assert job == pytest.approx(54 * theory.DAY / 419, rel=1e-12), job
    assert job == pytest.approx(theory.LLAMA3_FAILURES.job_mtbf, rel=1e-12)
    assert (c, n) == (60.0, 16_384)


def test_interval_cases_are_drawn_fresh():
    drawn = [failures._interval_cases(s) for s in range(30)]
    assert len({str(d[1:]) for d in drawn}) == 30
    assert all(d[0] == failures._LLAMA3 and len(d) == 7 for d in drawn)


def _scaled(f):
    return lambda c, n, m: f(c, n, m, _interval(c, n, m))


def _daly(c, n, m):
    job = m * 3600 / n
    xi = c / (2 * job)
    return math.sqrt(2 * c * job) * (1 + math.sqrt(xi) / 3 + xi / 9) - c


@pytest.mark.parametrize("answer, hint", [
    (lambda c, n, m: math.sqrt(2 * c * m * 3600), "that uses one GPU's MTBF"),
    (lambda c, n, m: math.sqrt(2 * c * m * 3600 * n), "the GPUs multiply the "
                                                      "failures"),
    (lambda c, n, m: math.sqrt(2 * c * m / n), "convert the MTBF to seconds"),
    (lambda c, n, m: math.sqrt(2 * c * m * 60 / n), "an hour is 3600 s"),
    (lambda c, n, m: math.sqrt(c * m * 3600 / n), "the 2 is there because"),
    (_scaled(lambda c, n, m, t: t / 60), "that is in minutes"),
    (_scaled(lambda c, n, m, t: t / 3600), "that is in hours"),
    (lambda c, n, m: 2 * c * m * 3600 / n, "take the square root"),
    (_daly, "that is Daly's higher-order interval"),
    (lambda c, n, m: float("nan"), "not a number an answer can be"),
    (lambda c, n, m: "19 min", "return a number"),
    (lambda c, n, m: (1.0, 2.0), "return a number"),
    # the chapter's Llama 3 case, written down: the draws fail it
    (lambda c, n, m: _interval(60.0, 16_384, failures._LLAMA3[2]), "Hint:"),
])
def test_interval_slips_and_written_down_answers_are_named(answer, hint):
    with pytest.raises(ExerciseError, match="my_interval") as e:
        check_interval(answer)
    assert hint in str(e.value), str(e.value)


def test_interval_labkits_closed_forms_are_refused():
    def young(c, n, m):
        return theory.young_interval(c, m * 3600 / n)

    def job(c, n, m):
        return math.sqrt(2 * c * theory.job_mtbf(m * 3600, n))

    for answer, name in ((young, "young_interval"), (job, "job_mtbf"),
                         (failures._young, "failures._young")):
        with pytest.raises(ExerciseError, match=rf"calls labkit.*{name}, labkit's "
                                                r"own closed forms"):
            check_interval(answer)


def test_interval_exception_is_reported_not_raised():
    with pytest.raises(ExerciseError, match="raised ZeroDivisionError"):
        check_interval(lambda c, n, m: 1 / 0)


# ---------------------------------------------------------- my_diloco_bytes


def _diloco(params, n, h, f):
    full = 2 * (n - 1) / n * 4 * params
    return full / h, full / f


def test_diloco_right_answer_passes_and_says_what_was_measured(cluster, capsys):
    for _ in range(2):
        assert check_diloco_bytes(cluster, _diloco)
    out = capsys.readouterr().out
    assert ("correct: your bytes are what every rank's traffic ledger measured in "
            "the outer all-reduces of two DiLoCo runs on 4 ranks") in out, out


def test_diloco_stub_is_not_written_yet(cluster, capsys):
    assert not check_diloco_bytes(cluster, _stub)
    assert "not written yet" in capsys.readouterr().out


def test_diloco_reference_is_theorys():
    for seed in range(30):
        measured, computed = failures._diloco_cases(seed)
        settings = computed + [(failures._params(c), 4, c["h"], c["f"])
                               for c in measured]
        for params, n, h, f in settings:
            t = theory.diloco_traffic(4 * params, n, h, f)
            avg, peak = failures._diloco_exact(params, n, h, f)
            assert (float(avg), float(peak)) == pytest.approx(
                (t.average, t.peak), rel=1e-12), (params, n, h, f)


def test_diloco_cases_tell_the_slips_apart():
    for seed in range(30):
        measured, computed = failures._diloco_cases(seed)
        assert [c["f"] for c in measured][0] == 1 and measured[1]["f"] > 1
        assert measured[1]["h"] > measured[1]["f"]  # average below the peak
        for c in measured:  # equal fragments: a whole number of layers each
            assert c["layers"] % c["f"] == 0 and c["h"] % c["f"] == 0
        assert any(1 < f < h and n > 2 for _, n, h, f in computed), computed
    assert len({str(failures._diloco_cases(s)) for s in range(30)}) == 30


def _slip(avg=None, peak=None):
    def answer(params, n, h, f):
        a, p = _diloco(params, n, h, f)
        full = a * h
        env = {"a": a, "p": p, "full": full, "n": n, "h": h, "f": f}
        return (eval(avg, env) if avg else a), (eval(peak, env) if peak else p)
    return answer


@pytest.mark.parametrize("answer, hint", [
    (_slip(avg="full"), "the average is its bytes / H"),
    (_slip(avg="full / (h * f)"), "the fragments do not lower the average"),
    (_slip(peak="full"), "the peak is the all-reduce's bytes / F"),
    (_slip(peak="a"), "that is the average; the peak is the busiest step"),
    (_slip(avg="a * n / (2 * (n - 1))", peak="p * n / (2 * (n - 1))"),
     "a ring all-reduce sends 2(N-1)/N of the payload"),
    (_slip(avg="a / 2", peak="p / 2"), "(N-1)/N is a reduce-scatter's share"),
    (_slip(avg="a / 2", peak="p / 2"), "not 2"),  # bf16: the same number
    (_slip(avg="a / 4", peak="p / 4"), "that counts values, not bytes"),
    (lambda *a: (float("nan"), 1.0), "not a number an answer can be"),
    (lambda *a: 1.0, "return a pair (average, peak)"),
    (lambda *a: (1.0, "2 MB"), "return a number"),
])
def test_diloco_slips_are_named_against_the_ledger(cluster, answer, hint):
    with pytest.raises(ExerciseError, match="my_diloco_bytes") as e:
        check_diloco_bytes(cluster, answer)
    assert hint in str(e.value), str(e.value)
    if "a number" not in hint and "pair" not in hint:  # the ranks ran first
        assert "(its traffic ledger, DiLoCo.OUTER_PHASE)" in str(e.value)


def test_diloco_written_down_and_labkits_own_are_refused(cluster):
    fixed = {(1000, 4, 4, 2): _diloco(1000, 4, 4, 2)}
    with pytest.raises(ExerciseError, match=r"my_diloco_bytes.*Hint:"):
        check_diloco_bytes(cluster, lambda *a: fixed.get(a, (0.0, 0.0)))

    def priced(params, n, h, f):
        t = theory.diloco_traffic(4 * params, n, h, f)
        return t.average, t.peak

    def measured(params, n, h, f):
        from labkit.ledger import traffic

        with traffic():
            pass
        return _diloco(params, n, h, f)

    def ran(params, n, h, f):
        cluster.run(lambda r, w: None)
        return _diloco(params, n, h, f)

    for answer, name in ((priced, "diloco_traffic"), (measured, "traffic_ledger"),
                         (ran, "Cluster.run"), (lambda *a: tuple(map(
                             float, failures._diloco_exact(*a))), "_diloco_exact")):
        with pytest.raises(ExerciseError, match=rf"calls labkit.*{name}"):
            check_diloco_bytes(cluster, answer)


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
    plan = failures._hang_plan(12345, cluster.world_size)
    records, want, _ = failures._real_hang(cluster, 12345)
    members = plan["members"]
    ids = {"world": "0", "outer": "1", "inner": "2"}  # fresh ranks: in order
    groups = {ids[k]: tuple(v) for k, v in members.items()}
    program = [(ids[g], (op, ((n,),) if op != "barrier" else (),
                         ("Float",) if op != "barrier" else ()))
               for g, op, n in plan["program"]]
    sim = failures._simulate(cluster.world_size, groups, program, plan["skip"],
                             plan["skipper"], ahead=False)
    got = {r: {g: log.entered for g, log in rec.items()}
           for r, rec in records.items()}
    assert got == {r: {g: log.entered for g, log in rec.items()}
                   for r, rec in sim.items()}, (got, plan)
    assert failures._missed(sim) == [want], (failures._missed(sim), want)


@pytest.mark.parametrize("seed", range(40))
def test_hung_reference_agrees_with_find_mismatch(seed):
    # labkit's find_mismatch says every disagreement; the check's one answer
    # is among them: the rank that did not enter, or the op that differs
    for records, (r, gid, seq), what in failures._dump_cases(seed):
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
        cases = failures._dump_cases(seed)
        wants = [w for _, w, _ in cases]
        assert sum(g != "0" for _, g, _ in wants) >= 2, wants
        assert sum("went on" in what for *_, what in cases) >= 2
        for rule in (_fewest_in_default, _fewest_anywhere, _counts_only):
            assert any(rule(rec) != want for rec, want, _ in cases), (seed, rule)
    assert len({str([w for _, w, _ in failures._dump_cases(s)])
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
        for records, want, what in failures._dump_cases(seed):
            r, g, s = want
            if "stopped" in what:
                hint = failures._hung_hint(records, (r, g, s - 1), want)
                assert "is the last collective rank" in hint, hint
            else:
                hint = failures._hung_hint(records, (r, g, s + 1), want)
                assert "but under #" in hint and "another op" in hint, hint
            if g != "0":
                other = failures._hung_hint(records, (r, "0", s), want)
                assert ("in another group" in other or "fewest" in other), other


def test_hung_labkits_find_mismatch_is_refused(cluster):
    def told(records):
        find_mismatch(records)
        return _hung(records)

    with pytest.raises(ExerciseError, match=r"calls labkit.runtime.flight."
                                            r"find_mismatch, labkit's own"):
        check_hung(cluster, told)
    with pytest.raises(ExerciseError, match=r"failures._missed"):
        check_hung(cluster, lambda rec: failures._missed(rec)[0])


# ------------------------------------------------------- my_save, my_load


def _file(path):
    return os.path.join(path, f"rank{dist.get_rank()}.pt")


def _save(path, model, optimizer, sampler, step, *, leave_out=(), rank0=False):
    state = {"model": model.state_dict(), "step": step,
             "optimizer": optimizer.state_dict(), "sampler": sampler.state_dict(),
             "torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    for k in leave_out:
        state.pop(k)
    if rank0 and dist.get_rank() != 0:
        return
    torch.save(state, _file(path) if not rank0 else os.path.join(path, "rank0.pt"))


def _load(path, model, optimizer, sampler, *, rank0=False):
    state = torch.load(os.path.join(path, "rank0.pt") if rank0 else _file(path),
                       weights_only=False)
    model.load_state_dict(state["model"])
    if "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    if "sampler" in state:
        sampler.load_state_dict(state["sampler"])
    for k, put in (("torch", torch.set_rng_state), ("numpy", np.random.set_state),
                   ("python", random.setstate)):
        if k in state:
            put(state[k])
    return state["step"]


def _leaving(*pieces):
    return (lambda *a: _save(*a, leave_out=pieces)), _load


def test_resume_right_answer_passes(cluster, capsys):
    assert check_resume(cluster, _save, _load)
    out = capsys.readouterr().out
    assert "new ranks resumed from what your my_save wrote" in out, out
    assert "equal the unbroken run's, bit for bit" in out, out


def test_resume_stubs_are_not_written_yet(cluster, capsys):
    assert not check_resume(cluster, _stub, _load)
    assert not check_resume(cluster, _save, _stub)
    assert capsys.readouterr().out.count("not written yet") == 2


@pytest.mark.parametrize("pieces, hint", [
    (("sampler",), "leaves out the sampler's position. Hint: save "
                   "sampler.state_dict()"),
    (("torch", "numpy", "python"), "leaves out every random stream"),
    (("numpy",), "leaves out numpy's random stream"),
    (("optimizer",), "leaves out the optimizer's state"),
])
def test_resume_a_missing_piece_is_named_by_the_resume_it_matches(cluster, pieces,
                                                                   hint):
    with pytest.raises(ExerciseError, match=r"killed with SIGKILL .* from the "
                                            r"unbroken run's") as e:
        check_resume(cluster, *_leaving(*pieces))
    assert hint in str(e.value), str(e.value)
    assert "bit for bit" in str(e.value)


def test_resume_one_file_for_every_rank_is_named(cluster):
    with pytest.raises(ExerciseError, match=r"every rank took rank 0's random "
                                            r"streams\. Hint: each rank has its "
                                            r"own"):
        check_resume(cluster, lambda *a: _save(*a, rank0=True),
                     lambda *a: _load(*a, rank0=True))


def test_resume_shortcuts_fail(cluster):
    def drew(path, model, optimizer, sampler, step):
        torch.rand(1)  # a save that moves the run
        _save(path, model, optimizer, sampler, step)

    with pytest.raises(ExerciseError, match=r"your my_save changed torch's random "
                                            r"stream \(dropout\)"):
        check_resume(cluster, drew, _load)
    # the step, written down: the first save is at an odd step, the run's even
    with pytest.raises(ExerciseError, match=r"my_load returned 4, but .* saved "
                                            r"after step [35]"):
        check_resume(cluster, _save, lambda *a: (_load(*a), 4)[1])
    with pytest.raises(ExerciseError, match=r"my_load returned None"):
        check_resume(cluster, _save, lambda *a: None)


def test_resume_labkits_checkpoint_is_refused(cluster):
    from labkit.parallel import load_train_state, rng_state, save_train_state

    def saved(path, model, optimizer, sampler, step):
        save_train_state(os.path.join(path, "ckpt"), model, optimizer, sampler, step)

    def loaded(path, model, optimizer, sampler):
        return load_train_state(os.path.join(path, "ckpt"), model, optimizer,
                                sampler).step

    with pytest.raises(ExerciseError, match=r"calls labkit.parallel.resume."
                                            r"save_train_state, labkit's own"):
        check_resume(cluster, saved, loaded)

    def streams(path, model, optimizer, sampler, step):
        rng_state()
        _save(path, model, optimizer, sampler, step)

    with pytest.raises(ExerciseError, match=r"resume.rng_state"):
        check_resume(cluster, streams, _load)


def test_resume_an_exception_names_the_line(cluster):
    def broken(path, model, optimizer, sampler, step):
        return {}["model"]

    with pytest.raises(ExerciseError, match=r"my_save and my_load raised KeyError"):
        check_resume(cluster, broken, _load)


# ------------------------------------------------------------------ grading


@pytest.fixture
def grading_on(monkeypatch):
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    grading.graded()
    yield
    grading._graded = False


def test_grading_switched_off_scores_nothing(cluster, grading_on, capsys):
    calls = [lambda: check_interval(_stub),
             lambda: check_diloco_bytes(cluster, _stub),
             lambda: check_hung(cluster, _stub),
             lambda: check_resume(cluster, _stub, _stub)]
    for call in calls:  # graded: a stub is no points
        with pytest.raises(NotAnswered):
            call()
    grading._graded = False  # what an answer cell could do
    assert not calls[0]()  # a stub then says "not written yet"...
    with pytest.raises(ExerciseError, match=r"grading \(switched off"):
        grading.intact()  # ...and the locked test cell scores nothing
    with pytest.raises(NotAnswered):
        calls[0]()  # and grading is back on
