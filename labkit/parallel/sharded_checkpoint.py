"""Sharded checkpoints (分片检查点) with torch.distributed.checkpoint (DCP): each
rank writes only its shards of the training state (parameters, optimizer state,
step); the files load on any number of ranks, or in one process.

    save_sharded(path, fsdp, opt, step=2)       # on the 4 ranks that trained
    step = load_sharded(path, fsdp, opt)        # a new job, on 2 ranks
    full = load_full_state_dict(path)           # one process, no ranks

Imports labkit.parallel's fsdp and checkpoint_files. labkit's FSDP shards are saved
as DTensor Shard(0) pieces of each flat parameter, so DCP reshards them on load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from labkit.parallel.checkpoint_files import (  # noqa: F401 (re-exported)
    CheckpointBytes,
    FileBytes,
    checkpoint_bytes,
    dcp_load,
    dcp_save,
    flat_planner,
    is_tensor_entry,
    load_full_state_dict,
    nest,
    read_metadata,
    read_values,
)
from labkit.parallel.fsdp import FullyShardedDataParallel

# torch.distributed.checkpoint and DTensor are imported where they are used:
# importing them is slow (`python -X importtime` shows how slow), which
# `import labkit.parallel` should not pay


def _dsd():
    import torch.distributed.checkpoint.state_dict as dsd

    return dsd


@dataclass(eq=False)
class _Entry:
    """A parameter (or persistent buffer) of a FullyShardedDataParallel model."""

    names: list           # the first: the name it is saved under
    tensor: torch.Tensor  # what this rank holds: the padded 1-D shard, or all of it
    shape: tuple          # the parameter's own shape
    numel: int
    s: int | None         # shard length; None: whole on every rank

    def piece(self, rank: int) -> int:
        """How many of this rank's s elements are real (not padding)."""
        return max(0, min(self.s, self.numel - rank * self.s))


def _entries(fsdp: FullyShardedDataParallel) -> dict[int, _Entry]:
    """id(the tensor a rank holds) -> _Entry, in module order."""
    sharded = {id(t): p for u in fsdp.sharded_units for p in u.params
               for t in (p.shard, p.leaf)}  # the module holds one or the other
    out: dict[int, _Entry] = {}
    for name, t in fsdp.module.named_parameters(remove_duplicate=False):
        p = sharded.get(id(t))
        t = t if p is None else p.shard
        if id(t) in out:
            out[id(t)].names.append(name)
        else:
            out[id(t)] = _Entry([name], t, tuple(p.shape), p.numel, p.s) if p else \
                _Entry([name], t, tuple(t.shape), t.numel(), None)
    kept = fsdp.module.state_dict(keep_vars=True)  # persistent buffers only
    for name, b in fsdp.module.named_buffers():
        if name in kept:
            out[id(b)] = _Entry([name], b, tuple(b.shape), b.numel(), None)
    return out


def _dtensor(local: torch.Tensor, e: _Entry, mesh):
    """This rank's piece of a flat (numel,) parameter, padding cut off, as
    DTensor's Shard(0) piece: DCP records its offset and reshards on load."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                              shape=torch.Size([e.numel]), stride=(1,))


def _mesh(fsdp: FullyShardedDataParallel, entries: dict):
    from torch.distributed.device_mesh import DeviceMesh

    device = next(iter(entries.values())).tensor.device.type
    return DeviceMesh.from_group(fsdp.group, device)


def _group_names(optimizer, entries: dict) -> list[list[str]]:
    """Each param group's parameters, by the name each is saved under."""
    out = []
    for i, g in enumerate(optimizer.param_groups):
        if any(id(p) not in entries for p in g["params"]):
            raise ValueError(
                f"the optimizer's param group {i} holds a tensor that is not a "
                "parameter of this model: build it over the wrapped model's "
                "parameters (the shards)")
        out.append([entries[id(p)].names[0] for p in g["params"]])
    return out


# -- save ------------------------------------------------------------------------


