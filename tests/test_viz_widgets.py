"""Exercise checks, widgets (headless), and the diagrams in images/."""

import pytest

from labkit import checks, viz
from labkit.cli.images import IMAGES, stale


def _ring_steps(rank, world_size, chunks, steps):
    import torch.distributed as dist

    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for s in range(1, steps + 1):
        into = chunks[(rank - s) % world_size]
        buf = into.clone()
        reqs = [dist.isend(chunks[(rank - s + 1) % world_size], right),
                dist.irecv(buf, left)]
        for q in reqs:
            q.wait()
        into += buf


def _good(rank, world_size, chunks):
    _ring_steps(rank, world_size, chunks, world_size - 1)


def _one_step_short(rank, world_size, chunks):
    _ring_steps(rank, world_size, chunks, world_size - 2)


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
    w = viz.ring_stepper(4)
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


def test_zero_explorer_headless():
    w = viz.zero_explorer()
    assert [round(v.total / 1e9, 1) for v in w.last.values()] == [120.0, 31.4, 16.6,
                                                                   1.9]
    w.n.value = 8
    assert w.last["ZeRO-3"].total == pytest.approx(16 * 7.5e9 / 8)
    w.model.value = "llama3-8b"
    assert w.psi() == 8_030_261_248
    assert w.last["DP"].total == pytest.approx(16 * 8_030_261_248)
    w.precision.value, w.k.value = "fp32", 8  # fp32 Adam: 4 + 4 + 8
    assert w.last["DP"].total == pytest.approx(16 * 8_030_261_248)
    w.stage.value = 1
    assert "ZeRO-1 keeps" in w.info.value


def test_placement_explorer_headless():
    w = viz.placement_explorer(preset="ZeRO-3")
    p, cost, verdict = w.last
    assert verdict.ok and p.P == "ShardedWithGather"
    w.modes["P"].value = "Replicated"  # now it is ZeRO-2, and says so
    assert w.preset.value == "ZeRO-2" and w.last[2].ok
    w.modes["O"].value = "Replicated"  # replicated optimizer, sharded gradients
    assert w.preset.value == "custom" and not w.last[2].ok
    assert "incorrect" in w.verdict.value
    w.preset.value = "DP"
    assert w.last[0].O == "Replicated" and w.last[2].ok
    assert w.last[1].traffic_total == pytest.approx(2 * 63 / 64 * 7.5e9 * 2)
