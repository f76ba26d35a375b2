"""labkit.parallel.data_parallel on 4 real gloo ranks, against single-process
training of the same model on the same global batch; the bytes each rank sends;
the recorded compute/communication spans and their overlap."""

import time

import pytest
import torch
from torch import nn

from labkit.numerics import Oracle
from labkit.parallel.data_parallel import DataParallel
from labkit.ledger import Span, overlap_fraction

pytestmark = pytest.mark.numerics  # run again under other CPUs' kernels

N = 4
TINY_MB = 160 / 2**20  # 40 float32s: the Tiny model's 5 gradients fill 3 buckets


class Tiny(nn.Module):
    """Embedding tied to the output head, a frozen gain, a buffer; tensors of 77,
    35, 5, 35 and 7 elements (159 trainable, none divisible by 4)."""

    def __init__(self, vocab=11, d=7):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, 5)
        self.back = nn.Linear(5, d)
        self.gain = nn.Parameter(torch.rand(d) + 0.5, requires_grad=False)
        self.register_buffer("scale", torch.rand(d) + 0.5)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied: one tensor, two uses

    def forward(self, tokens):  # (B, T) -> (B, T, vocab)
        x = self.emb(tokens)
        h = x + self.back(torch.tanh(self.mix(x))) * self.scale
        return self.head(h * self.gain)


OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9),
              "adam": lambda ps: torch.optim.Adam(ps, lr=0.05)}


def _batches(steps=5, batch=8, seq=6, vocab=11):
    g = torch.Generator().manual_seed(1234)
    return [(torch.randint(vocab, (batch, seq), generator=g),
             torch.randint(vocab, (batch, seq), generator=g)) for _ in range(steps)]


def _loss(logits, y):  # a mean: the mean of 4 quarter-batch means is the full mean
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _reference(opt_name, batches, dtype=torch.float32, pieces=1):
    """One process: the whole batch's mean gradient, summed from `pieces` equal
    parts (1: all at once), in `dtype`."""
    torch.manual_seed(0)  # rank 0's seed: DataParallel starts every rank from it
    model = Tiny().to(dtype)
    opt = OPTIMIZERS[opt_name]([p for p in model.parameters() if p.requires_grad])
    for x, y in batches:
        opt.zero_grad()
        for xs, ys in zip(x.chunk(pieces), y.chunk(pieces)):
            (_loss(model(xs), ys) / pieces).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank, world_size, mode, bucket_mib, batches):
    out = {}
    for name, make in OPTIMIZERS.items():
        torch.manual_seed(rank)  # a different model on every rank ...
        model = Tiny()
        dp = DataParallel(model, bucket_mib, mode)  # ... until rank 0's is broadcast
        opt = make([p for p in model.parameters() if p.requires_grad])
        for x, y in batches:
            opt.zero_grad()
            mine = slice(rank * len(x) // world_size, (rank + 1) * len(x) // world_size)
            _loss(dp(x[mine]), y[mine]).backward()
            dp.finish_gradient_synchronization()
            if mode != "parameter_server" or rank == 0:
                opt.step()
            if mode == "parameter_server":
                dp.broadcast_parameters()
        out[name] = ({k: v.clone() for k, v in model.state_dict().items()},
                     dp.buckets, model.gain.grad)
    return out


@pytest.fixture(scope="module")
def reference():
    batches = _batches()
    oracles = {name: Oracle(exact=_reference(name, batches, torch.float64),
                            one_process={"whole batch": _reference(name, batches),
                                         "4 quarters": _reference(name, batches,
                                                                  pieces=N)})
               for name in OPTIMIZERS}
    return batches, oracles


@pytest.mark.parametrize("mode,bucket_mib", [
    ("overlap", None), ("overlap", TINY_MB), ("naive", None), ("naive", TINY_MB),
    ("parameter_server", None), ("parameter_server", TINY_MB)])
def test_matches_single_process_training(cluster, reference, mode, bucket_mib):
    batches, oracles = reference
    res = cluster.run(_train, mode, bucket_mib, batches)
    torch.manual_seed(0)
    start = Tiny().state_dict()  # rank 0's untrained model
    for name, oracle in oracles.items():
        # the ranks add 4 quarter-batch means in another order than one process:
        # as far from float64 as one process is (labkit.numerics), while the
        # untrained weights are far outside that
        oracle.resolves(start, f"{name}: the untrained model")
        for rank, result in enumerate(res):
            state, buckets, frozen_grad = result[name]
            oracle.check(state, f"{mode}, bucket_mib={bucket_mib}, {name}, rank {rank}")
            # and the ranks agree bit for bit: they applied the same mean gradient
            assert all(torch.equal(state[k], res[0][name][0][k]) for k in state)
            assert torch.equal(state["gain"], start["gain"])  # frozen: never moves
            assert torch.equal(state["scale"], start["scale"])  # rank 0's buffer
            assert frozen_grad is None
        if bucket_mib is None:
            assert buckets == [["back.bias"], ["back.weight"], ["mix.bias"],
                               ["mix.weight"], ["emb.weight"]]
        else:  # reverse registration order; a bucket closes at >= 160 bytes
            assert buckets == [["back.bias", "back.weight"],
                               ["mix.bias", "mix.weight"], ["emb.weight"]]


# -- bytes on the wire, per rank, by the traffic ledger -----------------------------

BIG = dict(vocab=2047, d=255)  # 2047*255 + 255*5+5 + 5*255+255 = 524,795 trainable


def _one_step_traffic(rank, world_size):
    from labkit.ledger import traffic

    out = {}
    for mode, bucket_mib in [("overlap", None), ("overlap", 0.001), ("naive", None),
                            ("parameter_server", None), ("parameter_server", 0.001)]:
        torch.manual_seed(0)
        model = Tiny(**BIG)
        dp = DataParallel(model, bucket_mib, mode)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                              lr=0.1)
        x, y = (torch.randint(BIG["vocab"], (2, 8)) for _ in range(2))
        # inside the ledger each collective runs to completion before the next
        # starts: the bytes are exact, the overlap is gone
        with traffic() as t:
            _loss(dp(x), y).backward()
            dp.finish_gradient_synchronization()
            if mode != "parameter_server" or rank == 0:
                opt.step()
            if mode == "parameter_server":
                dp.broadcast_parameters()
        out[mode, bucket_mib] = [(r.op, r.phase, r.wire_bytes) for r in t.records]
        out[mode, bucket_mib, "check"] = [
            (r.payload_bytes, r.wire_bytes) for r in t.records
            if r.phase == DataParallel.CHECK_PHASE]
    return out


