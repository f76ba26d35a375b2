"""labkit.parallel.resume on real gloo ranks: a data-parallel run with dropout
(and numpy and Python random draws) killed mid-run by SIGKILL, restarted and
resumed from its last checkpoint, ends bit for bit where an uninterrupted run
ends; each piece left out (sampler position, RNG, optimizer state) changes the
result, measured; a resume on 2 of the 4 ranks without dropout equals one process
on the same global batches (labkit.numerics.Oracle); what load refuses."""

import os
import random
import shutil
import signal
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

import labkit
from labkit import RankError
from labkit.numerics import Oracle, rel_err
from labkit.parallel.resume import (
    ResumableSampler,
    load_train_state,
    rng_state,
    save_train_state,
    set_rng_state,
)

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels

N, FEWER = 4, 2  # ranks that train and save; ranks that resume in test c
SAMPLES, BATCH, SEED = 64, 8, 7  # one epoch = 8 steps of the global batch
K, EVERY = 8, 2  # steps in the run; a checkpoint every EVERY steps
VICTIM, KILL_AT = 2, 5  # the rank killed, at the start of this step
D_IN, D_H, D_OUT = 6, 16, 3


def _data():
    g = torch.Generator().manual_seed(11)
    return (torch.randn(SAMPLES, D_IN, generator=g),
            torch.randint(0, D_OUT, (SAMPLES,), generator=g))


