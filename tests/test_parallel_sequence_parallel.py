"""labkit.parallel.sequence_parallel and ring_attention on 4 gloo ranks, in groups of
2 (ParallelGroups: ranks {0, 1} and {2, 3}) and of 4 (the world).

Sequence parallelism: the layer on sequence shards against the single-process
TransformerLayer it is sliced from (outputs, input gradients, every weight
gradient with the LayerNorms', three SGD steps); its all-gathers and
reduce-scatters against tensor parallelism's all-reduces (traffic ledger); its
activation memory against Korthikanti et al.'s table 2 (memory ledger); PyTorch's
SequenceParallel on DTensor. Ring attention: exact against whole-sequence
attention, forward and backward, causal or not; what it sends."""

import copy

import pytest
import torch

from labkit.numerics import Oracle
from labkit.parallel.models import TransformerLayer
from labkit.theory import activation_memory

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels

S, B, H, HEADS, FFN = 8, 2, 16, 4, 32  # sequence, batch, hidden, heads, MLP width
STEPS = 3
# The ranks add t partial sums in another order than one matmul adds them: their
# results are as far from float64 as one process's (labkit.numerics.Oracle).
_BUILT = {}  # per rank process: the groups of each size, built once


def _group(t, dim="tp"):
    """(group, this rank's index in it); t = 4: the world (group None)."""
    import torch.distributed as dist

    from labkit.parallel.groups import ParallelGroups

    if t == dist.get_world_size():
        return None, dist.get_rank()
    if (t, dim) not in _BUILT:
        _BUILT[t, dim] = ParallelGroups.build(**{dim: t},
                                              dp=dist.get_world_size() // t)
    g = _BUILT[t, dim]
    return getattr(g, f"{dim}_group"), getattr(g, f"{dim}_rank")


def _randn(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)
                       ).to(dtype)


def _oracle(exact, one_process):
    """labkit.numerics.Oracle: `exact` in float64, one process's float32."""
    return Oracle(exact, {"one process": one_process})


def _reference(**kw):
    torch.manual_seed(0)
    return TransformerLayer(H, HEADS, FFN, **kw)


def _rows(x, i, t, sp):
    return x[i * S // t:(i + 1) * S // t] if sp else x


# -- the layer against one process ------------------------------------------------


def _sliced(layer, group, sp, values):
    """values(module) -> tensors: those of `layer`'s parallel slice on this rank,
    in its parameter order, in `layer`'s dtype (from_layer keeps it)."""
    from labkit.parallel.sequence_parallel import ParallelTransformerLayer

    return values(ParallelTransformerLayer.from_layer(layer, group,
                                                      sequence_parallel=sp))


def _grads_as_weights(layer):
    """A copy of `layer` whose weights are its gradients."""
    grads = copy.deepcopy(layer)
    for g, p in zip(grads.parameters(), layer.parameters()):
        g.data = p.grad.clone()
    return grads


def _train(rank, world_size, t, sp, regather, sync=True, steps=STEPS):
    from labkit.parallel.sequence_parallel import (
        ParallelTransformerLayer,
        sync_sequence_parallel_grads,
    )

    group, i = _group(t)
    ref = _reference()
    exact = copy.deepcopy(ref).double()
    par = ParallelTransformerLayer.from_layer(ref, group, sequence_parallel=sp,
                                              regather=regather)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, exact, par)]
    names = [k for k, _ in par.named_parameters()]
    runs, unsynced = {}, {}  # key: (the ranks', one process's, float64) per step

    def note(key, got, want, want64):
        for run, x in zip(runs.setdefault(key, ([], [], [])), (got, want, want64)):
            run.append(x.detach().clone())

    for step in range(steps):
        x, dy = _randn((S, B, H), 10 + step), _randn((S, B, H), 20 + step)
        ys, xs = [], []
        for m in (ref, exact):
            xm = x.to(next(m.parameters()).dtype).clone().requires_grad_()
            ym = m(xm)
            ym.backward(dy.to(ym.dtype))
            ys.append(_rows(ym, i, t, sp))
            xs.append(_rows(xm.grad, i, t, sp))
        xp = _rows(x, i, t, sp).clone().requires_grad_()
        yp = par(xp)
        yp.backward(_rows(dy, i, t, sp))
        unsynced = {k: p.grad.clone() for k, p in par.named_parameters()
                    if k.startswith("ln")}
        if sync:
            sync_sequence_parallel_grads(par, group)
        note("output", yp, *ys)
        note("input grad", xp.grad, *xs)
        wants = [_sliced(_grads_as_weights(m), group, sp,
                         lambda p: [w.detach() for w in p.parameters()])
                 for m in (ref, exact)]
        for k, p, w, w64 in zip(names, par.parameters(), *wants):
            assert p.grad.shape == w.shape, k
            note(f"grad {k}", p.grad, w, w64)
        for o in opts:
            o.step()
            o.zero_grad()
        nows = [_sliced(m, group, sp, lambda p: [w.detach() for w in p.parameters()])
                for m in (ref, exact)]
        for k, p, w, w64 in zip(names, par.parameters(), *nows):
            note(f"step {k}", p, w, w64)
    start = _sliced(_reference(), group, sp,
                    lambda p: [w.detach() for w in p.parameters()])
    return {"runs": runs, "unsynced": unsynced, "start": dict(zip(names, start))}


