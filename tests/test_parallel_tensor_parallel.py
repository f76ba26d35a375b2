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

from labkit.numerics import Oracle, rel_err
from labkit.parallel.models import MLP, SelfAttention

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels

S, B, H, HEADS, FFN = 8, 2, 16, 4, 32  # sequence, batch, hidden, heads, MLP width
# The ranks add t partial sums in another order than one matmul adds them: their
# results are as far from float64 as one process's (labkit.numerics.Oracle), not
# bit for bit one process's. What only moves data is bit for bit.
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


def _randn(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)
                       ).to(dtype)


def _oracle(exact, one_process):
    """labkit.numerics.Oracle: `exact` in float64, one process's float32."""
    return Oracle(exact, {"one process": one_process})


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


# what each mapping adds up over ranks (the rest only moves data: bit for bit)
SUMS = {"reduce_from_tensor_model_parallel_region": "y",
        "reduce_scatter_to_sequence_parallel_region": "y",
        "copy_to_tensor_model_parallel_region": "dx",
        "gather_from_sequence_parallel_region": "dx"}


def _expected(name, i, ranks, dtype=torch.float32):
    """(y, dx, ops) rank i of `ranks` must see, from every rank's tensors (their
    sums in rank order, in `dtype`)."""
    t = len(ranks)
    xs = [_randn(X_SHAPE, 100 + r, dtype) for r in ranks]
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
    dys = [_randn(y.shape, 200 + r, dtype) for r in ranks]
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
        assert rank in r["ranks"] and len(r["ranks"]) == t, (rank, r["ranks"])
        want = dict(zip(("y", "dx", "ops"), _expected(name, r["i"], r["ranks"])))
        exact = dict(zip(("y", "dx"), _expected(name, r["i"], r["ranks"],
                                               torch.float64)))
        got = r[name]
        for key in ("y", "dx"):
            where = f"{name}, t={t}, rank {rank}, {key}"
            assert got[key].shape == want[key].shape, (
                f"{where}: shape {tuple(got[key].shape)}, {tuple(want[key].shape)} "
                "expected")
            if SUMS.get(name) == key:  # a sum over ranks: rounding, as one process
                _oracle(exact[key], want[key]).check(got[key], where)
            else:
                assert torch.equal(got[key], want[key]), (
                    f"{where}: off by {(got[key] - want[key]).abs().max():.1e}, "
                    "expected bit for bit (data moved, nothing added)")
        # the collective each way, and its elements
        assert got["ops"] == want["ops"], (name, t, rank, got["ops"], want["ops"])


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


def _one_linear(dtype):
    """One nn.Linear's output and input, weight and bias gradients, in `dtype`."""
    torch.manual_seed(0)
    ref = nn.Linear(IN, OUT).to(dtype)
    x = _randn((S, B, IN), 1, dtype).requires_grad_()
    y = ref(x)
    y.backward(_randn((S, B, OUT), 2, dtype))
    return {"y": y.detach(), "dx": x.grad, "dw": ref.weight.grad,
            "db": ref.bias.grad}


