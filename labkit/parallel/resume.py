"""Resuming a data-parallel run exactly (精确恢复训练): each step's samples from
(seed, epoch, step) alone (`ResumableSampler`), every rank's random streams
(`rng_state`), and a training state saved whole or not at all
(`save_train_state` / `load_train_state`, on checkpoint_files' temp-and-rename).

Imports labkit.parallel's checkpoint_files, sharded_checkpoint, data_parallel and
fsdp. The global batch never depends on dp_size, so a run resumes on fewer ranks
with the same data; RNG streams are per rank, so dropout there cannot match.
"""

from __future__ import annotations

import json
import pickle
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from labkit.arguments import whole
from labkit.parallel.checkpoint_files import dcp_save, nest, read_metadata, read_values
from labkit.parallel.data_parallel import DataParallel
from labkit.parallel.fsdp import FullyShardedDataParallel
from labkit.parallel.sharded_checkpoint import load_sharded

# what a sampler's state must share with the checkpoint's: else the samples differ
_SAME = ("n_samples", "global_batch", "seed")


class ResumableSampler:
    """This data-parallel rank's sample indices, step by step, resumable.

    Each epoch is a permutation of range(n_samples) drawn from (seed, epoch)
    alone; step k of it is the global batch perm[k*G:(k+1)*G] (G = global_batch;
    the last n_samples % G of a permutation are left out, as drop_last does).
    Rank r of dp_size takes its r-th contiguous slice of G/dp_size, so the global
    batch, the ranks' slices in rank order, is the same on any dp_size.
    `next(sampler)` returns this rank's indices (a LongTensor) and moves on.
    """

    def __init__(self, n_samples: int, global_batch: int, *, seed: int = 0,
                 dp_rank: int = 0, dp_size: int = 1):
        n_samples = whole(n_samples, "n_samples")
        global_batch = whole(global_batch, "global_batch", 1, n_samples)
        dp_size = whole(dp_size, "dp_size")
        dp_rank = whole(dp_rank, "dp_rank", 0, dp_size - 1)
        seed = whole(seed, "seed", 0)
        if global_batch % dp_size:
            raise ValueError(f"global_batch {global_batch} is not a multiple of "
                             f"dp_size {dp_size}: the ranks' shares would differ")
        self.n_samples, self.global_batch, self.seed = n_samples, global_batch, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.epoch, self.step = 0, 0  # the next step to hand out
        self._perm: tuple[int, torch.Tensor] | None = None  # (epoch, its permutation)

    @property
    def steps_per_epoch(self) -> int:
        return self.n_samples // self.global_batch

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.dp_size

    def permutation(self, epoch: int) -> torch.Tensor:
        """Epoch `epoch`'s order of the samples, from its own generator (the
        global ones are the model's: drawing from them here would move dropout)."""
        if self._perm is None or self._perm[0] != epoch:
            mixed = np.random.SeedSequence((self.seed, epoch)).generate_state(1)[0]
            g = torch.Generator().manual_seed(int(mixed))
            self._perm = (epoch, torch.randperm(self.n_samples, generator=g))
        return self._perm[1]

    def global_indices(self, epoch: int, step: int) -> torch.Tensor:
        """The global batch of `step` in `epoch`: every rank's indices, in order."""
        if not 0 <= step < self.steps_per_epoch:
            raise ValueError(f"step must be in 0..{self.steps_per_epoch - 1} (an "
                             f"epoch has {self.steps_per_epoch} steps), got {step}")
        g = self.global_batch
        return self.permutation(epoch)[step * g:(step + 1) * g]

    def indices(self, epoch: int, step: int) -> torch.Tensor:
        """This rank's share of global_indices(epoch, step)."""
        b = self.per_rank
        return self.global_indices(epoch, step)[self.dp_rank * b:(self.dp_rank + 1) * b]

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        out = self.indices(self.epoch, self.step)
        self.step += 1
        if self.step == self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        """The position (the next step to hand out) and what fixes the order;
        dp_size is kept for the record only: the order does not depend on it."""
        return {"epoch": self.epoch, "step": self.step, "n_samples": self.n_samples,
                "global_batch": self.global_batch, "seed": self.seed,
                "dp_size": self.dp_size}

    def load_state_dict(self, state: dict) -> None:
        """Go to the saved position; ValueError, changing nothing, if the saved
        sampler's samples, global batch or seed differ from this one's."""
        problem = self.mismatch(state)
        if problem:
            raise ValueError(problem)
        self.epoch, self.step = int(state["epoch"]), int(state["step"])

    def mismatch(self, state: dict) -> str | None:
        """Why this sampler cannot take `state`, or None."""
        differ = [f"{k} {state.get(k)} saved, {getattr(self, k)} here" for k in _SAME
                  if state.get(k) != getattr(self, k)]
        if differ:
            return ("the checkpoint's sampler does not fit this one (" +
                    "; ".join(differ) + "): resuming would feed other samples than "
                    "the run saw. Build the sampler with the saved values (dp_size "
                    "may differ; the global batch may not)")
        if not 0 <= int(state["step"]) < self.steps_per_epoch:
            return f"saved step {state['step']} is outside an epoch here"
        return None

    def __repr__(self) -> str:
        return (f"ResumableSampler(n_samples={self.n_samples}, global_batch="
                f"{self.global_batch}, seed={self.seed}, dp_rank={self.dp_rank}, "
                f"dp_size={self.dp_size}; epoch {self.epoch}, step {self.step})")


