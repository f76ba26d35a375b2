"""Chapter 13's exercise 4: an exact resume after SIGKILL. A data-parallel run drawn
each run trains unbroken; then with the answer's my_save, one rank is SIGKILLed,
and new ranks resume with its my_load: the weights must equal the unbroken run's
bit for bit, or the check's own resumes, each leaving one piece out, name it.

Imports labkit.checks' common, explain, verify and watch, and labkit.runtime;
torch, numpy and labkit.parallel inside functions. labkit's save_train_state and
load_train_state are refused in the answer.
"""

from __future__ import annotations

import os
import random
import tempfile

from labkit.checks.common import (
    NOT_YET,
    PASSED,
    ExerciseError,
    is_whole,
    labkit_cluster,
    run_answer,
)
from labkit.checks.explain import (
    failure_message,
    student_frame,
)
from labkit.checks.verify import fresh_seed, own_calls, refuse_own
from labkit.checks.watch import AnswerRaised, watched
from labkit.runtime import RankError

# labkit's own checkpointing (the training state, its random streams, the files
# under it), and this check's own
_RESUME_OWN = tuple(f"labkit.parallel.resume:{f}" for f in (
    "save_train_state", "load_train_state", "rng_state", "set_rng_state")) + (
    "labkit.parallel.checkpoint_files", "labkit.parallel.sharded_checkpoint",
    "labkit.checks.failures_resume:_own_save",
    "labkit.checks.failures_resume:_own_load")
_PIECES = {
    "weights": "the model's weights",
    "optimizer": "the optimizer's state (AdamW's moments and step count)",
    "sampler": "the sampler's position",
    "torch": "torch's random stream (dropout)",
    "numpy": "numpy's random stream (the input noise)",
    "python": "Python's random stream (the input scale)",
}
_FIX = {
    "weights": "load model.state_dict() back into the model",
    "optimizer": "save optimizer.state_dict() and load it back: without it AdamW "
                 "starts its moments from zero",
    "sampler": "save sampler.state_dict() and load it back (load_state_dict): "
               "without it the data starts the epoch again",
    "rng": "save each rank's random states, torch.get_rng_state(), "
           "np.random.get_state() and random.getstate(), and set them back, last, "
           "in my_load",
    "torch": "save torch.get_rng_state() and set it back (torch.set_rng_state)",
    "numpy": "save np.random.get_state() and set it back (np.random.set_state)",
    "python": "save random.getstate() and set it back (random.setstate)",
}
_STREAMS = ("torch", "numpy", "python")