@pytest.fixture(scope="module")
def wires(cluster):
    return cluster.run(_one_step_traffic)


def _sum(records, op):
    return sum(w for o, _, w in records if o == op)


def test_psi_counts_tied_weights_once_and_frozen_ones_never():
    model = Tiny(**BIG)
    psi = 2047 * 255 + (255 * 5 + 5) + (5 * 255 + 255)
    assert psi == 524_795 and psi % N != 0
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == psi


def _checked(records):
    """The records less the usage check's: one all-gather, in its own phase,
    after every gradient's collective."""
    at = [i for i, r in enumerate(records) if r[1] == DataParallel.CHECK_PHASE]
    assert len(at) == 1 and records[at[0]][0] == "all_gather", records
    assert all(op in ("all_reduce", "gather") for op, _, _ in records[:at[0]])
    assert all(op == "scatter" for op, _, _ in records[at[0] + 1:])
    return records[:at[0]] + records[at[0] + 1:]


def test_the_usage_check_sends_a_bit_a_parameter(wires):
    # Tiny(**BIG) has 5 trainable tensors: one byte of bitmask a rank, N in all
    for records in wires:
        for key, recs in records.items():
            if key[-1] == "check":
                (payload, wire), = recs
                assert payload == N, (key, payload)
                # gloo's ring all-gather: N-1 steps, each a header and one byte
                assert 0 < wire <= (N - 1) * 512, (key, wire)


@pytest.mark.parametrize("mode,bucket_mib,calls", [
    ("overlap", None, 5), ("overlap", 0.001, 3), ("naive", None, 5)])
def test_all_reduce_modes_send_2_n_minus_1_over_n_of_the_gradients(
        wires, mode, bucket_mib, calls):
    S = 4 * 524_795  # fp32 gradient bytes: the tied weight once, the frozen never
    for records in wires:
        recs = _checked(records[mode, bucket_mib])
        assert [op for op, _, _ in recs] == ["all_reduce"] * calls
        # per rank, ring all-reduce (Patarasuk & Yuan 2009): 2(N-1)/N * S; gloo's
        # headers add ~2 KB a call (measured 1.5033 S with 5 calls, 1.5016 with 2)
        assert abs(_sum(recs, "all_reduce") - 2 * (N - 1) / N * S) <= 0.01 * S
        # overlap issues every all-reduce inside backward; naive only after it
        in_backward = {phase == "backward" for _, phase, _ in recs}
        assert in_backward == {mode == "overlap"}


