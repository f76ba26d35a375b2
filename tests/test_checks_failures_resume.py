"""labkit.checks.failures_resume (chapter 13's exercise 4, an exact resume after
SIGKILL): the check passes a right save and load, says "not written yet" for a
stub, names the piece a resume leaves out (the sampler, a random stream, the
optimizer, one file for every rank), and fails every shortcut: labkit's
save_train_state, a save that moves the run, a step written down."""

import os
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from labkit.checks.common import ExerciseError
from labkit.checks.failures_resume import check_resume


def _stub(*args):
    raise NotImplementedError("exercise")


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
