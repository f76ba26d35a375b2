"""labkit.parallel.tensor_parallel on 4 gloo ranks, with tensor-parallel groups of 2
(ParallelGroups tp=2, dp=2: ranks {0, 1} and {2, 3}) and of 4 (the world): every
mapping's forward and backward against what it must compute from every rank's
tensors; the two Linear layers, the MLP and self-attention against the
single-process modules they are sliced from (outputs, input gradients, weight
gradients, several SGD steps); the traffic ledger's all-reduces; PyTorch's
DTensor ColwiseParallel / RowwiseParallel on the same MLP."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit.parallel.tensor_parallel import MLP, SelfAttention

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels

S, B, H, HEADS, FFN = 8, 2, 16, 4, 32  # sequence, batch, hidden, heads, MLP width
TOL = 1e-6  # relative to a tensor's largest element: t partial sums added in
# another order than one matmul adds them (about 1e-7 apart in fp32)
_BUILT = {}  # per rank process: the groups of each size, built once


def _group(t):
    """(tp group, this rank's index in it, its global ranks); t = 4: the world."""
    import torch.distributed as dist

    from labkit.parallel.groups import ParallelGroups

    if t == dist.get_world_size():
        return None, dist.get_rank(), list(range(t))
    if t not in _BUILT:
        _BUILT[t] = ParallelGroups.build(tp=t, dp=dist.get_world_size() // t)
    g = _BUILT[t]
    return g.tp_group, g.tp_rank, list(g.tp_ranks)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# -- the mappings ---------------------------------------------------------------

MAPPINGS = ("copy_to_tensor_model_parallel_region",
            "reduce_from_tensor_model_parallel_region",
            "scatter_to_tensor_model_parallel_region",
            "gather_from_tensor_model_parallel_region",
            "scatter_to_sequence_parallel_region",
            "gather_from_sequence_parallel_region",
            "reduce_scatter_to_sequence_parallel_region")
X_SHAPE = (S, B, 12)  # dim 0 and the last dim divide by 2 and by 4


def _mappings(rank, world_size, t):
    from labkit.ledger import traffic
    from labkit.parallel import tensor_parallel as tp

    group, i, ranks = _group(t)
    out = {"i": i, "ranks": ranks}
    for name in MAPPINGS:
        x = _randn(X_SHAPE, 100 + rank).requires_grad_()
        with traffic() as led:
            y = getattr(tp, name)(x, group)
            y.backward(_randn(y.shape, 200 + rank))
        out[name] = {"y": y.detach(), "dx": x.grad,
                     "ops": [(r.op, r.phase, r.group_size, r.elements)
                             for r in led.records]}
    return out


def _expected(name, i, ranks):
    """(y, dx, ops) rank i of `ranks` must see, from every rank's tensors."""
    t = len(ranks)
    xs = [_randn(X_SHAPE, 100 + r) for r in ranks]
    x, n = xs[i], xs[i].numel()
    k, rows = X_SHAPE[-1] // t, X_SHAPE[0] // t
    last, first = slice(i * k, (i + 1) * k), slice(i * rows, (i + 1) * rows)
    # a gather's input is a whole x: its backward keeps x's place in the output
    own_last = slice(i * X_SHAPE[-1], (i + 1) * X_SHAPE[-1])
    own_first = slice(i * X_SHAPE[0], (i + 1) * X_SHAPE[0])
    y = {"copy_to_tensor_model_parallel_region": x,
         "reduce_from_tensor_model_parallel_region": sum(xs),
         "scatter_to_tensor_model_parallel_region": x[..., last],
         "gather_from_tensor_model_parallel_region": torch.cat(xs, -1),
         "scatter_to_sequence_parallel_region": x[first],
         "gather_from_sequence_parallel_region": torch.cat(xs, 0),
         "reduce_scatter_to_sequence_parallel_region": sum(xs)[first]}[name]
    dys = [_randn(y.shape, 200 + r) for r in ranks]
    dy = dys[i]
    dx, fwd, bwd = {
        "copy_to_tensor_model_parallel_region": (sum(dys), None, ("all_reduce", n)),
        "reduce_from_tensor_model_parallel_region": (dy, ("all_reduce", n), None),
        "scatter_to_tensor_model_parallel_region": (
            torch.cat(dys, -1), None, ("all_gather", n)),
        "gather_from_tensor_model_parallel_region": (
            dy[..., own_last], ("all_gather", t * n), None),
        "scatter_to_sequence_parallel_region": (
            torch.cat(dys, 0), None, ("all_gather", n)),
        "gather_from_sequence_parallel_region": (
            sum(dys)[own_first], ("all_gather", t * n), ("all_to_all", t * n)),
        "reduce_scatter_to_sequence_parallel_region": (
            torch.cat(dys, 0), ("all_to_all", n), ("all_gather", n)),
    }[name]
    ops = [(op, phase, t, e) for phase, oe in (("other", fwd), ("backward", bwd))
           if oe for op, e in [oe]]
    return y, dx, ops


@pytest.fixture(scope="module")
def mapped(cluster):
    return {t: cluster.run(_mappings, t).values for t in (2, 4)}


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("name", MAPPINGS)
def test_each_mapping_forward_and_backward(mapped, t, name):
    for rank, r in enumerate(mapped[t]):
        assert rank in r["ranks"] and len(r["ranks"]) == t
        y, dx, ops = _expected(name, r["i"], r["ranks"])
        got = r[name]
        assert got["y"].shape == y.shape and got["dx"].shape == dx.shape
        assert rel_err(got["y"], y) <= TOL, (rank, "forward")
        assert rel_err(got["dx"], dx) <= TOL, (rank, "backward")
        assert got["ops"] == ops  # the collective each way, and its elements


# -- the Linear layers ------------------------------------------------------------

IN, OUT = 12, 8


def _linears(rank, world_size, t):
    from labkit.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    group, i, _ = _group(t)
    torch.manual_seed(0)
    ref = nn.Linear(IN, OUT)
    x, dy = _randn((S, B, IN), 1), _randn((S, B, OUT), 2)
    rows, cols = slice(i * OUT // t, (i + 1) * OUT // t), slice(i * IN // t,
                                                               (i + 1) * IN // t)
    seq = slice(i * S // t, (i + 1) * S // t)
    cases = {  # name: (layer, its input, the gradient of its output)
        "column": (ColumnParallelLinear.from_linear(ref, group), x, dy[..., rows]),
        "column, gather_output": (ColumnParallelLinear.from_linear(
            ref, group, gather_output=True), x, dy),
        "column, sequence_parallel": (ColumnParallelLinear.from_linear(
            ref, group, sequence_parallel=True), x[seq], dy[..., rows]),
        "row": (RowParallelLinear.from_linear(ref, group), x[..., cols], dy),
        "row, whole input": (RowParallelLinear.from_linear(
            ref, group, input_is_parallel=False), x, dy),
        "row, sequence_parallel": (RowParallelLinear.from_linear(
            ref, group, sequence_parallel=True), x[..., cols], dy[seq]),
    }
    out = {"i": i}
    for name, (layer, inp, grad) in cases.items():
        inp = inp.clone().requires_grad_()
        y = layer(inp)
        y.backward(grad)
        out[name] = {"y": y.detach(), "dx": inp.grad, "dw": layer.weight.grad,
                     "db": layer.bias.grad}
    return out


@pytest.fixture(scope="module")
def linears(cluster):
    return {t: cluster.run(_linears, t).values for t in (2, 4)}


@pytest.mark.parametrize("t", [2, 4])
def test_linear_layers_match_one_nn_linear(linears, t):
    torch.manual_seed(0)
    ref = nn.Linear(IN, OUT)
    x = _randn((S, B, IN), 1).requires_grad_()
    y = ref(x)
    y.backward(_randn((S, B, OUT), 2))
    for r in linears[t]:
        i = r["i"]
        rows = slice(i * OUT // t, (i + 1) * OUT // t)
        cols = slice(i * IN // t, (i + 1) * IN // t)
        seq = slice(i * S // t, (i + 1) * S // t)
        want = {  # (output, input grad, weight grad, bias grad) this rank holds
            "column": (y[..., rows], x.grad, ref.weight.grad[rows],
                       ref.bias.grad[rows]),
            "column, gather_output": (y, x.grad, ref.weight.grad[rows],
                                      ref.bias.grad[rows]),
            "column, sequence_parallel": (y[..., rows], x.grad[seq],
                                          ref.weight.grad[rows], ref.bias.grad[rows]),
            "row": (y, x.grad[..., cols], ref.weight.grad[:, cols], ref.bias.grad),
            "row, whole input": (y, x.grad, ref.weight.grad[:, cols], ref.bias.grad),
            "row, sequence_parallel": (y[seq], x.grad[..., cols],
                                       ref.weight.grad[:, cols], None),
        }
        for name, wants in want.items():
            for key, w in zip(("y", "dx", "dw", "db"), wants):
                if w is not None:
                    got = r[name][key]
                    assert got.shape == w.shape, (name, key)
                    assert rel_err(got, w.detach()) <= TOL, (name, key, i)
    # sequence parallel: each rank's bias sees its rows only; the sum is the bias's
    # gradient (what the all-reduce over the group that the bias is marked for gives)
    db = sum(r["row, sequence_parallel"]["db"] for r in linears[t][:t])
    assert rel_err(db, ref.bias.grad) <= TOL


# -- MLP and attention: several SGD steps ------------------------------------------

STEPS, LR = 3, 0.05
WHICH = ("mlp", "attention", "attention, not causal")


def _reference(which):
    torch.manual_seed(0)
    if which == "mlp":
        return MLP(H, FFN)
    return SelfAttention(H, HEADS, causal=which == "attention")


def _train(model, steps=STEPS):
    """Outputs and input gradients of each step, and the first step's gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, target = _randn((S, B, H), 1), _randn((S, B, H), 2)
    outs, dxs, grads = [], [], None
    for _ in range(steps):
        opt.zero_grad()
        xi = x.clone().requires_grad_()
        y = model(xi)
        F.mse_loss(y, target).backward()
        outs.append(y.detach())
        dxs.append(xi.grad)
        if grads is None:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    return {"outs": outs, "dxs": dxs, "grads": grads, "params": params}


def _train_parallel(rank, world_size, t, which):
    from labkit.parallel.tensor_parallel import ParallelMLP, ParallelSelfAttention

    group, i, _ = _group(t)
    ref = _reference(which)
    model = (ParallelMLP.from_mlp(ref, group) if which == "mlp"
             else ParallelSelfAttention.from_attention(ref, group))
    if which != "mlp":
        assert model.causal == ref.causal == (which == "attention")
    return {"i": i, **_train(model)}


def _shards(ref: dict, which, i, t):
    """This rank's slice of each of a single-process module's tensors, by the
    parallel module's names."""
    def rows(w, n):
        return w[i * n // t:(i + 1) * n // t]

    if which == "mlp":
        return {"fc1.weight": rows(ref["fc1.weight"], FFN),
                "fc1.bias": rows(ref["fc1.bias"], FFN),
                "fc2.weight": rows(ref["fc2.weight"].T, FFN).T,
                "fc2.bias": ref["fc2.bias"]}
    return {"qkv.weight": torch.cat([rows(ref[f"{m}.weight"], H) for m in "qkv"]),
            "qkv.bias": torch.cat([rows(ref[f"{m}.bias"], H) for m in "qkv"]),
            "proj.weight": rows(ref["proj.weight"].T, H).T,
            "proj.bias": ref["proj.bias"]}


@pytest.fixture(scope="module")
def trained(cluster):
    return {(t, w): cluster.run(_train_parallel, t, w).values
            for t in (2, 4) for w in WHICH}


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("which", WHICH)
def test_training_matches_one_process(trained, t, which):
    want = _train(_reference(which))
    start = dict(_reference(which).named_parameters())
    for r in trained[t, which]:
        for step in range(STEPS):
            assert rel_err(r["outs"][step], want["outs"][step]) <= TOL
            assert rel_err(r["dxs"][step], want["dxs"][step]) <= TOL
        for key in ("grads", "params"):
            shards = _shards(want[key], which, r["i"], t)
            assert r[key].keys() == shards.keys()
            for k, v in shards.items():
                assert r[key][k].shape == v.shape
                assert rel_err(r[key][k], v) <= TOL, (key, k, r["i"])
        moved = _shards({k: v.detach() for k, v in start.items()}, which, r["i"], t)
        assert all(rel_err(r["params"][k], v) > 1e-3 for k, v in moved.items())


# -- traffic ---------------------------------------------------------------------

BIG_S, BIG_B, BIG_H = 16, 4, 64  # b·s·h = 4096 elements, 16 KiB in fp32


def _traffic(rank, world_size, t, which):
    from labkit.ledger import traffic
    from labkit.parallel.tensor_parallel import ParallelMLP, ParallelSelfAttention

    group, _, _ = _group(t)
    torch.manual_seed(0)
    model = (ParallelMLP(BIG_H, 4 * BIG_H, group) if which == "mlp"
             else ParallelSelfAttention(BIG_H, 8, group))
    x = _randn((BIG_S, BIG_B, BIG_H), 1).requires_grad_()
    with traffic(model) as led:
        model(x).sum().backward()
    return led.records


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("which", ["mlp", "attention"])
def test_one_all_reduce_forward_and_one_backward(cluster, t, which):
    n = BIG_S * BIG_B * BIG_H
    for records in cluster.run(_traffic, t, which):
        assert [(r.op, r.phase, r.group_size, r.elements) for r in records] == [
            ("all_reduce", "forward", t, n), ("all_reduce", "backward", t, n)]
        for r in records:
            assert r.payload_bytes == 4 * n
            assert r.bus_bytes == 2 * (t - 1) / t * 4 * n
            # written to the sockets: the ring's 2(t-1)/t of the payload in 2(t-1)
            # steps, plus gloo's header in each (measured: 288 bytes a step)
            assert 0 <= r.wire_bytes - r.bus_bytes <= 2 * (t - 1) * 512


# -- sizes that cannot be split ---------------------------------------------------


def _bad_sizes(rank, world_size):
    from labkit.parallel import tensor_parallel as tp

    tries = {
        "column": lambda: tp.ColumnParallelLinear(8, 6),
        "row": lambda: tp.RowParallelLinear(6, 8),
        "mlp": lambda: tp.ParallelMLP(8, 10),
        "heads": lambda: tp.ParallelSelfAttention(12, 6),
        "head size": lambda: tp.ParallelSelfAttention(10, 4),
        "scatter": lambda: tp.scatter_to_tensor_model_parallel_region(
            torch.ones(2, 6)),
        "reduce-scatter": lambda: tp.reduce_scatter_to_sequence_parallel_region(
            torch.ones(6, 2)),
        "sequence scatter": lambda: tp.scatter_to_sequence_parallel_region(
            torch.ones(6, 2)),
        "both": lambda: tp.ColumnParallelLinear(8, 8, gather_output=True,
                                                sequence_parallel=True),
    }
    out = {}
    for name, make in tries.items():
        try:
            make()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def test_sizes_that_do_not_divide_raise_value_error(cluster):
    want = {
        "column": "out_features = 6 is not divisible by the tensor-parallel size 4",
        "row": "in_features = 6 is not divisible by the tensor-parallel size 4",
        "mlp": "out_features = 10 is not divisible by the tensor-parallel size 4",
        "heads": "heads = 6 is not divisible by the tensor-parallel size 4",
        "head size": "hidden = 10 is not divisible by heads = 4",
        "scatter": "the last dimension = 6 is not divisible by the tensor-parallel "
                   "size 4",
        "reduce-scatter": "the sequence length (dim 0) = 6 is not divisible",
        "sequence scatter": "the sequence length (dim 0) = 6 is not divisible",
        "both": "gather_output=True and sequence_parallel=True do not go together",
    }
    for msgs in cluster.run(_bad_sizes):
        for name, text in want.items():
            assert msgs[name] is not None and text in msgs[name], (name, msgs[name])


def test_layers_need_ranks():
    from labkit.parallel.tensor_parallel import ColumnParallelLinear

    with pytest.raises(RuntimeError, match="cluster.run"):
        ColumnParallelLinear(4, 4)


# -- PyTorch's DTensor tensor parallelism on the same MLP ---------------------------

_MESHES = {}


def _dtensor(rank, world_size, t):
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from labkit.ledger import traffic
    from labkit.parallel.tensor_parallel import ParallelMLP

    group, i, _ = _group(t)
    if t not in _MESHES:  # rows of the mesh are tensor-parallel: tp innermost
        _MESHES[t] = init_device_mesh("cpu", (world_size // t, t),
                                      mesh_dim_names=("dp", "tp"))["tp"]
    ref = _reference("mlp")
    ours = ParallelMLP.from_mlp(ref, group)
    theirs = parallelize_module(copy.deepcopy(ref), _MESHES[t],
                                {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    out = {"i": i}
    for name, m in (("ours", ours), ("theirs", theirs)):
        x = _randn((S, B, H), 1).requires_grad_()
        with traffic(m) as led:
            y = m(x)
            y.backward(_randn((S, B, H), 2))
        grads = {k: getattr(p.grad, "to_local", lambda g=p.grad: g)()
                 for k, p in m.named_parameters()}
        out[name] = {"y": y.detach(), "dx": x.grad, "grads": grads,
                     "ops": [(r.op, r.phase, r.elements) for r in led.records]}
    return out


@pytest.mark.parametrize("t", [2, 4])
def test_same_as_dtensor_colwise_rowwise(cluster, t):
    n = S * B * H
    for r in cluster.run(_dtensor, t):
        ours, theirs = r["ours"], r["theirs"]
        assert rel_err(ours["y"], theirs["y"]) <= TOL
        assert rel_err(ours["dx"], theirs["dx"]) <= TOL
        assert ours["grads"].keys() == theirs["grads"].keys()
        for k, g in theirs["grads"].items():
            assert ours["grads"][k].shape == g.shape
            assert rel_err(ours["grads"][k], g) <= TOL, k
        want = [("all_reduce", "forward", n), ("all_reduce", "backward", n)]
        assert ours["ops"] == want and theirs["ops"] == want