@pytest.mark.parametrize("bucket_mib", [None, 0.001])
def test_parameter_server_link_carries_n_minus_1_times_a_workers(wires, bucket_mib):
    S = 4 * 524_795
    recs = [_checked(records["parameter_server", bucket_mib]) for records in wires]
    server, workers = recs[0], recs[1:]
    # each worker sends its gradients once (gather to rank 0) and receives the
    # weights once; the server sends the weights to each of N-1 workers (scatter)
    for w in workers:
        assert abs(_sum(w, "gather") - S) <= 0.01 * S
        assert _sum(w, "scatter") <= 0.01 * S
    assert _sum(server, "gather") <= 0.01 * S
    assert abs(_sum(server, "scatter") - (N - 1) * S) <= 0.01 * S
    # what the workers sent, the server received: (N-1) S in, (N-1) S out
    assert abs(sum(_sum(w, "gather") for w in workers) - (N - 1) * S) <= 0.01 * S


# -- recorded spans and their overlap -------------------------------------------


def test_overlap_fraction_by_hand():
    events = [Span("compute", "backward", 0.0, 10.0),
              Span("comm", "a", 2.0, 4.0),  # inside compute: 2 of 2
              Span("comm", "b", 8.0, 12.0),  # 8..10 inside: 2 of 4
              Span("comm", "c", 11.0, 13.0),  # overlaps b: union 8..13
              Span("compute", "backward", 20.0, 25.0),
              Span("compute", "backward", 22.0, 24.0),  # inside the one before
              Span("comm", "d", 24.0, 30.0)]  # 24..25 inside: 1 of 6
    # comm union: 2..4, 8..13, 24..30 = 2 + 5 + 6 = 13 s; with compute: 2 + 2 + 1
    assert overlap_fraction(events) == pytest.approx(5 / 13)
    assert overlap_fraction(events[:1]) == 0.0  # no communication
    assert overlap_fraction([Span("comm", "x", 0, 1)]) == 0.0  # nothing computed
    assert Span("comm", "x", 1.0, 3.5).seconds == 2.5