def save_sharded(path, model: torch.nn.Module, optimizer=None, *, step: int = 0
                 ) -> None:
    """Write model's parameters and buffers, optimizer's state and `step` into
    the directory `path`, each rank its own shards. Collective: every rank calls
    it. model: labkit's FullyShardedDataParallel, or what get_state_dict takes.
    Whole or not at all: written beside `path` (path.saving) and renamed to
    `path` once every rank has written; a checkpoint already there stays as it
    was until then. ValueError, before anything is written, if `path` holds
    files that are not a checkpoint's."""
    dsd = _dsd()
    if isinstance(model, FullyShardedDataParallel):
        state, group = _ours(model, optimizer), model.group
    elif optimizer is None:
        state, group = {"model": dsd.get_model_state_dict(model)}, None
    else:
        state, group = dict(zip(("model", "optim"),
                                dsd.get_state_dict(model, optimizer))), None
    state["step"] = int(step)
    dcp_save(path, state, group)


def _ours(fsdp: FullyShardedDataParallel, optimizer) -> dict:
    entries = _entries(fsdp)
    mesh, r = _mesh(fsdp, entries), fsdp.dp_rank
    model, layout = {}, {"shapes": {}, "tied": {}}
    for e in entries.values():
        t = e.tensor.detach()
        model[e.names[0]] = t if e.s is None else _dtensor(t[:e.piece(r)], e, mesh)
        layout["shapes"][e.names[0]] = list(e.shape)
        # a tied weight is saved once, under its first name; "layout" keeps the
        # other names and every shape, for load_full_state_dict
        layout["tied"].update({alias: e.names[0] for alias in e.names[1:]})
    out = {"model": model, "layout": json.dumps(layout)}
    if optimizer is not None:
        groups = _group_names(optimizer, entries)
        state = {}
        for p, st in optimizer.state.items():
            e = entries[id(p)]
            state[e.names[0]] = {k: _dtensor(v.detach()[:e.piece(r)], e, mesh)
                                 if e.s is not None and torch.is_tensor(v)
                                 and v.shape == p.shape else v
                                 for k, v in st.items()}
        out["optim"] = {"state": state, "param_groups": [
            {**g, "params": names} for g, names in zip(optimizer.param_groups,
                                                       groups)]}
    return out


# -- load ------------------------------------------------------------------------


def load_sharded(path, model: torch.nn.Module, optimizer=None) -> int:
    """Fill model's parameters (this rank's shards, on any number of ranks) and
    buffers, and optimizer's state, from the checkpoint at `path`; return its
    step. Collective: every rank calls it, with the model wrapped and the
    optimizer built as for training."""
    md = read_metadata(path)
    objects = nest(read_values(path, md), md)
    layout = json.loads(objects["layout"]) if "layout" in objects else None
    if optimizer is not None and "optim" not in objects:
        raise ValueError(f"{path} holds no optimizer state (saved without an "
                         "optimizer): call load_sharded without one")
    ours = isinstance(model, FullyShardedDataParallel)
    if ours != (layout is not None):
        raise ValueError(
            f"{path} was saved from " + ("FSDP2 or a plain module (tensors in their "
                                         "own shapes)" if ours else
                                         "labkit's FullyShardedDataParallel (flat "
                                         "shards)") + ": load it into that kind of "
            "model, or in one process with load_full_state_dict")
    if ours:
        _load_ours(path, md, objects, layout, model, optimizer)
        return objects["step"]
    dsd = _dsd()
    msd, osd = (dsd.get_model_state_dict(model), None) if optimizer is None else \
        dsd.get_state_dict(model, optimizer)
    saved = {p[1]: tuple(md.state_dict_metadata[k].size)
             for k, p in md.planner_data.items() if p[0] == "model"
             and is_tensor_entry(md.state_dict_metadata[k])}
    _check_fits(path, {k: tuple(v.shape) for k, v in msd.items()}, saved)
    state = {"model": msd}
    if optimizer is not None:  # a parameter that never had a gradient: no state
        have = {p[2] for p in md.planner_data.values() if p[:2] == ("optim", "state")}
        osd["state"] = {k: v for k, v in osd["state"].items() if k in have}
        state["optim"] = osd
    dcp_load(path, state)
    if optimizer is None:
        dsd.set_model_state_dict(model, state["model"])
    else:  # strict=False lets those stay without state; names were checked above
        dsd.set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"],
                           options=dsd.StateDictOptions(strict=False))
    return objects["step"]