class Net(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(D_IN, D_H), nn.Linear(D_H, D_OUT), \
            nn.Dropout(p)

    def forward(self, x):  # (B, D_IN) -> (B, D_OUT)
        return self.down(self.drop(torch.tanh(self.up(x))))


def _optimizer(params):
    return torch.optim.AdamW(params, lr=2e-2, weight_decay=0.1)


def _stochastic(x):
    """What a real input pipeline draws: numpy noise, a Python-random scale."""
    noise = torch.from_numpy(np.random.standard_normal(x.shape)).to(x.dtype)
    return (x + 0.05 * noise) * (1.0 + 0.1 * random.random())


def _job(rank, world_size, ckpt, *, stochastic=True, save_every=None, kill_at=None,
         stop=K, skip=()):
    """One job of the run, started as a real job starts (seeds, model, optimizer,
    sampler), resumed from `ckpt` if a checkpoint is there (without the pieces
    named in `skip`). Returns the parameters, every global batch it fed, and what
    the load said."""
    from labkit.parallel.data_parallel import DataParallel

    for seed in (torch.manual_seed, np.random.seed, random.seed):
        seed(100 + rank)  # each rank its own streams, as in any job
    model = Net(0.25 if stochastic else 0.0)
    dp = DataParallel(model)  # rank 0's initial weights on every rank
    opt = _optimizer(model.parameters())
    sampler = ResumableSampler(SAMPLES, BATCH, seed=SEED, dp_rank=rank,
                               dp_size=world_size)
    start, resumed = 0, None
    if ckpt is not None and os.path.isdir(ckpt):
        resumed = load_train_state(
            ckpt, dp, None if "optimizer" in skip else opt,
            None if "sampler" in skip else sampler, rng="rng" not in skip)
        start = resumed.step
    X, Y = _data()
    fed = []
    for step in range(start, stop):
        if step == kill_at and rank == VICTIM:
            os.kill(os.getpid(), signal.SIGKILL)
        fed.append(sampler.global_indices(sampler.epoch, sampler.step))
        idx = next(sampler)
        x = _stochastic(X[idx]) if stochastic else X[idx]
        opt.zero_grad()
        nn.functional.cross_entropy(dp(x), Y[idx]).backward()
        dp.finish_gradient_synchronization()
        opt.step()
        if save_every and (step + 1) % save_every == 0:
            save_train_state(ckpt, dp, opt, sampler, step + 1)
    return SimpleNamespace(params={k: v.clone() for k, v in model.state_dict().items()},
                           fed=fed, resumed=resumed, start=start)


def _variants(rank, world_size, ckpt):
    """A resume from `ckpt` with every piece, then without each in turn."""
    return {skip: _job(rank, world_size, ckpt, skip=(skip,) if skip else ())
            for skip in (None, "sampler", "rng", "optimizer")}


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    ckpt = str(tmp / "ckpt")
    whole = cluster.run(_job, None)  # K steps, no checkpoint, nothing killed
    with pytest.raises(RankError) as killed:
        cluster.run(_job, ckpt, save_every=EVERY, kill_at=KILL_AT)
    at_4 = str(tmp / "at_step4")
    shutil.copytree(ckpt, at_4)  # for b and c: the resume below saves over ckpt
    resumed = cluster.run(_job, ckpt, save_every=EVERY)  # the ranks start again
    return SimpleNamespace(whole=whole, killed=killed.value, resumed=resumed,
                           at_4=at_4, tmp=tmp)


def _max_abs(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


# -- a: killed, restarted, resumed: bit for bit ---------------------------------------


def test_a_killed_rank_resumes_bit_for_bit(runs):
    assert f"rank {VICTIM} died: killed by SIGKILL" in str(runs.killed), (
        f"the run killed on rank {VICTIM} at step {KILL_AT} should raise naming it; "
        f"it raised: {runs.killed}")
    for rank, (r, w) in enumerate(zip(runs.resumed, runs.whole)):
        assert (r.start, r.resumed.step, r.resumed.saved_ranks, r.resumed.rng_from) \
            == (4, 4, N, rank), (
            f"rank {rank} resumed from step {r.start} (saved by "
            f"{r.resumed.saved_ranks} ranks, RNG of saved rank {r.resumed.rng_from}); "
            f"expected the step-4 checkpoint of {N} ranks, its own RNG")
        same = [k for k in w.params if torch.equal(r.params[k], w.params[k])]
        assert len(same) == len(w.params), (
            f"rank {rank}: after the kill at step {KILL_AT} and the resume from step 4,"
            f" parameters equal bit for bit to the uninterrupted run's: {same} of "
            f"{sorted(w.params)}; max-abs difference {_max_abs(r.params, w.params):.3e}"
            " (allowed 0)")
    print(f"\na: killed rank {VICTIM} at step {KILL_AT}, resumed from step 4 on "
          f"{N} ranks: final parameters equal bit for bit (max-abs difference 0)")


# -- b: what goes wrong without each piece --------------------------------------------


@pytest.fixture(scope="module")
def variants(cluster, runs):
    return cluster.run(_variants, runs.at_4)


def test_b_each_piece_left_out_changes_the_run(runs, variants):
    whole = runs.whole[0]
    # one epoch is K steps: the uninterrupted run sees every sample once
    seen = torch.cat(whole.fed).bincount(minlength=SAMPLES)
    assert seen.eq(1).all(), f"uninterrupted run: sample counts {seen.tolist()}"
    full = variants[0][None]
    diff = _max_abs(full.params, whole.params)
    assert diff == 0, ("a resume with every piece (a job started again in the same "
                       "ranks) against the uninterrupted run: max-abs parameter "
                       f"difference {diff:.3e}, allowed 0")
    # the steps before the checkpoint fed the uninterrupted run's first 4 batches
    # (the same seeds and sampler): with its own steps after it, the whole epoch
    print()
    for skip in ("sampler", "rng", "optimizer"):
        got = variants[0][skip]
        counts = torch.cat(whole.fed[:4] + got.fed).bincount(minlength=SAMPLES)
        repeated, skipped = int((counts > 1).sum()), int((counts == 0).sum())
        diff = _max_abs(got.params, whole.params)
        rel = rel_err(got.params, whole.params)
        print(f"b: resumed without the {skip}: {repeated} samples seen twice, "
              f"{skipped} never (of {SAMPLES}); parameters max-abs {diff:.3e}, "
              f"relative {rel:.2e} from the uninterrupted run")
        assert diff > 0, (f"resumed without the {skip}: max-abs parameter "
                          f"difference {diff} from the uninterrupted run, expected > 0")
        if skip == "sampler":  # it starts the epoch again: steps 0-3 twice, 4-7 never
            assert (repeated, skipped) == (4 * BATCH, 4 * BATCH), (
                f"without the sampler position: {repeated} samples repeated and "
                f"{skipped} skipped, expected {4 * BATCH} each")
        else:
            assert (repeated, skipped) == (0, 0), (
                f"without the {skip}: {repeated} repeated, {skipped} skipped: the "
                "sampler was restored, expected 0 and 0")


# -- c: on fewer ranks ----------------------------------------------------------------


def _one_process(dtype, pieces=1):
    """K steps of one process on the same global batches, without dropout, the
    mean gradient summed from `pieces` equal parts, in `dtype`."""
    torch.manual_seed(100)  # rank 0's: DataParallel starts every rank from it
    model = Net(0.0).to(dtype)
    opt = _optimizer(model.parameters())
    X, Y = _data()
    sampler = ResumableSampler(SAMPLES, BATCH, seed=SEED)
    out = {}
    for step in range(K):
        idx = next(sampler)
        opt.zero_grad()
        for part in idx.chunk(pieces):
            (nn.functional.cross_entropy(model(X[part].to(dtype)), Y[part])
             / pieces).backward()
        opt.step()
        if step + 1 == K // 2:
            out["half"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["end"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def test_c_resume_on_fewer_ranks(cluster, runs):
    plain = str(runs.tmp / "no_dropout")
    cluster.run(_job, plain, stochastic=False, save_every=K // 2, stop=K // 2)
    with labkit.Cluster(FEWER, timeout=20) as fewer:
        res = fewer.run(_job, plain, stochastic=False)
        noisy = fewer.run(_job, runs.at_4)  # with dropout, from a's checkpoint
    exact = _one_process(torch.float64)
    oracle = Oracle(exact["end"], {
        "whole batch": _one_process(torch.float32)["end"],
        f"{FEWER} halves": _one_process(torch.float32, FEWER)["end"],
        f"{N} quarters": _one_process(torch.float32, N)["end"]})
    # a resume that did nothing (the step-4 weights) is far outside the allowance
    far = oracle.resolves(exact["half"], "the weights at the checkpoint (step 4)")
    print(f"\nc: {oracle}; the step-4 weights are {far:.1e} away")
    for rank, r in enumerate(res):
        assert (r.resumed.step, r.resumed.saved_ranks, r.resumed.rng_from) \
            == (K // 2, N, rank), f"rank {rank} of {FEWER} loaded {r.resumed}"
        assert torch.equal(torch.stack(r.fed), torch.stack(runs.whole[0].fed[K // 2:])
                           ), (f"rank {rank} of {FEWER}: the global batches after the "
                               f"resume differ from the {N}-rank run's")
        a = oracle.check(r.params, f"{N} ranks to step {K // 2}, {FEWER} ranks to "
                                   f"step {K}: rank {rank}'s parameters")
        print(f"c: {a} (margin {a.margin:.2f})")
    # with dropout: rank r draws from saved rank r's stream, for twice the rows,
    # and saved ranks 2 and 3's streams go unused: other masks, other weights
    diff = _max_abs(noisy[0].params, runs.whole[0].params)
    rel = rel_err(noisy[0].params, runs.whole[0].params)
    print(f"c: with dropout, resumed on {FEWER} ranks: max-abs {diff:.3e}, relative "
          f"{rel:.2e} from the uninterrupted {N}-rank run")
    assert diff > 0, (f"with dropout the {FEWER}-rank resume cannot draw the "
                      f"{N}-rank masks: max-abs difference {diff}, expected > 0")


# -- d: what load refuses; the sampler and RNG on their own ---------------------------


def test_d_refusals(runs):
    model = Net(0.25)
    opt = _optimizer(model.parameters())
    other = ResumableSampler(SAMPLES, 2 * BATCH, seed=SEED)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"global_batch 8 saved, 16 here"):
        load_train_state(runs.at_4, model, opt, other)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), \
        "a refused load changed the model"
    assert (other.epoch, other.step) == (0, 0), "a refused load moved the sampler"
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_train_state(str(runs.tmp / "never_saved"), model, opt)
    cut = str(runs.tmp / "cut.saving")  # a save's temporary folder, not renamed
    shutil.copytree(runs.at_4, cut)
    with pytest.raises(ValueError, match="did not finish"):
        load_train_state(cut, model, opt)
    os.remove(os.path.join(cut, ".labkit-complete"))
    unfinished = str(runs.tmp / "unfinished")
    os.rename(cut, unfinished)
    with pytest.raises(ValueError, match="has no .labkit-complete"):
        load_train_state(unfinished, model, opt)


def test_the_global_batch_does_not_depend_on_dp_size():
    one = ResumableSampler(40, 8, seed=3)
    for epoch in range(2):
        order = torch.cat([one.global_indices(epoch, k) for k in range(5)])
        assert sorted(order.tolist()) == list(range(40)), \
            f"epoch {epoch}: each of 40 samples once in 5 steps of 8"
        for dp in (2, 4, 8):
            parts = [ResumableSampler(40, 8, seed=3, dp_rank=r, dp_size=dp)
                     for r in range(dp)]
            for k in range(5):
                got = torch.cat([p.indices(epoch, k) for p in parts])
                assert torch.equal(got, one.global_indices(epoch, k)), (
                    f"epoch {epoch} step {k}: the union of {dp} ranks' indices "
                    f"{got.tolist()} differs from the global batch")
    assert not torch.equal(one.permutation(0), one.permutation(1)), \
        "two epochs in the same order"


def test_the_sampler_resumes_where_it_stopped():
    run = ResumableSampler(40, 8, seed=3, dp_rank=1, dp_size=4)
    fed = [next(run) for _ in range(12)]  # crosses into epoch 2 (5 steps an epoch)
    first = ResumableSampler(40, 8, seed=3, dp_rank=1, dp_size=4)
    for _ in range(7):
        next(first)
    state = first.state_dict()
    assert (state["epoch"], state["step"]) == (1, 2)
    again = ResumableSampler(40, 8, seed=3, dp_rank=1, dp_size=4)
    again.load_state_dict(state)
    assert all(torch.equal(next(again), fed[i]) for i in range(7, 12))
    half = [ResumableSampler(40, 8, seed=3, dp_rank=r, dp_size=2) for r in range(2)]
    for s in half:  # on 2 ranks: the same global batches, in halves
        s.load_state_dict(state)
    for i in range(7, 12):
        want = run.global_indices(*divmod(i, 5))
        got = torch.cat([next(s) for s in half])
        assert torch.equal(got, want), f"step {i} on 2 ranks: {got} vs {want}"
    with pytest.raises(ValueError, match="seed 3 saved, 4 here"):
        ResumableSampler(40, 8, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="not a multiple of dp_size"):
        ResumableSampler(40, 6, dp_size=4)


def test_rng_state_puts_every_stream_back():
    kept = rng_state()
    first = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    set_rng_state(kept)
    again = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    assert torch.equal(first[0], again[0]), "torch's stream not put back"
    assert np.array_equal(first[1], again[1]), "numpy's stream not put back"
    assert first[2] == again[2], "Python's random not put back"


# -- the same restart, done by torchrun (--max-restarts 1) ----------------------------


@pytest.mark.slow  # three torchrun job starts: about a minute on 2 cores
def test_torchrun_restarts_and_resumes_by_itself():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "resume_torchrun.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True,
                          text=True, timeout=600)
    said = [line for line in done.stdout.splitlines()
            if line.startswith(("uninterrupted:", "killed once:", "same", "the "))]
    print("\n" + "\n".join(said))
    assert done.returncode == 0 and "same parameters, bit for bit" in said, (
        f"{script.name}: an uninterrupted torchrun job against one whose rank "
        f"killed itself and was restarted: exit {done.returncode}, said {said}; "
        f"expected equal digests after 1 restart. stderr ends:\n"
        f"{done.stderr[-3000:]}")
