"""Exercise checks, widgets (headless), and the diagrams in images/."""

import pytest

from labkit import checks, widgets
from labkit.images import IMAGES, stale


def _good(rank, world_size, chunks):
    import torch.distributed as dist

    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for s in range(1, world_size):
        into = chunks[(rank - s) % world_size]
        buf = into.clone()
        reqs = [dist.isend(chunks[(rank - s + 1) % world_size], right),
                dist.irecv(buf, left)]
        for q in reqs:
            q.wait()
        into += buf


def _one_step_short(rank, world_size, chunks):
    import torch.distributed as dist

    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for s in range(1, world_size - 1):  # a step too few
        into = chunks[(rank - s) % world_size]
        buf = into.clone()
        reqs = [dist.isend(chunks[(rank - s + 1) % world_size], right),
                dist.irecv(buf, left)]
        for q in reqs:
            q.wait()
        into += buf


def _todo(rank, world_size, chunks):
    raise NotImplementedError


def test_ring_reduce_scatter_check(cluster, capsys):
    assert checks.check_ring_reduce_scatter(cluster, _todo) is False
    assert "not written yet" in capsys.readouterr().out
    assert checks.check_ring_reduce_scatter(cluster, _good) is True
    wrong = r"rank 0, chunk 1 .* holds ranks \[0\].* missing \[1, 2, 3\]"
    with pytest.raises(checks.ExerciseError, match=wrong):
        checks.check_ring_reduce_scatter(cluster, _one_step_short)


def test_check_answer(capsys):
    assert checks.check_answer("x", None, 3) is False
    assert "not answered yet" in capsys.readouterr().out
    assert checks.check_answer("x", 3.0, 3) is True
    with pytest.raises(checks.ExerciseError, match="Hint: think"):
        checks.check_answer("x", 4, 3, hint="think")
    with pytest.raises(checks.ExerciseError, match="number"):
        checks.check_answer("x", "3", 3)


def test_ring_stepper_headless():
    w = widgets.ring_stepper(4)
    assert w.step.max == 6 and w.last.phase == "start"
    w.step.value = 3
    assert (w.last.phase, w.last.step) == ("reduce-scatter", 3)
    assert "0.75·M" in w.info.value
    w.n.value = 16
    assert w.step.max == 30
    w.step.value = 30
    assert (w.last.phase, w.last.step) == ("all-gather", 15)
    assert len(w.last.holds) == 16


def test_images_are_up_to_date():
    assert stale() == [], "run `make images` and commit images/"
    assert (IMAGES / "ring_allreduce_4.svg").exists()