def _load_ours(path, md, objects, layout, fsdp, optimizer) -> None:
    entries = _entries(fsdp)
    mesh, r = _mesh(fsdp, entries), fsdp.dp_rank
    by_name = {e.names[0]: e for e in entries.values()}
    saved = {n: tuple(s) for n, s in layout["shapes"].items()}
    saved.update({alias: saved[n] for alias, n in layout["tied"].items()})
    _check_fits(path, {n: e.shape for e in entries.values() for n in e.names}, saved)
    if by_name.keys() != layout["shapes"].keys():
        raise ValueError(f"{path}: weights tied differently: saved as one "
                         f"{_few(sorted(layout['tied']))}; this model's own "
                         f"{_few(sorted(set(by_name) - set(layout['shapes'])))}")
    if optimizer is not None:
        groups = _group_names(optimizer, entries)
        want = [g["params"] for g in objects["optim"]["param_groups"]]
        if [sorted(g) for g in groups] != [sorted(g) for g in want]:
            raise ValueError(
                f"{path}: the optimizer's param groups hold {[len(g) for g in groups]}"
                f" parameters, the checkpoint's {[len(g) for g in want]}, or others: "
                "build it over the same parameters, in the same groups")
    flat = {}  # DCP's flattened keys -> where each tensor loads
    for key, where in md.planner_data.items():
        m = md.state_dict_metadata[key]
        if not is_tensor_entry(m) or (optimizer is None and where[0] == "optim"):
            continue
        e = by_name[where[1] if where[0] == "model" else where[2]]
        if e.s is not None and tuple(m.size) == (e.numel,):  # a flat DTensor
            flat[key] = _dtensor(e.tensor.new_empty(e.piece(r), dtype=m.properties
                                                    .dtype), e, mesh)
        else:
            flat[key] = e.tensor.new_empty(m.size, dtype=m.properties.dtype)
    dcp_load(path, flat, process_group=fsdp.group, planner=flat_planner())

    def held(v, e):  # as this rank holds it: its piece, zero padding after
        v = v.to_local() if hasattr(v, "to_local") else v  # a DTensor
        return v if e.s is None or v.dim() == 0 else torch.cat(
            [v, v.new_zeros(e.s - v.numel())])

    tree = nest(flat, md)
    with torch.no_grad():
        for name, v in tree["model"].items():
            by_name[name].tensor.copy_(held(v, by_name[name]))
    if optimizer is not None:
        index = {n: i for i, n in enumerate(n for g in groups for n in g)}
        state: dict = {}  # tensors from `tree`, other values from `objects`
        for part in (objects["optim"], tree.get("optim", {})):
            for n, st in part.get("state", {}).items():
                state.setdefault(index[n], {}).update(
                    {k: held(v, by_name[n]) if torch.is_tensor(v) else v
                     for k, v in st.items()})
        optimizer.load_state_dict({"state": state, "param_groups": [
            {**g, "params": [index[n] for n in names]}
            for g, names in zip(objects["optim"]["param_groups"], groups)]})


# -- reading .metadata and the values beside the tensors --------------------------


def _check_fits(path, mine: dict, saved: dict) -> None:
    """A clear error if the names or shapes of the model and the checkpoint differ."""
    only_saved, only_mine = sorted(saved.keys() - mine), sorted(mine.keys() - saved)
    shapes = [f"{n}: saved {saved[n]}, this model's {mine[n]}"
              for n in sorted(saved.keys() & mine) if saved[n] != mine[n]]
    said = [f"{what}: {_few(names)}" for what, names in (
        ("in the checkpoint, not in the model", only_saved),
        ("in the model, not in the checkpoint", only_mine),
        ("shapes differ", shapes)) if names]
    if said:
        raise ValueError(f"{path} does not fit this model: " + "; ".join(said))


def _few(items: list, n: int = 4) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n
                                   else "")


