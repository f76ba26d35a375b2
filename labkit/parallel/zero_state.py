"""ShardedOptimizer's checkpoints (zero.py's helper): `state_dict()` gathers the
slices into what `optimizer_cls` itself would save, whole; `load_state_dict()` takes
that, or a torch.optim state dict, on any number of ranks and keeps this rank's
slice. `opt` is the ShardedOptimizer."""

from __future__ import annotations

import torch
import torch.distributed as dist


def state_dict(opt) -> dict:
    """What `optimizer_cls` itself would save, whole: collective, call it on every
    rank. Element-wise state (Adam's m and v) is all-gathered from the slices."""
    state, groups = {}, []
    for g, grp, inner in zip(opt.param_groups, opt.groups,
                             opt.inner.param_groups):
        index = {p: sum(len(x["params"]) for x in groups) + j
                 for j, p in enumerate(g["params"])}
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": list(index.values())})
        whole, each = {}, set()
        for k, v in opt.inner.state.get(inner["params"][0], {}).items():
            whole[k] = v
            if torch.is_tensor(v) and v.dim() == 1 and grp.s:  # per element
                mine = v.new_zeros(grp.s)
                mine[:v.numel()] = v
                whole[k] = v.new_empty(opt.dp_size * grp.s)
                dist.all_gather_single(whole[k], mine, group=opt.process_group)
                each.add(k)
        for p in grp.params if whole else ():
            if p not in grp.stepped:  # never got a gradient: torch.optim has none
                continue
            a = grp.offset[p]
            state[index[p]] = {
                k: v[a:a + p.numel()].view_as(p).clone() if k in each
                else v.clone() if torch.is_tensor(v) else v
                for k, v in whole.items()}
    return {"state": state, "param_groups": groups}


def load_state_dict(opt, state_dict: dict) -> None:
    """Load a `state_dict()` of this class or of `optimizer_cls` (same groups, any
    number of ranks): each rank keeps its slice. No communication."""
    saved = state_dict["param_groups"]
    if [len(x["params"]) for x in saved] != [len(g["params"])
                                              for g in opt.param_groups]:
        raise ValueError("the state dict's param groups do not match this "
                         "optimizer's (number of groups or parameters in each)")
    for g, grp, inner, sg in zip(opt.param_groups, opt.groups,
                                 opt.inner.param_groups, saved):
        g.update({k: v for k, v in sg.items() if k != "params"})
        index = dict(zip(g["params"], sg["params"]))
        per = [state_dict["state"].get(index[p]) for p in grp.params]
        piece = inner["params"][0]
        opt.inner.state.pop(piece, None)
        # a parameter without state was never stepped (torch.optim saves none):
        # its elements start at zero; counters are the first parameter's
        grp.stepped = {p for p, st in zip(grp.params, per) if st}
        if not grp.stepped:
            continue
        p0, first = next((p, st) for p, st in zip(grp.params, per) if st)
        mine = {}
        for k, v in first.items():
            mine[k] = v.clone() if torch.is_tensor(v) else v
            # per element: shaped like the parameter (a 0-d one's step is not)
            if torch.is_tensor(v) and v.shape == p0.shape and (v.dim() or
                                                                k != "step"):
                parts = [st[k].reshape(-1)[slice(*grp.part(p))] if st else
                         v.new_zeros(grp.part(p)[1] - grp.part(p)[0])
                         for p, st in zip(grp.params, per)]
                mine[k] = torch.cat(parts).to(piece)
        opt.inner.state[piece] = mine