# -- every random stream a rank draws from --------------------------------------------


def rng_state() -> dict:
    """This process's random streams: torch's CPU generator (and every CUDA
    device's, where there is CUDA), numpy's global generator, Python's random."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Put back what rng_state() returned (CUDA: on the devices both have)."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"][:torch.cuda.device_count()]
        for i, s in enumerate(cuda):
            torch.cuda.set_rng_state(s, i)


# -- the training state in one checkpoint ---------------------------------------------


def _rank_and_size(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _plain(model: torch.nn.Module, what: str) -> torch.nn.Module:
    """The module whose state is saved: DataParallel's inner one (so the names,
    and the checkpoint, are the same with or without it)."""
    if isinstance(model, FullyShardedDataParallel):
        raise TypeError(
            f"{what}: labkit's FullyShardedDataParallel saves its flat shards with "
            "save_sharded, which takes no sampler or RNG state yet; wrap the model "
            "with PyTorch's fully_shard (FSDP2) or DataParallel here")
    return model.module if isinstance(model, DataParallel) else model


def save_train_state(path, model: torch.nn.Module, optimizer=None,
                     sampler: ResumableSampler | None = None, step: int = 0, *,
                     group=None) -> None:
    """Save what resuming needs into the folder `path`, whole or not at all:
    model and optimizer state (as save_sharded), `step`, the sampler's position
    and every rank's random streams (rng_state). Collective: every rank of
    `group` (default: all) calls it. The random streams are left as they were
    (what the save draws is given back), so a run that saves draws the same
    dropout masks as one that does not."""
    rng = rng_state()  # first: nothing below may move a stream before it is kept
    try:
        module = _plain(model, "save_train_state")
        import torch.distributed.checkpoint.state_dict as dsd

        rank, size = _rank_and_size(group)
        if optimizer is None:
            state = {"model": dsd.get_model_state_dict(module)}
        else:
            state = dict(zip(("model", "optim"), dsd.get_state_dict(module, optimizer)))
        state.update({
            "step": int(step), "ranks": size,
            # the same on every rank (the checkpoint keeps one copy)
            "sampler": json.dumps(sampler.state_dict() if sampler else None),
            # each rank's own, under its own name
            "rng": {f"rank{rank}": pickle.dumps(rng)}})
        dcp_save(path, state, group)
    finally:
        set_rng_state(rng)


@dataclass(frozen=True)
class Resumed:
    """What load_train_state restored on this rank."""

    step: int              # the step saved with it: the next one to run
    saved_ranks: int       # how many ranks saved it
    rng_from: int | None   # the saved rank whose random streams this rank took


def load_train_state(path, model: torch.nn.Module, optimizer=None,
                     sampler: ResumableSampler | None = None, *, rng: bool = True,
                     group=None) -> Resumed:
    """Restore a save_train_state checkpoint, on any number of ranks: the model,
    `optimizer` and `sampler` when given, and with rng=True this rank's random
    streams. Collective: every rank of `group` (default: all) calls it.

    Rank r takes saved rank r's streams; on fewer ranks the others' are left
    unused, on more ranks a new rank keeps its own (rng_from None). Streams are
    per rank and a rank's share of the batch changes with dp_size, so dropout
    masks then differ from the run that saved. Refused before anything changes:
    a missing or unfinished checkpoint (read_metadata names it), one saved
    without a sampler or RNG, a sampler whose global batch or seed differ."""
    md = read_metadata(path)
    objects = nest(read_values(path, md), md)
    if "rng" not in objects or "sampler" not in objects:
        raise ValueError(f"{path!r} holds no sampler position or random streams: "
                         "not saved by save_train_state (load_sharded loads it)")
    saved_sampler = json.loads(objects["sampler"])
    if sampler is not None:
        if saved_sampler is None:
            raise ValueError(f"{path!r} was saved without a sampler: load it "
                             "without one")
        problem = sampler.mismatch(saved_sampler)
        if problem:
            raise ValueError(f"{path!r}: {problem}")
    step = load_sharded(path, _plain(model, "load_train_state"), optimizer)
    if sampler is not None:
        sampler.load_state_dict(saved_sampler)
    rank, _ = _rank_and_size(group)
    mine = objects["rng"].get(f"rank{rank}")
    if rng and mine is not None:  # last: loading may not move a stream after it
        set_rng_state(pickle.loads(mine))
    return Resumed(step, objects["ranks"],
                   rank if rng and mine is not None else None)
