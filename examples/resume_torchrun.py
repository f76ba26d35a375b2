"""A data-parallel run that torchrun restarts by itself after a rank dies, and that
ends with the same parameters, bit for bit, as a run nobody killed.

Two torchrun jobs of 2 ranks each (`--max-restarts 1`), the same worker `train`:
the first is never killed; in the second, rank 1 kills itself (SIGKILL) at the
start of step KILL_AT, once (a marker file in the job's folder says it did).
torchrun then stops the other rank and starts both again; they resume from the
last checkpoint (labkit.parallel.resume: model, AdamW, sampler position, every
rank's random streams, saved every EVERY steps) and train to step K.

    python examples/resume_torchrun.py      # prints both digests; exit 1 if they differ
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

SAMPLES, BATCH, SEED = 32, 8, 7  # the global batch, on any number of ranks
K, EVERY, KILL_AT, VICTIM = 6, 2, 3, 1  # steps, checkpoint interval, the kill


def train(rank: int, world_size: int, folder: str, kill: bool) -> dict:
    """What every torchrun process runs (`python -m labkit.launch`), after a
    restart too: start as any job does, resume if a checkpoint is there."""
    from labkit.parallel.data_parallel import DataParallel
    from labkit.parallel.resume import (
        ResumableSampler,
        load_train_state,
        save_train_state,
    )

    for seed in (torch.manual_seed, np.random.seed, random.seed):
        seed(100 + rank)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.25),
                          nn.Linear(16, 3))
    dp = DataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    sampler = ResumableSampler(SAMPLES, BATCH, seed=SEED, dp_rank=rank,
                               dp_size=world_size)
    ckpt, marker = os.path.join(folder, "ckpt"), os.path.join(folder, "killed")
    start = 0
    if os.path.isdir(ckpt):
        start = load_train_state(ckpt, dp, opt, sampler).step
        print(f"rank {rank}: resumed from step {start}", flush=True)
    g = torch.Generator().manual_seed(11)
    X, Y = torch.randn(SAMPLES, 6, generator=g), torch.randint(0, 3, (SAMPLES,),
                                                                generator=g)
    for step in range(start, K):
        if kill and step == KILL_AT and rank == VICTIM and not os.path.exists(marker):
            Path(marker).touch()  # once: the restarted job runs on
            print(f"rank {rank}: killing myself at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        idx = next(sampler)
        x = X[idx] + 0.05 * torch.from_numpy(np.random.standard_normal((len(idx), 6))
                                             ).float()
        opt.zero_grad()
        nn.functional.cross_entropy(dp(x), Y[idx]).backward()
        dp.finish_gradient_synchronization()
        opt.step()
        if (step + 1) % EVERY == 0:
            save_train_state(ckpt, dp, opt, sampler, step + 1)
    digest = hashlib.sha256()
    for v in model.state_dict().values():
        digest.update(v.numpy().tobytes())
    return {"digest": digest.hexdigest()[:16], "started_at": start,
            "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))}


def main() -> int:
    from labkit.runtime import launch_torchrun, load_results

    # launch_torchrun gives each restarted worker group a store of its own
    target = f"{Path(__file__).resolve()}:train"
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, kill in (("uninterrupted", False), ("killed once", True)):
            folder = os.path.join(tmp, name.replace(" ", "_"))
            os.makedirs(folder)
            code = launch_torchrun(target, 2, ["--max-restarts", "1"],
                                   args=(folder, str(kill)),
                                   results=os.path.join(folder, "results"))
            if code:
                print(f"{name}: torchrun exited with {code}")
                return 1
            out[name] = load_results(os.path.join(folder, "results")).values
    for name, values in out.items():
        print(f"{name}: " + "; ".join(
            f"rank {r}: {v['digest']} (restarts {v['restarts']}, resumed at step "
            f"{v['started_at']})" for r, v in enumerate(values)))
    same = all(a["digest"] == b["digest"] for a, b in zip(*out.values()))
    restarted = all(v["restarts"] == 1 and v["started_at"] == KILL_AT // EVERY * EVERY
                    for v in out["killed once"])
    print("same parameters, bit for bit" if same else "parameters DIFFER")
    if not restarted:
        print(f"the killed job was not restarted once from step "
              f"{KILL_AT // EVERY * EVERY}")
    return 0 if same and restarted else 1


if __name__ == "__main__":
    sys.exit(main())