def _together(runs, prefix):
    """(the ranks', one process's, float64) of every key starting with prefix."""
    keys = [k for k in runs if k.startswith(prefix)]
    return [{k: runs[k][j] for k in keys} for j in range(3)]


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("sp,regather", [(False, True), (True, True), (True, False)],
                         ids=["tensor parallel", "sequence parallel",
                              "sequence parallel, gathered input kept"])
def test_matches_single_process(cluster, t, sp, regather):
    res = cluster.run(_train, t, sp, regather).values
    for rank, r in enumerate(res):
        names = set(r["runs"])
        want = {"output", "input grad", "grad ln1.weight", "grad ln2.bias",
                "grad attn.qkv.weight", "grad mlp.fc2.bias", "step ln1.weight"}
        assert want <= names, f"rank {rank}: {sorted(want - names)} not compared"
        # every step's output, input gradient, weight gradients, weights
        for what in ("output", "input grad", "grad ", "step "):
            got, one, exact = _together(r["runs"], what)
            oracle = _oracle(exact, one)
            oracle.check(got, f"t={t}, sp={sp}, regather={regather}, rank {rank}: "
                              f"{what.strip()}, {STEPS} steps")
        # three steps moved the weights
        oracle.resolves({f"step {k}": [w] * STEPS for k, w in r["start"].items()},
                        f"rank {rank}: the untrained weights")


def test_layernorm_grads_are_part_sums_until_synced(cluster):
    res = cluster.run(_train, 4, True, True, False, 1).values
    for rank, r in enumerate(res):
        ln = [k for k in r["runs"] if k.startswith("grad ln")]
        assert len(ln) == 4, (rank, ln)
        for k in ln:  # each rank saw 2 of 8 positions: far from the whole
            got, one, exact = r["runs"][k]
            _oracle(exact, one).resolves(got, f"rank {rank}: unsynced {k}")
        split = [k for k in r["runs"] if k.startswith("grad")
                 and "ln" not in k and "bias" not in k]
        assert len(split) == 4, (rank, split)
        for k in split:  # split weights need no sync
            got, one, exact = r["runs"][k]
            _oracle(exact, one).check(got, f"rank {rank}: {k}, not synced")
    # the four part sums add up to one process's gradient
    ones = []
    for dtype in (torch.float32, torch.float64):
        ref = _reference().to(dtype)
        ref(_randn((S, B, H), 10, dtype)).backward(_randn((S, B, H), 20, dtype))
        ones.append({k: p.grad for k, p in ref.named_parameters()})
    for k in ones[0]:
        if k.startswith("ln"):
            _oracle(ones[1][k], ones[0][k]).check(
                sum(r["unsynced"][k] for r in res), f"{k}: the 4 part sums added")