def _spans(rank, world_size, mode, bucket_mib):
    from labkit.ledger import overlap_fraction

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh())
                            for _ in range(6)])
    dp = DataParallel(model, bucket_mib, mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    fractions = []
    for _ in range(3):
        opt.zero_grad()
        dp(torch.randn(64, 256)).square().mean().backward()
        dp.finish_gradient_synchronization()
        opt.step()
        fractions.append(overlap_fraction(dp.events))
    return fractions, dp.events, len(dp.buckets)


@pytest.mark.parametrize("mode,bucket_mib", [
    ("overlap", None), ("overlap", 0.25), ("naive", None)])
def test_spans_on_real_ranks(cluster, mode, bucket_mib):
    grad_bytes = 6 * (256 * 256 + 256) * 4
    for fractions, events, buckets in cluster.run(_spans, mode, bucket_mib):
        compute = [e for e in events if e.kind == "compute"]
        comm = [e for e in events if e.kind == "comm"]
        assert len(compute) == 1  # the last step's backward only: cleared per step
        assert len(comm) == buckets == (12 if bucket_mib is None else 6)
        assert sum(e.nbytes for e in comm) == grad_bytes
        assert all(e.end >= e.start for e in events)
        if mode == "naive":  # communication starts once backward has ended
            assert min(e.start for e in comm) >= compute[0].end
            assert fractions == [0.0] * len(fractions), (
                f"naive: overlap {fractions}; none expected")
        # overlap and bucketed: how much overlaps is a timing: no more asserted
            assert fractions == [0.0, 0.0, 0.0]


# -- buffers ---------------------------------------------------------------------


class Shift(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("offset", torch.zeros(3))

    def forward(self, x):
        return self.lin(x) + self.offset


def _buffers(rank, world_size, every_step):
    model = Shift()
    dp = DataParallel(model, broadcast_buffers=every_step)
    model.offset.fill_(rank + 1.0)  # ranks drift apart (e.g. running statistics)
    with torch.no_grad():
        dp(torch.zeros(1, 3))
    return model.offset.clone()


def test_buffers_broadcast_at_every_forward_only_when_asked(cluster):
    drifted = cluster.run(_buffers, False)
    assert [b[0].item() for b in drifted] == [1.0, 2.0, 3.0, 4.0]
    synced = cluster.run(_buffers, True)
    assert all(torch.equal(b, torch.full((3,), 1.0)) for b in synced)  # rank 0's


# -- errors ------------------------------------------------------------------------


def test_bad_arguments_and_no_process_group():
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="bucket_mib must be > 0"):
            DataParallel(nn.Linear(2, 2), bucket_mib=bad)
    with pytest.raises(ValueError, match="mode must be one of"):
        DataParallel(nn.Linear(2, 2), mode="allreduce")
    with pytest.raises(RuntimeError, match="process group"):
        DataParallel(nn.Linear(2, 2))  # this test process has none


def _misuse(rank, world_size):
    from torch.optim import optimizer as optim

    errors = {}

    def expect(name, exc, fn):
        try:
            fn()
        except exc as e:
            errors[name] = str(e)

    def overlap(model):
        dp = DataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        dp(torch.randn(4, 7)).sum().backward()
        expect("step", RuntimeError, opt.step)  # before finish
        expect("twice", RuntimeError,
               lambda: dp(torch.randn(4, 7)).sum().backward())
        dp.finish_gradient_synchronization()
        opt.step()  # fine now
        return len(optim._global_optimizer_pre_hooks)

    expect("meta", ValueError,
           lambda: DataParallel(nn.Linear(2, 2, device="meta")))
    hooks_before = len(optim._global_optimizer_pre_hooks)
    model = nn.Linear(7, 5)
    hooks_alive = overlap(model)  # the wrapper is gone: so are all its hooks
    left = [p._post_accumulate_grad_hooks for p in model.parameters()]
    model(torch.randn(4, 7)).sum().backward()  # the plain module, no all-reduce

    ps_model = nn.Linear(7, 5)
    ps = DataParallel(ps_model, mode="parameter_server")
    ps_opt = torch.optim.SGD(ps_model.parameters(), lr=0.1)
    ps(torch.randn(4, 7)).sum().backward()
    ps.finish_gradient_synchronization()
    if rank != 0:
        expect("worker step", RuntimeError, ps_opt.step)
    expect("stale", RuntimeError, lambda: ps(torch.randn(4, 7)))
    ps.broadcast_parameters()
    ps(torch.randn(4, 7))  # fine now
    ps.close()
    hooks_after = len(optim._global_optimizer_pre_hooks)
    return errors, (hooks_before, hooks_alive, hooks_after), left


def test_misuse_on_ranks_raises_clear_errors_and_hooks_go_away(cluster):
    for rank, (errors, hooks, left) in enumerate(cluster.run(_misuse)):
        assert "device meta" in errors["meta"] and "materialize" in errors["meta"]
        assert ("call finish_gradient_synchronization() before optimizer.step()"
                in errors["step"])
        assert "second backward" in errors["twice"]
        assert "broadcast_parameters()" in errors["stale"]
        if rank != 0:
            assert "only rank 0, the server" in errors["worker step"]
        before, alive, after = hooks
        assert (alive, after) == (before + 1, before)
        assert not any(left)  # no gradient hook left on the parameters


def test_first_bucket_cap_starts_the_first_all_reduce_early():
    from labkit.parallel.buckets import fill

    mib = 2**20
    sizes = {"a": 2 * mib, "b": 3 * mib, "c": 1 * mib, "d": 1 * mib}
    tensors = {n: torch.empty(b // 4) for n, b in sizes.items()}
    names = {id(t): n for n, t in tensors.items()}
    plain = fill(list(tensors.values()), cap=4 * mib)
    early = fill(list(tensors.values()), cap=4 * mib, first_cap=1 * mib)
    assert [[names[id(t)] for t in g] for g in plain] == [["a", "b"], ["c", "d"]]
    assert [[names[id(t)] for t in g] for g in early] == [["a"], ["b", "c"], ["d"]]


def _views(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    dp = DataParallel(model, bucket_mib=1.0)  # one bucket of all four
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
    out = {}
    for step, set_to_none in enumerate((True, True, False, False)):
        model.zero_grad(set_to_none=set_to_none)
        dp(x).square().sum().backward()
        dp.finish_gradient_synchronization()
        grads = [p.grad for p in model.parameters()]
        out[step] = {"storages": {g.untyped_storage().data_ptr() for g in grads},
                     "kept": [g.clone() for g in grads], "held": grads}
    result = {k: {"storages": v["storages"], "kept": v["kept"],
                  "held": [g.clone() for g in v["held"]]} for k, v in out.items()}
    import weakref

    del out, grads  # nothing kept now: zero_grad(set_to_none=True) frees the buffer
    flat = weakref.ref(model[0].weight.grad._base)  # the bucket's buffer
    model.zero_grad(set_to_none=True)
    for _ in range(200):  # gloo's worker thread lets go of a collective's tensors
        if flat() is None:  # a moment after it completes
            break
        time.sleep(0.01)
    return flat() is None, result


def test_a_buckets_grads_are_views_of_one_buffer_and_kept_ones_stay_put(cluster):
    """As DDP's gradient_as_bucket_view: after finish, a bucket's .grads share one
    buffer (sent as it is: no packing copy, no copy back); a .grad someone kept
    from the last step is left alone after zero_grad(set_to_none=True), as with
    torch's own .grads, and freed with them when nobody holds them; with
    set_to_none=False the buffer is summed into in place."""
    for rank, (freed, out) in enumerate(cluster.run(_views)):
        assert freed, (f"rank {rank}: zero_grad(set_to_none=True) left the bucket's "
                       "buffer alive; torch's own .grads would be freed")
        for step, o in out.items():
            assert len(o["storages"]) == 1, (
                f"rank {rank}, step {step}: the bucket's 4 .grads live in "
                f"{len(o['storages'])} storages; expected 1")
            for kept, held in zip(o["kept"], o["held"]):  # held at the end
                torch.testing.assert_close(held, kept, rtol=0, atol=0)
        new = [out[s]["storages"] != out[s - 1]["storages"] for s in (1, 2, 3)]
        assert new == [True, False, False], (  # zero_grad before steps 1, 2, 3:
            f"rank {rank}: a new buffer at steps 1-3: {new}; expected one after "
            "the set_to_none=True zero_grad, the same buffer after each "
            "set_to_none=False one")


# -- checkpointed blocks (issue 20): a reentrant checkpoint runs a backward inside ours


def _checkpointed(rank, world_size, wrapper, how, reentrant):
    from labkit.parallel import ShardedOptimizer
    from tests.models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(checkpoint=how, reentrant=reentrant)
    ids = _gpt_batch()[rank * 2:(rank + 1) * 2]
    adamw = dict(lr=1e-2, eps=1e-6)  # eps: see test_parallel_fsdp_models.py
    if wrapper == "DataParallel":
        dp = DataParallel(model, bucket_mib=0.01)  # several buckets
        opt, sync = torch.optim.AdamW(model.parameters(), **adamw), \
            dp.finish_gradient_synchronization
    else:  # ZeRO-2: its hooks reduce-scatter during backward
        dp, sync = model, (lambda: None)
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2,
                               bucket_mib=0.01, **adamw)
    for _ in range(3):
        opt.zero_grad()
        dp(input_ids=ids, labels=ids).backward()
        sync()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _gpt_batch():
    return torch.randint(0, 37, (2 * N, 8), generator=torch.Generator().manual_seed(1))


def _gpt_one_process(dtype, pieces=1):
    from tests.models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT().to(dtype)
    ids = _gpt_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    for _ in range(3):
        opt.zero_grad()
        for part in ids.chunk(pieces):
            (model(input_ids=part, labels=part) / pieces).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_checkpointed_blocks_train_as_one_process(cluster):
    oracle = Oracle(_gpt_one_process(torch.float64), {
        "whole batch": _gpt_one_process(torch.float32),
        f"{N} quarters": _gpt_one_process(torch.float32, N)})
    for wrapper in ("DataParallel", "ShardedOptimizer stage 2"):
        for how in ("forward", "call"):
            for reentrant in (False, True):
                got = cluster.run(_checkpointed, wrapper, how, reentrant).values
                for rank, params in enumerate(got):
                    oracle.check(params, f"{wrapper}, checkpoint around {how}, "
                                 f"reentrant={reentrant}, rank {rank}")


# -- parameters used on some ranks only (issue 36) ------------------------------


class Branchy(nn.Module):
    """Two branches of one shape, picked per call (a data-dependent `if`), and a
    third that no call uses."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x, which):
        return sum(getattr(self, w)(x) for w in which)


def _branches(rank, world_size, mode, bucket_mib):
    import copy

    torch.manual_seed(0)
    model = Branchy()
    dp = DataParallel(model, bucket_mib, mode)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
    out = {}
    # rank 0 takes branch a, the others b: the ranks used different parameters
    dp(x, "a" if rank == 0 else "b").square().sum().backward()
    try:
        dp.finish_gradient_synchronization()
        out["refused"] = None
    except RuntimeError as e:
        out["refused"] = str(e)
    out["grads after refusal"] = [p.grad for p in model.parameters()]
    # every rank takes a (b and c unused on every rank): accepted, and a's
    # gradient is the mean of the ranks' own, computed here on one rank
    want = []
    for r in range(world_size):
        m = copy.deepcopy(model)
        xr = torch.randn(4, 3, generator=torch.Generator().manual_seed(r))
        m(xr, "a").square().sum().backward()
        want.append(m.a.weight.grad)
    dp(x, "a").square().sum().backward()
    dp.finish_gradient_synchronization()
    if mode == "parameter_server":
        dp.broadcast_parameters()
    out["a"] = model.a.weight.grad, sum(want) / world_size
    out["unused"] = [model.b.weight.grad, model.c.weight.grad]
    # accumulated: a then b on rank 0, b then a elsewhere: the same in all
    if mode != "parameter_server":
        model.zero_grad()
        with dp.no_sync():
            dp(x, "a" if rank == 0 else "b").sum().backward()
        dp(x, "b" if rank == 0 else "a").sum().backward()
        dp.finish_gradient_synchronization()
    return out


@pytest.mark.parametrize("mode,bucket_mib", [
    ("overlap", None), ("overlap", 1.0), ("naive", None),
    ("parameter_server", None)])
def test_parameters_used_on_some_ranks_only_are_refused_by_name(
        cluster, mode, bucket_mib):
    for rank, out in enumerate(cluster.run(_branches, mode, bucket_mib)):
        msg = out["refused"]
        assert msg is not None, (
            f"{mode}, rank {rank}: rank 0 used a, the others b, and no error")
        assert ("'a.weight' got a gradient on rank 0 but not on ranks 1, 2, 3"
                in msg), msg
        assert ("'b.weight' got a gradient on ranks 1, 2, 3 but not on rank 0"
                in msg), msg
        assert "c.weight" not in msg, msg  # unused everywhere: fine
        assert all(g is None for g in out["grads after refusal"]), (
            "the refused step's gradients were not dropped")
        got, want = out["a"]
        if mode != "parameter_server" or rank == 0:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        assert out["unused"] == [None, None]  # unused on every rank: untouched


def _two_orders(rank, world_size):
    import copy

    torch.manual_seed(0)
    model = Branchy()
    dp = DataParallel(model)  # overlap, a bucket a tensor

    def loss(m, x, r):  # every rank uses a and b, in an order set by its data
        return (m.b(m.a(x)) if r % 2 == 0 else m.a(m.b(x))).square().sum()

    want = {k: 0 for k in ("a.weight", "b.weight")}
    for r in range(world_size):  # each rank's own gradients, on this rank
        m = copy.deepcopy(model)
        loss(m, torch.randn(4, 3, generator=torch.Generator().manual_seed(r)),
             r).backward()
        for k in want:
            want[k] = want[k] + m.get_parameter(k).grad / world_size
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
    loss(model, x, rank).backward()  # DataParallel's hooks are on the params
    dp.finish_gradient_synchronization()
    return {k: (model.get_parameter(k).grad, w) for k, w in want.items()}


def test_buckets_go_out_in_order_whatever_order_backward_makes_them(cluster):
    # rank 0's backward makes b's gradients first, rank 1's a's: sent as they
    # came, rank 0's b.bias would be averaged with rank 1's a.bias
    for rank, grads in enumerate(cluster.run(_two_orders)):
        for k, (got, want) in grads.items():
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7,
                                       msg=f"rank {rank}, {k}")
