"""3D parallelism on 8 real gloo ranks, DP(2) x PP(2) x TP(2), against one process
training the same TinyGPT: losses, gradients and every weight after several SGD
steps, and the bytes each rank holds and sends in each of its three groups.

Tolerance: a sum in another order (a row-parallel layer's halves, two shards'
gradients, micro-batches) differs in the last bits, so each rank's weights,
gradients and the losses must be as far from the float64 answer as one process's
float32 run is (labkit.numerics.Oracle: the whole batch, and its 4 micro-batches
summed as the ranks cut it). Leaving out the data-parallel average puts the
weights off by orders of magnitude more."""

import copy

import pytest
import torch

import labkit
from labkit.numerics import Oracle
from labkit.parallel.models import TinyGPT, lm_loss
from labkit.parallel.three_d import ThreeD, stage_layers
from labkit.theory import layer_params, layer_traffic, ring_bytes_per_rank

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels

CFG = dict(vocab=64, seq=16, hidden=32, heads=4, layers=2)
B, M, STEPS, LR = 8, 2, 3, 0.1
TP = PP = DP = 2


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    t = torch.randint(0, CFG["vocab"], (B, CFG["seq"] + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def reference(dtype=torch.float32, pieces=1):
    """One process: the losses of each step, the model after STEPS steps and the
    last step's gradients, in `dtype`; the batch's loss the mean of `pieces`
    equal parts' (1: all at once)."""
    torch.manual_seed(0)
    model = TinyGPT(**CFG).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for s in range(STEPS):
        x, y = batch(s)
        opt.zero_grad()
        loss = sum(lm_loss(model(xs), ys) / pieces
                   for xs, ys in zip(x.chunk(pieces), y.chunk(pieces)))
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return model, grads, torch.stack(losses)


RUNS = {"whole batch": 1, f"{DP * M} micro-batches": DP * M}  # one process, fp32


def _part(model, g):
    """This rank's part of a one-process model, in its dtype: {name: tensor}."""
    return {k: p.detach() for k, p in
            torch.nn.Sequential(*stage_layers(model, g)).named_parameters()}


def _as_weights(model, grads):
    """A copy of `model` whose weights are `grads`."""
    out = copy.deepcopy(model)
    for k, p in out.named_parameters():
        p.data = grads[k]
    return out


def _train(rank, world_size, refs):
    from labkit.ledger import memory, traffic
    from labkit.parallel.groups import ParallelGroups

    g = ParallelGroups.build(tp=TP, pp=PP, dp=DP)
    torch.manual_seed(0)
    run = ThreeD(TinyGPT(**CFG), g, microbatches=M)
    opt = torch.optim.SGD(run.parameters(), lr=LR)
    losses = []
    with memory(run, opt) as mem:
        for s in range(STEPS):
            x, y = batch(s)
            opt.zero_grad()
            with traffic() as t:  # the last step's is kept (no shape header)
                loss = run.step(x, y)
            losses.append(None if loss is None else loss.item())
            grads = {k: p.grad.clone() for k, p in run.module.named_parameters()}
            opt.step()
    # this rank's part of each reference: weights, and gradients the same way
    names = [k for k, _ in run.module.named_parameters()]
    parts = {}
    for run_name, (ref, ref_grad) in refs.items():
        w, gr = _part(ref, g), _part(_as_weights(ref, ref_grad), g)
        parts[run_name] = {"weight": {k: w[k] for k in names},
                           "grad": {k: gr[k] for k in names}}
    torch.manual_seed(0)
    start = _part(TinyGPT(**CFG), g)
    got = {"weight": {k: p.detach().clone() for k, p in
                      run.module.named_parameters()}, "grad": grads,
           "start": {k: start[k] for k in names}}
    groups = {"tp": g.tp_ranks, "pp": g.pp_ranks, "dp": g.dp_ranks}
    return (g.pp_rank, g.dp_rank, losses, (got, parts), t.by_group(groups),
            t.records, mem.current, sum(p.numel() for p in run.parameters()))


@pytest.fixture(scope="module")
def trained():
    exact = reference(torch.float64)
    runs = {name: reference(pieces=k) for name, k in RUNS.items()}
    refs = {"exact": exact[:2], **{name: r[:2] for name, r in runs.items()}}
    losses = Oracle(exact[2], {name: r[2] for name, r in runs.items()})
    with labkit.Cluster(TP * PP * DP, timeout=60) as c:
        return losses, c.run(_train, refs)


def test_losses_match_one_process(trained):
    oracle, res = trained
    last = [r for r in res if r[0] == PP - 1]  # the last stage has the loss
    assert len(last) == TP * DP and all(
        r[0] != PP - 1 for r in res if r[2][0] is None), [r[:3] for r in res]
    # the global batch's loss: the mean of the dp shards' (equal sizes)
    by_dp = {r[1]: torch.tensor(r[2]) for r in last}
    assert set(by_dp) == set(range(DP)), sorted(by_dp)
    oracle.check(sum(by_dp.values()) / DP, f"the losses of {STEPS} steps")


def test_every_weight_and_gradient_matches_one_process(trained):
    for rank, r in enumerate(trained[1]):
        got, parts = r[3]
        exact = parts.pop("exact")
        for what in ("weight", "grad"):
            oracle = Oracle(exact[what], {n: p[what] for n, p in parts.items()})
            oracle.check(got[what], f"rank {rank}: every {what} of its part")
        oracle = Oracle(exact["weight"], {n: p["weight"] for n, p in parts.items()})
        oracle.resolves(got["start"], f"rank {rank}: its untrained part")


def test_parameters_per_rank_are_the_stage_s_tensor_shard(trained):
    h, V, s = CFG["hidden"], CFG["vocab"], CFG["seq"]
    per_block = layer_params(h, TP).total  # blocks per stage: 1
    expected = {0: V * h + s * h + per_block, 1: per_block + 2 * h + V * h}
    for rank, r in enumerate(trained[1]):
        pp_rank, current, n = r[0], r[6], r[7]
        assert n == expected[pp_rank], (f"rank {rank}: {n:,} parameters, "
                                        f"{expected[pp_rank]:,} expected")
        held = (current["Parameter"], current["Gradient"])
        assert held == (4 * n, 4 * n), (f"rank {rank}: {held} B of parameters and "
                                        f"gradients, 4 x {n:,} each expected")


def test_traffic_by_parallel_dimension_matches_the_closed_forms(trained):
    h, s = CFG["hidden"], CFG["seq"]
    mb = B // DP // M  # rows per micro-batch
    act = mb * s * h * 4  # bytes of one activation between stages
    blocks = CFG["layers"] // PP
    tp = layer_traffic(mb, s, h, TP, elem_bytes=4)
    for rank, r in enumerate(trained[1]):
        groups, n_params = r[4], r[7]
        assert set(groups) == {"tp", "pp", "dp"}, sorted(groups)
        want = {  # pp: stage 0 sends M activations, stage 1 M gradients;
            # each receives M
            ("tp", "calls"): blocks * M * tp.all_reduces,
            ("tp", "bus_bytes"): blocks * M * tp.bytes_per_rank,
            ("pp", "calls"): 2 * M, ("pp", "sent"): M * act,
            ("pp", "payload_bytes"): 2 * M * act, ("dp", "calls"): 1,
            ("dp", "bus_bytes"): ring_bytes_per_rank("all_reduce", 4 * n_params, DP)}
        got = {(d, f): groups[d][f] for d, f in want}
        assert got == want, f"rank {rank}: {got}, expected {want}"
        for dim in ("tp", "dp"):  # gloo adds a small header to every call
            extra = groups[dim]["wire_bytes"] - groups[dim]["bus_bytes"]
            assert 0 <= extra <= 1024 * groups[dim]["calls"], (
                f"rank {rank}, {dim}: {extra:,} B beyond the bus bytes, at most "
                f"1024 a call allowed")


def test_each_record_travelled_in_one_of_the_rank_s_three_groups(trained):
    for rank, r in enumerate(trained[1]):
        from labkit.parallel.groups import grid

        lists = grid(TP * PP * DP, TP, PP, DP)
        mine = {tuple(x) for d in ("tp", "pp", "dp") for x in lists[d] if rank in x}
        seen = {rec.group_ranks for rec in r[5]}
        assert seen == mine, f"rank {rank}: groups {seen}, its own {mine} expected"


def _bad_sizes(rank, world_size):
    from labkit.parallel.groups import ParallelGroups

    g = ParallelGroups.build(tp=2, pp=2, dp=1)
    errors = []
    for kw, micro, rows in ((dict(heads=3, hidden=30), 1, 4),
                            (dict(layers=3), 1, 4), ({}, 3, 4)):
        try:
            run = ThreeD(TinyGPT(**{**CFG, **kw}), g, microbatches=micro)
            x, y = batch(0)
            run.step(x[:rows], y[:rows])
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_sizes_that_cannot_be_split_raise_a_clear_value_error():
    with labkit.Cluster(4, timeout=30) as c:
        errors = c.run(_bad_sizes)[0]
    assert len(errors) == 3, len(errors)
    assert "heads = 3" in errors[0] and "tp = 2" in errors[0], errors[0]
    assert "5 layers" in errors[1] and "2 equal stages" in errors[1], errors[1]
    assert "4 rows" in errors[2] and "dp = 1" in errors[2] and (
        "3 micro" in errors[2]), errors[2]