# -- what it sends ----------------------------------------------------------------

BIG = (32, 2, 64, 4)  # S, B, H, heads: 16 KiB a [s, b, h] fp32 message


def _traffic(rank, world_size, sp, regather):
    from labkit.ledger import traffic
    from labkit.parallel.sequence_parallel import ParallelTransformerLayer

    s, b, h, a = BIG
    torch.manual_seed(0)
    ref = TransformerLayer(h, a)
    par = ParallelTransformerLayer.from_layer(ref, sequence_parallel=sp,
                                              regather=regather)
    x = _randn((s, b, h), 1)
    x = (x[rank * s // world_size:(rank + 1) * s // world_size] if sp else x)
    x.requires_grad_()
    for _ in range(2):  # the second step is measured (the first connects peers)
        with traffic() as t:
            par(x).backward(torch.ones(s // world_size if sp else s, b, h))
    return [(r.op, r.phase, r.payload_bytes, r.bus_bytes, r.wire_bytes)
            for r in t.records]


def test_all_gather_and_reduce_scatter_send_what_all_reduce_sends(cluster):
    s, b, h, a = BIG
    n, msg = cluster.world_size, s * b * h * 4  # one [s, b, h] fp32 tensor
    tp = cluster.run(_traffic, False, True).values
    sp = cluster.run(_traffic, True, False).values
    again = cluster.run(_traffic, True, True).values
    for r in range(n):
        ops = [(op, ph) for op, ph, *_ in tp[r]]
        assert ops == [("all_reduce", "forward")] * 2 + [
            ("all_reduce", "backward")] * 2, f"tensor parallel, rank {r}: {ops}"
        # all_to_all: labkit's reduce-scatter (gloo's own sends all-reduce bytes)
        ops = [(op, ph) for op, ph, *_ in sp[r]]
        assert ops == [("all_gather", "forward"), ("all_to_all", "forward")] * 2 + [
            ("all_gather", "backward"), ("all_to_all", "backward")] * 2, (
            f"sequence parallel, rank {r}: {ops}")
        sizes = {rec[2] for rec in tp[r] + sp[r]}
        assert sizes == {msg}, f"rank {r}: payloads {sizes} B, each {msg:,} expected"
        bus_tp, bus_sp = (sum(rec[3] for rec in x[r]) for x in (tp, sp))
        bus = 8 * (n - 1) / n * msg
        assert bus_tp == bus_sp == bus, (
            f"rank {r}: bus bytes {bus_tp:,} (tp), {bus_sp:,} (sp), {bus:,.0f}")
        # on the wire: the bus bytes plus gloo's headers, a fixed 144 bytes or so a
        # message (at most 12 messages a call here), whatever the payload
        for rec in tp[r] + sp[r]:
            assert 0 <= rec[4] - rec[3] <= 2048, (
                f"rank {r}, {rec[0]}: {rec[4] - rec[3]:,} B of headers, at most 2048")
        # Megatron's way: the shard kept, all-gathered again in backward
        extra = [rec for rec in again[r] if rec[:2] == ("all_gather", "backward")]
        assert len(again[r]) == len(sp[r]) + 2 and len(extra) == 4, (
            f"rank {r}: {len(again[r])} calls, {len(extra)} all-gathers in backward; "
            f"{len(sp[r]) + 2} and 4 expected")
        bus, want = sum(rec[3] for rec in again[r]), 10 * (n - 1) / n * msg
        assert bus == want, f"rank {r}: bus bytes {bus:,}, {want:,.0f} expected"


# -- activation memory --------------------------------------------------------------

MEM = (64, 2, 32, 4)  # S, B, H, heads: 5as/h = 40, the scores outweigh the rest
STRATEGIES = {"one process": (False, False), "tensor parallel": (True, False),
              "tensor + sequence parallel": (True, True)}


def _activations(rank, world_size):
    from labkit.ledger import forward_activations
    from labkit.parallel.sequence_parallel import ParallelTransformerLayer

    s, b, h, a = MEM
    out = {}
    for how, (tp, sp) in STRATEGIES.items():
        if not tp and rank:  # one process: measured once, on rank 0
            continue
        for recompute in ("none", "selective", "full"):
            torch.manual_seed(0)
            layer = TransformerLayer(h, a, dropout=0.1, recompute=recompute)
            if tp:
                layer = ParallelTransformerLayer.from_layer(layer,
                                                            sequence_parallel=sp)
            layer = layer.to(torch.bfloat16)
            rows = s // world_size if sp else s
            out[how, recompute] = forward_activations(
                layer, lambda rows=rows: _randn((rows, b, h), 1, torch.bfloat16))
    torch.manual_seed(0)
    kept = ParallelTransformerLayer.from_layer(
        TransformerLayer(h, a, dropout=0.1), sequence_parallel=True, regather=False)
    out["gathered input kept"] = forward_activations(
        kept.to(torch.bfloat16),
        lambda: _randn((s // world_size, b, h), 1, torch.bfloat16))
    return out


def test_activation_memory_is_table_2_plus_layernorm_statistics(cluster):
    s, b, h, a = MEM
    t, sbh = cluster.world_size, s * b * h
    for held in cluster.run(_activations, timeout=90).values:  # 7 ledgers a rank
        for (how, recompute), got in [(k, v) for k, v in held.items()
                                      if isinstance(k, tuple)]:
            tp, sp = STRATEGIES[how]
            want = activation_memory(s, b, h, a, tp=t if tp else 1, sp=sp,
                                     recompute=recompute)
            # what the table leaves out: each LayerNorm keeps its mean and
            # 1/std per position, two bf16 [s, b, 1] tensors (none when recomputed)
            stats = 0 if recompute == "full" else 2 * 2 * 2 * s * b / (t if sp
                                                                       else 1)
            assert got == want + stats, (how, recompute, got, want + stats)
        # without Megatron's re-gather the column-parallel layers keep the gathered
        # (s, b, h) input: 2sbh instead of 2sbh/t, twice
        sp = held["tensor + sequence parallel", "none"]
        more, want = held["gathered input kept"] - sp, 2 * (2 * sbh - 2 * sbh / t)
        assert more == want, f"the gathered input kept {more:,} B more, {want:,.0f}"


def _torch_sequence_parallel(rank, world_size):
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from labkit.parallel.sequence_parallel import (
        ParallelTransformerLayer,
        sync_sequence_parallel_grads,
    )

    mesh = init_device_mesh("cpu", (world_size,))
    ref = _reference()
    ours = ParallelTransformerLayer.from_layer(ref, sequence_parallel=True)
    col, row = ColwiseParallel(input_layouts=Shard(0)), RowwiseParallel(
        output_layouts=Shard(0))  # [s, b, h]: the sequence is dim 0
    plan = {"ln1": SequenceParallel(sequence_dim=0), "attn.q": col, "attn.k": col,
            "attn.v": col, "attn.proj": row, "ln2": SequenceParallel(sequence_dim=0),
            "mlp.fc1": col, "mlp.fc2": row}
    theirs = parallelize_module(copy.deepcopy(ref), mesh, plan)
    rows = slice(rank * S // world_size, (rank + 1) * S // world_size)
    out = {}
    for name, m in (("ours", ours), ("theirs", theirs)):
        x = _randn((S, B, H), 1)[rows].clone().requires_grad_()
        y = m(x)
        y.backward(_randn((S, B, H), 2)[rows])
        if name == "ours":
            sync_sequence_parallel_grads(m)
        ln = {k: p.grad for k, p in m.named_parameters() if k.startswith("ln")}
        out[name] = {"y": y.detach(), "dx": x.grad, "ln": ln}
    # PyTorch leaves the LayerNorm gradients Partial(sum): the all-reduce pending
    out["placements"] = {str(g.placements) for g in out["theirs"]["ln"].values()}
    out["theirs"]["ln"] = {k: g.full_tensor() for k, g in out["theirs"]["ln"].items()}
    return out


def _one_layer(dtype):
    """One process's layer on the whole sequence: output, input gradient and the
    LayerNorms' gradients."""
    ref = _reference().to(dtype)
    x = _randn((S, B, H), 1, dtype).requires_grad_()
    y = ref(x)
    y.backward(_randn((S, B, H), 2, dtype))
    return {"y": y.detach(), "dx": x.grad,
            "ln": {k: p.grad for k, p in ref.named_parameters() if k.startswith("ln")}}


def test_same_as_pytorch_sequence_parallel(cluster):
    one, exact = _one_layer(torch.float32), _one_layer(torch.float64)
    for rank, r in enumerate(cluster.run(_torch_sequence_parallel).values):
        theirs = r["theirs"]
        assert type(theirs["y"]) is torch.Tensor and theirs["y"].shape == (
            S // 4, B, H), (type(theirs["y"]), theirs["y"].shape)
        rows = slice(rank * S // 4, (rank + 1) * S // 4)
        # both as far from float64 as one process: within 2x that of each other
        for who in ("ours", "theirs"):
            for key in ("y", "dx"):
                _oracle(exact[key][rows], one[key][rows]).check(
                    r[who][key], f"{who}, rank {rank}: {key}")
            _oracle(exact["ln"], one["ln"]).check(
                r[who]["ln"], f"{who}, rank {rank}: the LayerNorms' gradients")
        assert r["placements"] == {"(Partial(sum),)"}, r["placements"]


# -- ring attention -----------------------------------------------------------------

RING = (2, 3, 32, 8)  # batch, heads, sequence, head dim
# The ring adds the softmax's terms block by block, rescaled by exp(m_old -
# m_new), where one process adds them in one sum: rounding differs, and the
# ring's result is as far from float64 as one process's (labkit.numerics);
# a real mistake (a block missed or counted twice, a wrong rescale) is off by
# order 1e-1.


def _ring(rank, world_size, n, causal):
    from labkit.ledger import memory, traffic
    from labkit.parallel.ring_attention import ring_attention, shard_sequence

    group, i = _group(n, "cp")
    dout = _randn(RING, 4)
    with memory() as mem, traffic() as led:  # made inside: counted when kept
        mine = [shard_sequence(_randn(RING, seed), group).requires_grad_()
                for seed in (1, 2, 3)]
        with led.phase("forward"):  # no module around it: name the phase
            out = ring_attention(*mine, group, causal=causal)
        kept = mem.current["Activation"]
        out.backward(shard_sequence(dout, group))
    c = RING[2] // n
    sends = [(r.phase, r.elements) for r in led.records if r.op == "send"]
    return {"got": {"out": out.detach(), **{f"d{name}": t.grad
                                            for name, t in zip("qkv", mine)}},
            "i": i, "sends": sends, "c": c, "kept": kept}


def _whole_attention(causal, dtype):
    """One process's attention over the whole sequence: output and gradients."""
    from labkit.parallel.models import attention

    q, k, v, dout = (_randn(RING, seed, dtype) for seed in (1, 2, 3, 4))
    full = [t.requires_grad_() for t in (q, k, v)]
    out = attention(*full, causal=causal)
    out.backward(dout)
    return {"out": out.detach(), **{f"d{n}": t.grad for n, t in zip("qkv", full)}}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_attention_is_exact(cluster, n, causal):
    one, exact = (_whole_attention(causal, d) for d in (torch.float32, torch.float64))
    for rank, r in enumerate(cluster.run(_ring, n, causal).values):
        rows = slice(r["i"] * r["c"], (r["i"] + 1) * r["c"])
        assert set(r["got"]) == {"out", "dq", "dk", "dv"}, sorted(r["got"])
        for k, got in r["got"].items():  # this rank's chunk of the sequence
            _oracle(exact[k][..., rows, :], one[k][..., rows, :]).check(
                got, f"ring of {n}, causal={causal}, rank {rank}: {k}")
        # K and V travel together: (2, b, a, c, d) a message; forward n-1 of them,
        # backward n-1 of K, V and n of their gradients
        chunk = 2 * RING[0] * RING[1] * r["c"] * RING[3]
        sends = [("forward", chunk)] * (n - 1) + [("backward", chunk)] * (2 * n - 1)
        assert r["sends"] == sends, (r["sends"], sends)
        # kept for backward: q, k, v, the output (chunks) and the log-sum-exp,
        # nothing of (s/N x s), let alone s x s
        rows = RING[0] * RING[1] * r["c"]
        kept = 4 * rows * RING[3] * 4 + rows * 4
        assert r["kept"] == kept, f"{r['kept']:,} B kept for backward, {kept:,}"


def test_ring_schedule_and_merge():
    from labkit.parallel.models import attention
    from labkit.parallel.ring_attention import (
        block_partial,
        merge_partials,
        ring_schedule,
    )

    causal = ring_schedule(4, causal=True)
    work = [sum(b.kind != "skipped" for b in causal if b.rank == r) for r in range(4)]
    # contiguous chunks: the last rank does 4x the first
    assert work == [1, 2, 3, 4], f"blocks per rank {work}"
    order = [b.chunk for b in causal if b.rank == 1]
    assert order == [1, 0, 3, 2], f"rank 1 visits chunks {order}"
    kinds = {b.kind for b in causal if b.chunk == b.rank}
    assert kinds == {"diagonal"}, f"own chunks are {kinds}"
    kinds = {b.kind for b in ring_schedule(3)}
    assert kinds == {"full"}, f"not causal: blocks {kinds}"
    # two partials over halves of the keys merge into softmax over all of them, in
    # either order: as far from float64 as one process's softmax over all
    q, k, v = (_randn((2, 8, 4), s) for s in (1, 2, 3))
    a, b = (block_partial(q, k[:, i:i + 4], v[:, i:i + 4], 0.5) for i in (0, 4))
    oracle = _oracle(attention(q.double(), k.double(), v.double(), scale=0.5),
                     attention(q, k, v, scale=0.5))
    for name, m in (("a, b", merge_partials(a, b)), ("b, a", merge_partials(b, a))):
        oracle.check(m.acc / m.l[..., None], f"merge_partials({name})")
    oracle.resolves(a.acc / a.l[..., None], "one half's softmax")
    with pytest.raises(ValueError, match="ranks n must be an integer >= 1, got 0"):
        ring_schedule(0)


def _bad_sizes(rank, world_size):
    from labkit.parallel.ring_attention import ring_attention, shard_sequence
    from labkit.parallel.tensor_parallel import scatter_to_sequence_parallel_region

    said = []
    for call in (lambda: shard_sequence(torch.zeros(1, 10, 4)),
                 lambda: scatter_to_sequence_parallel_region(torch.zeros(10, 2, 8)),
                 lambda: ring_attention(*(torch.zeros(1, 2, 4) for _ in range(2)),
                                        torch.zeros(1, 3, 4))):
        try:
            call()
        except ValueError as e:
            said.append(str(e))
    return said


def test_sizes_that_do_not_divide_raise_value_error(cluster):
    said = cluster.run(_bad_sizes)[0]
    assert len(said) == 3, len(said)
    assert "sequence length 10 is not divisible by 4 ranks" in said[0], said[0]
    assert "10" in said[1] and "4" in said[1], said[1]
    assert "(1, 2, 4), (1, 2, 4), (1, 3, 4)" in said[2], said[2]