def _linear_wants(ref, i, t):
    """(output, input grad, weight grad, bias grad) rank i of t holds, by case."""
    y, dx, dw, db = ref["y"], ref["dx"], ref["dw"], ref["db"]
    rows = slice(i * OUT // t, (i + 1) * OUT // t)
    cols = slice(i * IN // t, (i + 1) * IN // t)
    seq = slice(i * S // t, (i + 1) * S // t)
    return {"column": (y[..., rows], dx, dw[rows], db[rows]),
            "column, gather_output": (y, dx, dw[rows], db[rows]),
            "column, sequence_parallel": (y[..., rows], dx[seq], dw[rows], db[rows]),
            "row": (y, dx[..., cols], dw[:, cols], db),
            "row, whole input": (y, dx, dw[:, cols], db),
            "row, sequence_parallel": (y[seq], dx[..., cols], dw[:, cols], None)}


@pytest.mark.parametrize("t", [2, 4])
def test_linear_layers_match_one_nn_linear(linears, t):
    one, exact = _one_linear(torch.float32), _one_linear(torch.float64)
    for r in linears[t]:
        i = r["i"]
        wants, exacts = _linear_wants(one, i, t), _linear_wants(exact, i, t)
        for name, case in wants.items():
            for key, w, e in zip(("y", "dx", "dw", "db"), case, exacts[name]):
                if w is not None:
                    got, where = r[name][key], f"{name}, t={t}, rank {i}, {key}"
                    assert got.shape == w.shape, (
                        f"{where}: shape {tuple(got.shape)}, {tuple(w.shape)} "
                        "expected")
                    _oracle(e, w).check(got, where)
    # sequence parallel: each rank's bias sees its rows only; the sum is the bias's
    # gradient (what the all-reduce over the group that the bias is marked for gives)
    db = sum(r["row, sequence_parallel"]["db"] for r in linears[t][:t])
    _oracle(exact["db"], one["db"]).check(
        db, f"row, sequence_parallel, t={t}: the ranks' bias gradients summed")


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
    dtype = next(model.parameters()).dtype
    x, target = _randn((S, B, H), 1, dtype), _randn((S, B, H), 2, dtype)
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
        assert model.causal == ref.causal == (which == "attention"), model.causal
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
    exact = _train(_reference(which).double())
    start = {k: v.detach() for k, v in _reference(which).named_parameters()}
    for r in trained[t, which]:
        where = f"{which}, t={t}, rank {r['i']}"
        # every step's output and input gradient, all together
        for key in ("outs", "dxs"):
            _oracle(exact[key], want[key]).check(r[key], f"{where}: {key}")
        for key in ("grads", "params"):  # this rank's shards
            shards = _shards(want[key], which, r["i"], t)
            assert r[key].keys() == shards.keys(), (where, key, sorted(r[key]))
            for k, v in shards.items():
                assert r[key][k].shape == v.shape, (
                    f"{where}: {key} {k} {tuple(r[key][k].shape)}, "
                    f"{tuple(v.shape)} expected")
            oracle = _oracle(_shards(exact[key], which, r["i"], t), shards)
            oracle.check(r[key], f"{where}: {key}")
        moved = _shards(start, which, r["i"], t)
        oracle.resolves(moved, f"{where}: the untrained shards")
        for k, v in moved.items():  # every tensor moved
            err = rel_err(r["params"][k], v)
            assert err > 100 * oracle.allowed, (
                f"{where}: {k} moved {err:.1e}, not more than 100 x the "
                f"{oracle.allowed:.1e} allowed")


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
        calls = [(r.op, r.phase, r.group_size, r.elements) for r in records]
        assert calls == [("all_reduce", "forward", t, n),
                         ("all_reduce", "backward", t, n)], calls
        for r in records:
            assert r.payload_bytes == 4 * n, f"payload {r.payload_bytes:,} B, 4n"
            bus = 2 * (t - 1) / t * 4 * n
            assert r.bus_bytes == bus, f"bus {r.bus_bytes:,} B, {bus:,.0f} expected"
            # written to the sockets: the ring's 2(t-1)/t of the payload in 2(t-1)
            # steps, plus gloo's header in each (measured: 288 bytes a step)
            extra = r.wire_bytes - r.bus_bytes
            assert 0 <= extra <= 2 * (t - 1) * 512, (
                f"{extra:,} B beyond the bus bytes, at most 512 a step allowed")


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


def _copied_dtypes(rank, world_size):
    from labkit.parallel.tensor_parallel import (
        ColumnParallelLinear,
        ParallelMLP,
        ParallelSelfAttention,
        RowParallelLinear,
    )

    torch.manual_seed(0)
    lin = nn.Linear(8, 8).double()
    mlp, attn = MLP(8, 16).double(), SelfAttention(8, 4).double()
    out = {}
    rows, cols = slice(2 * rank, 2 * rank + 2), slice(2 * rank, 2 * rank + 2)
    for name, part, whole in (
            ("column", ColumnParallelLinear.from_linear(lin), lin.weight[rows]),
            ("row", RowParallelLinear.from_linear(lin), lin.weight[:, cols]),
            ("mlp", ParallelMLP.from_mlp(mlp).fc1, mlp.fc1.weight[4 * rank:][:4]),
            ("attention", ParallelSelfAttention.from_attention(attn).proj,
             attn.proj.weight[:, cols])):
        w = part.weight
        out[name] = {p.dtype for p in part.parameters()}, torch.equal(w, whole)
    return out


def test_a_copied_layer_keeps_the_dtype_of_what_it_copies(cluster):
    # a float64 model's slice stays float64 (the exact reference of the tests
    # and chapters), not rounded through the default float32
    for rank, got in enumerate(cluster.run(_copied_dtypes)):
        for name, (dtypes, exact) in got.items():
            assert dtypes == {torch.float64} and exact, (rank, name, dtypes, exact)


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


def _one_mlp(dtype):
    """One process's MLP: output, input gradient and weight gradients."""
    m = _reference("mlp").to(dtype)
    x = _randn((S, B, H), 1, dtype).requires_grad_()
    y = m(x)
    y.backward(_randn((S, B, H), 2, dtype))
    return {"y": y.detach(), "dx": x.grad,
            "grads": {k: p.grad for k, p in m.named_parameters()}}


@pytest.mark.parametrize("t", [2, 4])
def test_same_as_dtensor_colwise_rowwise(cluster, t):
    n = S * B * H
    one, exact = _one_mlp(torch.float32), _one_mlp(torch.float64)
    for r in cluster.run(_dtensor, t):
        # both as far from float64 as one process: within 2x that of each other
        for who in ("ours", "theirs"):
            got, where = r[who], f"{who}, t={t}, rank {r['i']}"
            for key in ("y", "dx"):
                _oracle(exact[key], one[key]).check(got[key], f"{where}: {key}")
            grads = _shards(one["grads"], "mlp", r["i"], t)
            assert got["grads"].keys() == grads.keys(), (where, sorted(got["grads"]))
            for k, g in grads.items():
                assert got["grads"][k].shape == g.shape, (
                    f"{where}: grad {k} {tuple(got['grads'][k].shape)}, "
                    f"{tuple(g.shape)} expected")
            _oracle(_shards(exact["grads"], "mlp", r["i"], t), grads).check(
                got["grads"], f"{where}: weight gradients")
        want = [("all_reduce", "forward", n), ("all_reduce", "backward", n)]
        assert r["ours"]["ops"] == want and r["theirs"]["ops"] == want, (
            r["ours"]["ops"], r["theirs"]["ops"], want)


# -- layers built directly, the same seed on every rank (issue 36) ------------------


def _built_directly(rank, world_size, t):
    """Each layer built as its docstring shows, after torch.manual_seed(7) on
    every rank; its tensors, and the generator's next draw after it."""
    from labkit.parallel import ParallelTransformerLayer
    from labkit.parallel.tensor_parallel import (
        ColumnParallelLinear,
        ParallelMLP,
        ParallelSelfAttention,
        RowParallelLinear,
    )

    group, i, ranks = _group(t) if t > 1 else (_group_one(), 0, [rank])
    makers = {"column": lambda: ColumnParallelLinear(IN, OUT, group),
              "row": lambda: RowParallelLinear(IN, OUT, group),
              "mlp": lambda: ParallelMLP(H, FFN, group),
              "attention": lambda: ParallelSelfAttention(H, HEADS, group),
              "layer": lambda: ParallelTransformerLayer(H, HEADS, group)}
    out = {"i": i, "ranks": ranks}
    for name, make in makers.items():
        torch.manual_seed(7)
        m = make()
        out[name] = ({k: v.detach().clone() for k, v in m.state_dict().items()},
                     torch.rand(3))
    return out


def _group_one():
    import torch.distributed as dist

    if 1 not in _BUILT:  # groups of one rank each: new_group is collective
        _BUILT[1] = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return _BUILT[1][dist.get_rank()]


def _one_process(name):
    """The single-process module the parallel one stands for, built after the
    same torch.manual_seed(7), its tensors and the generator's next draw."""
    from labkit.parallel.models import TransformerLayer

    torch.manual_seed(7)
    m = {"column": lambda: nn.Linear(IN, OUT), "row": lambda: nn.Linear(IN, OUT),
         "mlp": lambda: MLP(H, FFN), "attention": lambda: SelfAttention(H, HEADS),
         "layer": lambda: TransformerLayer(H, HEADS)}[name]()
    return {k: v.detach() for k, v in m.state_dict().items()}, torch.rand(3)


def _assemble(name, parts):
    """One process's tensors from the ranks' parts, in group order."""
    def cat(key, dim=0):
        return torch.cat([p[key] for p in parts], dim)

    def linear(mine, whole, how):  # a column or row layer's parts, under `whole`
        return {f"{whole}weight": cat(f"{mine}weight", 0 if how == "col" else 1),
                f"{whole}bias": (cat(f"{mine}bias") if how == "col"
                                 else parts[0][f"{mine}bias"])}

    def attention(pre):
        qkv = {k: [p[f"{pre}qkv.{k}"].chunk(3) for p in parts]
               for k in ("weight", "bias")}
        out = {f"{pre}{m}.{k}": torch.cat([c[j] for c in qkv[k]])
               for j, m in enumerate("qkv") for k in ("weight", "bias")}
        return out | linear(f"{pre}proj.", f"{pre}proj.", "row")

    def mlp(pre):
        return (linear(f"{pre}fc1.", f"{pre}fc1.", "col")
                | linear(f"{pre}fc2.", f"{pre}fc2.", "row"))

    if name in ("column", "row"):
        return linear("", "", "col" if name == "column" else "row")
    if name == "mlp":
        return mlp("")
    if name == "attention":
        return attention("")
    return (attention("attn.") | mlp("mlp.")
            | {k: v for k, v in parts[0].items() if k.startswith("ln")})


@pytest.fixture(scope="module")
def built_directly(cluster):
    return {t: cluster.run(_built_directly, t).values for t in (1, 2, 4)}


@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("name", ["column", "row", "mlp", "attention", "layer"])
def test_layers_built_directly_hold_one_process_layer(built_directly, t, name):
    want, draw = _one_process(name)
    res = built_directly[t]
    for first in range(0, len(res), t):  # each group: ranks first .. first+t-1
        group = sorted(res[first:first + t], key=lambda r: r["i"])
        assert [r["ranks"] for r in group] == [group[0]["ranks"]] * t
        parts = [r[name][0] for r in group]
        got = _assemble(name, parts)
        assert got.keys() == want.keys(), (name, sorted(got), sorted(want))
        for k, v in want.items():
            assert torch.equal(got[k], v), (
                f"{name}, t={t}, ranks {group[0]['ranks']}: {k} assembled from "
                f"the ranks is not the one-process layer's (same seed); ranks' "
                f"parts equal: {[torch.equal(parts[0][k], p[k]) for p in parts]}")
        for r in group:  # and the generator is where one process leaves it
            assert torch.equal(r[name][1], draw), (name, t, "next draw differs")
        if t > 1:  # no two ranks hold the same rows of a split weight
            for k in parts[0]:
                if parts[0][k].dim() == 2:
                    assert not any(torch.equal(parts[a][k], parts[b][k])
                                   for a in range(t) for b in range(a + 1, t)), (
                        f"{name}, t={t}: two ranks hold the same {k}")