def _resume_case(seed: int, world: int) -> dict:
    """A run drawn this run: data, model, dropout, steps crossing an epoch, the
    rank killed and the step it is killed at (the last save before it: the even
    step at or below it)."""
    rng = random.Random(seed)
    batch = world * rng.choice((2, 3))
    per_epoch = rng.randint(2, 3)
    steps = rng.randint(5, 6)
    kill_at = rng.randint(3, steps - 1)
    return dict(seed=rng.randrange(10**6), data_seed=rng.randrange(10**6),
                samples=batch * per_epoch + rng.randrange(batch), batch=batch,
                per_epoch=per_epoch, inputs=rng.randint(4, 8),
                width=rng.choice((8, 12, 16)), classes=rng.randint(2, 4),
                p=round(rng.uniform(0.15, 0.4), 2), lr=round(rng.uniform(0.005, 0.03),
                                                            3),
                noise=round(rng.uniform(0.02, 0.1), 3), steps=steps, kill_at=kill_at,
                saved=2 * (kill_at // 2), victim=rng.randrange(world))


def _data(case: dict):
    import torch

    g = torch.Generator().manual_seed(case["data_seed"])
    return (torch.randn(case["samples"], case["inputs"], generator=g),
            torch.randint(0, case["classes"], (case["samples"],), generator=g))


def _job(rank: int, world_size: int, case: dict, other: bool = False):
    """The model (with dropout, rank 0's weights on every rank), AdamW and the
    sampler of one rank, its streams seeded its own (other: seeded otherwise,
    as a run that went elsewhere)."""
    from types import SimpleNamespace

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch import nn

    from labkit.parallel import ResumableSampler

    seed = case["seed"] + rank + (7919 if other else 0)
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    model = nn.Sequential(nn.Linear(case["inputs"], case["width"]), nn.Tanh(),
                          nn.Dropout(case["p"]), nn.Linear(case["width"],
                                                           case["classes"]))
    params = list(model.parameters())
    with torch.no_grad():  # one broadcast of every weight
        flat = torch.cat([p.reshape(-1) for p in params])
        dist.broadcast(flat, src=0)
        for p, v in zip(params, flat.split([p.numel() for p in params])):
            p.copy_(v.view_as(p))
    opt = torch.optim.AdamW(params, lr=case["lr"])
    sampler = ResumableSampler(case["samples"], case["batch"], seed=case["seed"] % 997,
                               dp_rank=rank, dp_size=world_size)
    return SimpleNamespace(model=model, opt=opt, sampler=sampler, world=world_size)


def _train(job, data, case: dict, steps: int) -> None:
    """`steps` steps of data parallelism: this rank's indices, its inputs with
    numpy's noise and Python's scale, dropout, the gradients averaged (one
    all-reduce), AdamW."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    X, Y = data
    params = list(job.model.parameters())
    for _ in range(steps):
        idx = next(job.sampler)
        job.opt.zero_grad()
        noise = torch.from_numpy(np.random.standard_normal(tuple(X[idx].shape)))
        x = (X[idx] + case["noise"] * noise.float()) * (1 + 0.1 * random.random())
        F.cross_entropy(job.model(x), Y[idx]).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat.div_(job.world)
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))
        job.opt.step()


def _params_of(job) -> dict:
    return {k: v.detach().clone() for k, v in job.model.state_dict().items()}


def _snapshot(job) -> dict:
    """Everything the run's next steps depend on, copied."""
    import copy

    import numpy as np
    import torch

    return {"weights": _params_of(job), "optimizer": copy.deepcopy(
        job.opt.state_dict()), "sampler": (job.sampler.epoch, job.sampler.step),
        "torch": torch.get_rng_state(), "numpy": np.random.get_state(),
        "python": random.getstate()}


def _same(a, b) -> bool:
    """Nested dicts, lists, tuples, tensors and arrays alike, bit for bit."""
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _differs(a: dict, b: dict) -> list[str]:
    return [k for k in _PIECES if not _same(a[k], b[k])]


def _step_value(x):
    """What my_load returned, as something that travels: an int, or its repr."""
    return int(x) if is_whole(x) else repr(x)[:80]


def _own_save(folder: str, job, rank: int, step: int) -> None:
    """The check's own checkpoint of this rank (the resumes it compares with)."""
    import torch

    state = _snapshot(job)
    state["sampler"] = job.sampler.state_dict()
    torch.save({**state, "step": step}, os.path.join(folder, f"rank{rank}.pt"))


def _own_load(folder: str, job, rank: int, leave_out: str) -> None:
    """Load the check's checkpoint, but for the piece `leave_out` ("rank q":
    every stream from rank q's file instead of this rank's)."""
    import numpy as np
    import torch

    state = torch.load(os.path.join(folder, f"rank{rank}.pt"), weights_only=False)
    if leave_out != "weights":
        job.model.load_state_dict(state["weights"])
    if leave_out != "optimizer":
        job.opt.load_state_dict(state["optimizer"])
    if leave_out != "sampler":
        job.sampler.load_state_dict(state["sampler"])
    if leave_out.startswith("rank "):
        state = torch.load(os.path.join(folder, f"rank{leave_out[5:]}.pt"),
                           weights_only=False)
    setters = {"torch": torch.set_rng_state, "numpy": np.random.set_state,
               "python": random.setstate}
    for stream, put in setters.items():
        if leave_out not in (stream, "rng"):
            put(state[stream])


def _resume_first(rank, world_size, my_save, my_load, case, scratch):
    """On each rank: the answer's save and load once (what the save moved, what
    the load left out, its step, labkit's own code called), then the unbroken
    run's weights."""
    data = _data(case)
    job = _job(rank, world_size, case)
    # into the second epoch, at an odd step (the run's saves are at even ones)
    first = case["per_epoch"] + (1 if case["per_epoch"] % 2 == 0 else 2)
    _train(job, data, case, first)
    before = _snapshot(job)
    with own_calls(*_RESUME_OWN) as own:
        my_save(scratch, job.model, job.opt, job.sampler, first)
    moved = _differs(before, _snapshot(job))
    elsewhere = _job(rank, world_size, case, other=True)  # another run's state
    _train(elsewhere, data, case, 1)
    with own_calls(*_RESUME_OWN) as own_load:
        start = my_load(scratch, elsewhere.model, elsewhere.opt, elsewhere.sampler)
    lost = _differs(before, _snapshot(elsewhere))
    whole = _job(rank, world_size, case)
    _train(whole, data, case, case["steps"])
    return dict(own=own + own_load, moved=moved, lost=lost, start=_step_value(start),
                saved=first, params=_params_of(whole))


def _resume_killed(rank, world_size, my_save, case, folder, ref):
    """Train with the answer's save (and the check's own) every 2 steps; rank
    `victim` is killed with SIGKILL when step `kill_at` begins."""
    import signal

    data = _data(case)
    job = _job(rank, world_size, case)
    for step in range(case["steps"]):
        if step == case["kill_at"] and rank == case["victim"]:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup: a node lost
        _train(job, data, case, 1)
        if (step + 1) % 2 == 0:
            _own_save(ref, job, rank, step + 1)
            my_save(folder, job.model, job.opt, job.sampler, step + 1)


def _resume_again(rank, world_size, my_load, case, folder):
    """New ranks: build the run, the answer's load, train to the end."""
    data = _data(case)
    job = _job(rank, world_size, case)
    with own_calls(*_RESUME_OWN) as own:
        start = my_load(folder, job.model, job.opt, job.sampler)
    start = _step_value(start)
    params = None
    if start == case["saved"]:
        _train(job, data, case, case["steps"] - start)
        params = _params_of(job)
    return dict(own=own, start=start, params=params)


def _resume_without(rank, world_size, case, ref, variants):
    """The check's own resumes from its own checkpoint, each leaving one piece
    out: their weights at the end."""
    data = _data(case)
    out = {}
    for leave_out in variants:
        job = _job(rank, world_size, case)
        _own_load(ref, job, rank, leave_out)
        _train(job, data, case, case["steps"] - case["saved"])
        out[leave_out] = _params_of(job)
    return out


def _first_difference(a: dict, b: dict) -> str | None:
    for k in b:
        if not _same(a[k], b[k]):
            return f"{k} differs by up to {(a[k] - b[k]).abs().max().item():.2e}"
    return None


def _step_problem(call: str, start, saved: int) -> None:
    if start != saved:  # an int, or the repr of what it was
        raise ExerciseError(
            f"{call} returned {start}, but the checkpoint my_save wrote was saved "
            f"after step {saved}: return the step saved with it (the next step to "
            "run)")


def check_resume(cluster, my_save, my_load, *, timeout: float = 20.0) -> bool:
    """`my_save(path, model, optimizer, sampler, step)` and `my_load(path, model,
    optimizer, sampler) -> step` (path a folder, the same on every rank).
    A data-parallel run drawn this run (dropout, numpy's and Python's draws in
    its inputs, steps past an epoch) trains unbroken; then with my_save every 2
    steps, one rank SIGKILLed mid-run, and new ranks resumed with my_load: the
    weights must equal the unbroken run's bit for bit. When they do not, the
    check runs resumes of its own that leave one piece out and names the one
    yours matches. labkit's save_train_state and load_train_state are refused."""
    import shutil

    cluster = labkit_cluster(cluster)
    case = _resume_case(fresh_seed(), cluster.world_size)
    top = tempfile.mkdtemp(prefix="labkit-resume-")
    folder, ref, scratch = (os.path.join(top, d) for d in ("yours", "check", "once"))
    for d in (folder, ref, scratch):
        os.mkdir(d)
    try:
        return _check_resume(cluster, my_save, my_load, case, folder, ref, scratch,
                             timeout)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _check_resume(cluster, my_save, my_load, case, folder, ref, scratch,
                  timeout: float) -> bool:
    first = run_answer(cluster, _resume_first, my_save, my_load, case, scratch,
                       what="my_save and my_load", timeout=timeout, prepare=False)
    if first is None:
        return NOT_YET
    saved = first[0]["saved"]
    for rank, r in enumerate(first):
        refuse_own(f"rank {rank}, my_save then my_load", r["own"],
                   "checkpointing (save_train_state, load_train_state, rng_state), "
                   "or this check's")
        if r["moved"]:
            raise ExerciseError(
                f"rank {rank}: your my_save changed "
                f"{_and([_PIECES[p] for p in r['moved']])} of the run it saved: a "
                "save must leave the run as it was (draw nothing, step nothing)")
        _step_problem(f"rank {rank}: my_load", r["start"], saved)
    whole = [r["params"] for r in first]
    try:
        cluster.run(watched, _resume_killed, my_save, case, folder, ref,
                    timeout=timeout)
    except RankError as err:
        _killed_as_planned(err, case["victim"])
    else:
        raise RuntimeError("the check's run was not stopped: its rank "
                           f"{case['victim']} was to be killed")
    again = run_answer(cluster, _resume_again, my_load, case, folder,
                       what="my_load", timeout=timeout, prepare=False)
    if again is None:
        return NOT_YET
    for rank, r in enumerate(again):
        refuse_own(f"rank {rank}, my_load", r["own"], "checkpointing "
                   "(load_train_state, set_rng_state), or this check's")
        _step_problem(f"rank {rank}: my_load", r["start"], case["saved"])
    run = (f"rank {case['victim']} was killed with SIGKILL when step "
           f"{case['kill_at']} began, and new ranks resumed from what your my_save "
           f"wrote after step {case['saved']}")
    bad = [(rank, _first_difference(r["params"], w))
           for rank, (r, w) in enumerate(zip(again, whole))]
    bad = [(rank, d) for rank, d in bad if d]
    if not bad:
        print(f"correct: {run}; after all {case['steps']} steps every rank's "
              "weights equal the unbroken run's, bit for bit")
        return PASSED
    rank, diff = bad[0]
    msg = (f"{run}: after all {case['steps']} steps, rank {rank}'s {diff} from "
           "the unbroken run's.")
    raise ExerciseError(msg + _resume_diagnosis(cluster, case, ref, again, first))


def _killed_as_planned(err: RankError, victim: int) -> None:
    """Nothing if the run stopped because `victim` died; ExerciseError naming
    the answer's line if my_save raised."""
    mine = [e for e in err.exceptions.values() if isinstance(e, AnswerRaised)
            and student_frame(e.frames) is not None]
    if mine or victim not in err.failures:
        raise ExerciseError(failure_message(err, "my_save"))


def _resume_diagnosis(cluster, case, ref, again, first) -> str:
    """Which piece the answer's resume leaves out: the check's resume that ends
    with its weights, bit for bit; with what the load lost in the first try."""
    variants = ["everything", "sampler", "rng", *_STREAMS, "optimizer", "weights"]
    variants += [f"rank {q}" for q in range(cluster.world_size)]
    runs = run_answer(cluster, _resume_without, case, ref, variants,
                      what="the check's own resumes", timeout=20.0, prepare=False)
    whole = [r["params"] for r in first]
    for rank, r in enumerate(runs):
        if _first_difference(r["everything"], whole[rank]):
            raise RuntimeError(f"rank {rank}: the check's own resume differs from "
                               "the unbroken run")
    same = [v for v in variants[1:] if all(
        _first_difference(a["params"], r[v]) is None for a, r in zip(again, runs))]
    lost = sorted({p for r in first for p in r["lost"]}, key=list(_PIECES).index)
    out, explained = "", set()
    if same:
        v = same[0]
        explained = set(_STREAMS) if v == "rng" or v.startswith("rank ") else {v}
        if v.startswith("rank "):
            out = (f" They equal, bit for bit, those of a resume in which every rank "
                   f"took {v}'s random streams. Hint: each rank has its own; save a "
                   "file a rank (named by dist.get_rank()) and load each rank's own")
        else:
            what = "every random stream" if v == "rng" else _PIECES[v]
            out = (f" They equal, bit for bit, those of a resume of the check's own "
                   f"that leaves out {what}. Hint: {_FIX[v]}")
    rest = [p for p in lost if p not in explained]
    if rest:
        out += (f"{'. Also, l' if out else ' Hint: l'}oaded into a run in another "
                f"state, your my_load left {_and([_PIECES[p] for p in rest])} as that "
                f"run had {'it' if len(rest) == 1 else 'them'}: "
                + "; ".join(_FIX[p] for p in rest))
    if not out:
        out = (" Hint: an exact resume brings back the weights, the optimizer's "
               "state, the sampler's position and every rank's torch, numpy and "
               "Python random streams")
    return out


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
